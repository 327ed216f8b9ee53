"""The book as a release: the installable package, its version, and how to cite it.

Colab's first cell runs a plain ``pip install git+<repository>``: no source tree
beside the installed package. :func:`test_wheel_works_without_the_source_tree`
builds the wheel as pip would, installs it into an empty virtual environment and
uses it from there (marked ``slow``: about 30 s; it needs no network). The other
tests check that the version, the citation metadata and the site agree.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

import trainscale

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "trainscale"
BUILD_INPUTS = ("pyproject.toml", "LICENSE", "src")
PIP = (sys.executable, "-m", "pip", "--quiet", "--no-input")
"""This environment's pip. It runs offline (``--no-index``): the build uses this
environment's setuptools, and the install brings no dependencies."""


def project() -> dict:
    """pyproject.toml's ``[project]`` table."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def citation() -> dict:
    """CITATION.cff, parsed."""
    return yaml.safe_load((ROOT / "CITATION.cff").read_text())


def repository_url() -> str:
    """``repository.url`` of ``_config.yml``: the one address a fork changes."""
    return yaml.safe_load((ROOT / "_config.yml").read_text())["repository"]["url"]


def git_files(*paths: str) -> list[Path]:
    """Files git tracks, or would track (untracked, not ignored), under ``paths``."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *paths],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return sorted({ROOT / name for name in listed if (ROOT / name).is_file()})


# --- version, citation, changelog -------------------------------------------------------


def test_version_comes_from_the_installed_metadata() -> None:
    assert trainscale.__version__ == metadata.version("trainscale") == project()["version"]


def test_citation_names_this_release_and_repository() -> None:
    cff = citation()
    assert cff["cff-version"] == "1.2.0"
    assert str(cff["version"]) == project()["version"]
    assert cff["repository-code"] == repository_url()
    assert cff["preferred-citation"]["repository-code"] == repository_url()
    assert cff["license"] == ["MIT", "CC-BY-4.0"]


def bibtex_block(path: Path) -> str:
    """The first BibTeX code block of a Markdown file."""
    text = path.read_text()
    assert "## How to cite" in text and "```bibtex\n" in text, f"{path.name} shows no citation"
    return text.split("```bibtex\n", 1)[1].split("```", 1)[0]


def test_intro_shows_how_to_cite_with_the_same_metadata() -> None:
    intro = (ROOT / "book" / "intro.md").read_text()
    bibtex = bibtex_block(ROOT / "book" / "intro.md")
    assert bibtex == bibtex_block(ROOT / "README.md")
    cff = citation()
    assert f"title     = {{{cff['title']}}}" in bibtex
    assert f"version   = {{{cff['version']}}}" in bibtex
    assert f"url       = {{{cff['preferred-citation']['url']}}}" in bibtex
    assert repository_url() in intro


def test_changelog_has_a_section_for_this_release() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert f"## [{project()['version']}] - {citation()['date-released']}" in changelog


def test_licenses_are_the_real_texts() -> None:
    mit = (ROOT / "LICENSE").read_text()
    assert mit.startswith("MIT License\n\nCopyright (c) ")
    assert 'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND' in mit
    cc_by = (ROOT / "LICENSE-CC-BY-4.0").read_text()
    assert cc_by.startswith("Attribution 4.0 International\n")
    for heading in range(1, 9):
        assert f"\nSection {heading} -- " in cc_by
    assert cc_by.rstrip().endswith("Creative Commons may be contacted at creativecommons.org.")


def test_site_footer_says_which_license_covers_what() -> None:
    footer = yaml.safe_load((ROOT / "_config.yml").read_text())["html"]["extra_footer"]
    assert "MIT" in footer and "CC BY 4.0" in footer
    assert "https://creativecommons.org/licenses/by/4.0/" in footer


def test_dependencies_have_lower_bounds_and_the_pins_meet_them() -> None:
    pinned = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pinned[name.lower()] = version.strip()
    for text in project()["dependencies"]:
        requirement = Requirement(text)
        assert any(spec.operator == ">=" for spec in requirement.specifier), text
        assert requirement.specifier.contains(pinned[requirement.name.lower()]), text


def test_continuous_integration_tests_the_python_binder_runs() -> None:
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "test.yml").read_text())
    setup = [
        step["with"]
        for job in workflow["jobs"].values()
        for step in job["steps"]
        if step.get("uses", "").startswith("actions/setup-python@")
    ]
    runtime = (ROOT / "binder" / "runtime.txt").read_text().strip()
    assert [f"python-{options['python-version']}" for options in setup] == [runtime]


# --- the wheel, installed where no source tree is ---------------------------------------


