"""Binder builds the book's environment from ``binder/``: it must stay in step with the root.

``binder/requirements.txt`` must pin exactly what ``requirements.txt`` pins, except
that torch comes from the PyTorch CPU index, and ``binder/runtime.txt`` must name a
Python that the package and every pinned release support.
"""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def requirement_lines(path: Path) -> list[str]:
    """The requirement and option lines of ``path``, following ``-r`` includes in place."""
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        include = re.fullmatch(r"(?:-r|--requirement)\s*(\S+)", line)
        if include:
            lines += requirement_lines(path.parent / include.group(1))
        else:
            lines.append(line)
    return lines


def pins(lines: list[str]) -> dict[str, list[str]]:
    """``name -> [version, ...]`` for every ``name==version`` line (names canonicalised)."""
    pinned: dict[str, list[str]] = {}
    for line in lines:
        if line.startswith("-"):
            continue
        requirement = Requirement(line)
        versions = [spec.version for spec in requirement.specifier if spec.operator == "=="]
        assert versions, f"not pinned to an exact version: {line!r}"
        pinned.setdefault(canonicalize_name(requirement.name), []).extend(versions)
    return pinned


def root_pins() -> dict[str, str]:
    """The root requirements' pins, one version per package."""
    pinned = pins(requirement_lines(ROOT / "requirements.txt"))
    assert all(len(v) == 1 for v in pinned.values()), "a package pinned twice in the root"
    return {name: versions[0] for name, versions in pinned.items()}


def runtime_python() -> Version:
    """The Python version ``binder/runtime.txt`` asks for, e.g. ``3.11``."""
    text = (BINDER / "runtime.txt").read_text().strip()
    match = re.fullmatch(r"python-(\d+\.\d+)", text)
    assert match, f"binder/runtime.txt must read python-X.Y, got {text!r}"
    return Version(match.group(1))


def test_requirement_parser_follows_includes_and_reads_pins(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "base.txt").write_text("# comment\n-e .\nNumPy==2.0.1  # pinned\n")
    included = "--extra-index-url X\ntorch==2.1+cpu\n-r ../base.txt\n"
    (tmp_path / "sub" / "req.txt").write_text(included)
    lines = requirement_lines(tmp_path / "sub" / "req.txt")
    assert lines == ["--extra-index-url X", "torch==2.1+cpu", "-e .", "NumPy==2.0.1"]
    assert pins(lines) == {"torch": ["2.1+cpu"], "numpy": ["2.0.1"]}


def test_binder_pins_the_root_versions_with_cpu_torch() -> None:
    root = root_pins()
    lines = requirement_lines(BINDER / "requirements.txt")
    binder = pins(lines)
    cpu_index = {f"--extra-index-url {CPU_INDEX}", f"--index-url {CPU_INDEX}"}
    assert cpu_index & set(lines), "binder must take torch from the PyTorch CPU index"
    torch = {Version(v) for v in binder.pop("torch")}
    assert Version(root["torch"]) in torch, "binder must keep the root's torch version"
    assert {f"{v.public}+cpu" for v in torch if v.local} == {f"{root['torch']}+cpu"}, (
        "binder must ask for the CPU build of the root's torch"
    )
    differ = {name: (root.get(name), v) for name, v in binder.items() if [root.get(name)] != v}
    assert differ == {}, "binder/requirements.txt pins other versions than requirements.txt"
    missing = sorted(set(root) - set(binder) - {"torch"})
    assert missing == [], "pinned in requirements.txt but not for Binder"


def test_runtime_python_is_supported_by_the_package_and_every_pin() -> None:
    python = runtime_python()
    newest = Version(f"{python}.99")  # repo2docker installs the newest patch release of X.Y
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert python in SpecifierSet(project["requires-python"]), "pyproject's requires-python"
    checked, refused = 0, []
    for name, version in root_pins().items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if Version(dist.version).public != Version(version).public:
            continue
        needed = dist.metadata.get("Requires-Python")
        if needed and newest not in SpecifierSet(needed):
            refused.append(f"{name}=={version} needs Python {needed}")
        checked += 1
    assert refused == [], f"binder/runtime.txt names Python {python}"
    assert checked >= len(root_pins()) // 2, "too few pins installed here to check"