def build_wheel(into: Path) -> Path:
    """Build the wheel from a copy of what git has (or would add) of the build's inputs."""
    source = into / "source"
    for path in git_files(*BUILD_INPUTS):
        target = source / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    dist = into / "dist"
    offline = ["--no-index", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*PIP, "wheel", *offline, "--wheel-dir", str(dist), str(source)],
        check=True,
        timeout=300,
    )
    (wheel,) = dist.glob("trainscale-*.whl")
    return wheel


def empty_environment(folder: Path) -> Path:
    """A virtual environment that sees the book's third-party packages but not ``src/``.

    Its own site-packages comes first on ``sys.path``; a ``.pth`` file appends this
    interpreter's site-packages after it, for torch and the rest, without processing
    the ``.pth`` files there (so the editable install of ``src/`` stays out of sight).
    """
    venv.EnvBuilder(with_pip=False).create(folder)
    python = folder / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "book_dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


USE_IT = """
import hashlib, importlib, json, pkgutil, sys
from importlib import metadata, resources
import trainscale
from trainscale import figures, planner, published

modules = sorted(m.name for m in pkgutil.walk_packages(trainscale.__path__, "trainscale."))
for name in modules:
    if name != "trainscale.__main__":
        importlib.import_module(name)


def data_files(folder, prefix=""):
    for item in folder.iterdir():
        if item.is_dir() and item.name != "__pycache__":
            yield from data_files(item, f"{prefix}{item.name}/")
        elif item.is_file() and not item.name.endswith((".py", ".pyc")):
            yield f"{prefix}{item.name}", hashlib.sha256(item.read_bytes()).hexdigest()


runs = published.published_runs()
layouts = planner.plan(planner.EXAMPLE_MODEL, planner.EXAMPLE_CLUSTER, 64)
best = planner.top_layouts(layouts, count=3)
svg = figures.svg_text(figures.planner_top_layouts(best, planner.EXAMPLE_CLUSTER.memory_bytes))
print(json.dumps({
    "file": trainscale.__file__,
    "version": trainscale.__version__,
    "metadata": metadata.version("trainscale"),
    "modules": modules,
    "best": best[0].name,
    "svg": svg[:200],
    "data": dict(data_files(resources.files("trainscale"))),
    "published runs": len(runs),
    "loaded": sorted(m for m in sys.modules if m.startswith("trainscale")),
}))
"""


@pytest.mark.slow
def test_wheel_works_without_the_source_tree(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path)
    shipped = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        path.relative_to(PACKAGE.parent).as_posix()
        for path in git_files(str(PACKAGE.relative_to(ROOT)))
    }
    assert expected - shipped == set(), "files of src/trainscale missing from the wheel"
    assert "trainscale/py.typed" in shipped
    info = f"trainscale-{project()['version']}.dist-info"
    assert f"{info}/licenses/LICENSE" in shipped
    wheel_metadata = zipfile.ZipFile(wheel).read(f"{info}/METADATA").decode()
    assert "License-Expression: MIT" in wheel_metadata
    for dependency in project()["dependencies"]:
        name = Requirement(dependency).name
        assert any(
            line.startswith(f"Requires-Dist: {name}>=") for line in wheel_metadata.splitlines()
        ), dependency

    python = empty_environment(tmp_path / "venv")
    subprocess.run(
        [*PIP, "--python", str(python), "install", "--no-index", "--no-deps", str(wheel)],
        check=True,
        timeout=300,
    )
    elsewhere = tmp_path / "elsewhere"  # no source tree in the working folder either
    elsewhere.mkdir()
    used = subprocess.run(
        [str(python), "-I", "-c", USE_IT],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert used.returncode == 0, used.stderr
    report = json.loads(used.stdout.splitlines()[-1])
    assert Path(report["file"]).is_relative_to(tmp_path / "venv"), report["file"]
    assert report["version"] == report["metadata"] == project()["version"]
    source_modules = {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for path in git_files(str(PACKAGE.relative_to(ROOT)))
        if path.suffix == ".py"
    }
    assert set(report["modules"]) | {"trainscale"} == source_modules
    assert report["best"].startswith("TP ")
    data = {
        path.relative_to(PACKAGE).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in git_files(str(PACKAGE.relative_to(ROOT)))
        if path.suffix != ".py"
    }
    assert report["data"] == data, "the installed package reads other data than src/ holds"
    assert report["published runs"] > 0
    assert "<svg" in report["svg"]

    summary = subprocess.run(
        [str(python), "-I", "-m", "trainscale"],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=300,
        check=False,
    )
    assert summary.returncode == 0, summary.stderr
    assert "16 Planning a large run" in summary.stdout
    assert f"(trainscale {project()['version']})" in summary.stdout
