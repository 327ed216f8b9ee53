"""What chapter 16's "Plan your run" page needs besides its committed JavaScript.

The page runs the real ``trainscale.planner`` in the reader's browser, under Pyodide
(CPython compiled to WebAssembly). ``make site`` and ``make site-check`` run this first:

* **Pyodide**, :data:`PYODIDE_VERSION`, fetched from the npm registry (the tarball npm
  itself would install, checked against the registry's sha512 :data:`INTEGRITY`) once and
  kept in ``book/_extra/plan/pyodide/`` (not committed: its 13 MB would more than double
  the repository, and every upgrade would add as much again to its history);
* **the planner**, the package's own ``.py`` files, zipped from this tree on every build
  into ``book/_extra/plan/trainscale.zip``: exactly the modules ``trainscale.planner`` and
  its command line import when torch and numpy cannot be imported (Pyodide has neither),
  and the published runs they read.

Sphinx copies ``book/_extra`` to the site's root (``html_extra_path``), so the page finds
both next to its script, ``plan/``; no other page loads them.

    python tools/plan_page.py          # fetch Pyodide if missing, pack the planner
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import subprocess
import sys
import tarfile
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "book" / "_extra" / "plan"
PYODIDE_VERSION = "314.0.8"
TARBALL = f"https://registry.npmjs.org/pyodide/-/pyodide-{PYODIDE_VERSION}.tgz"
INTEGRITY = (
    "sha512-74Wq1kXOC+CCEzAfxuRAO701nAcCMLjf8NrwvWpu8S41dVMX"
    "wXmLQ05dYB+F4e46AdnGo0oq7YHSVUpHsoarLQ=="
)
"""``npm view pyodide@314.0.8 dist.integrity``: the tarball's sha512, as the registry has it."""
PYODIDE_FILES = (
    "pyodide.mjs",  # loadPyodide, the page's entry point (an ES module, for the Web Worker)
    "pyodide.asm.mjs",  # the Emscripten runtime
    "pyodide.asm.wasm",  # CPython 3.14, compiled to WebAssembly
    "python_stdlib.zip",  # the standard library
    "pyodide-lock.json",  # Pyodide's package index, read at start-up (no package is loaded)
)
"""What the page loads of the npm package (its ``package/`` folder holds these and more)."""

CLOSURE = """
import json, sys
for name in ("torch", "numpy"):
    sys.modules[name] = None  # as in Pyodide: neither can be imported
from trainscale import planner
from trainscale.planner import cli
for name in dir(planner):  # the formula names planner reads from their modules on first use
    getattr(planner, name)
cli.plan_json(["--model", "mixtral-8x7b", "--virtual-stages", "1", "--top", "1"])
files = {m.__file__ for k, m in sys.modules.items() if k.startswith("trainscale") and m}
print(json.dumps(sorted(files)))
"""
"""Run with torch and numpy unimportable: the ``trainscale`` files the planner loads."""

DATA = ("data/published_runs.json",)
"""Package data the planner reads (:func:`trainscale.published.published_runs`)."""


def _check(data: bytes) -> None:
    algorithm, _, expected = INTEGRITY.partition("-")
    digest = base64.b64encode(hashlib.new(algorithm, data).digest()).decode()
    if digest != expected:
        raise SystemExit(f"{TARBALL}: {algorithm} {digest}, expected {expected}")


def fetch_pyodide(folder: Path = OUT / "pyodide") -> Path:
    """:data:`PYODIDE_FILES` of Pyodide :data:`PYODIDE_VERSION` in ``folder``, fetched
    (and checked) unless a previous build left them there."""
    stamp = folder / "VERSION.txt"
    note = (
        f"pyodide {PYODIDE_VERSION} (MPL-2.0), from the npm registry: {TARBALL}\n"
        f"integrity {INTEGRITY}\nfetched and unpacked by tools/plan_page.py\n"
    )
    fetched = stamp.exists() and stamp.read_text() == note
    if fetched and all((folder / name).exists() for name in PYODIDE_FILES):
        return folder
    print(f"fetching Pyodide {PYODIDE_VERSION} from the npm registry", flush=True)
    try:
        with urllib.request.urlopen(TARBALL, timeout=120) as response:
            data = response.read()
    except OSError as error:
        raise SystemExit(
            f"could not fetch {TARBALL} ({error}): the plan page needs Pyodide, fetched once"
            " from the npm registry; build the site again where the registry can be reached"
        ) from None
    _check(data)
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for name in PYODIDE_FILES:
            member = tar.extractfile(f"package/{name}")
            if member is None:
                raise SystemExit(f"{TARBALL} has no package/{name}")
            (folder / name).write_bytes(member.read())
    stamp.write_text(note)
    return folder


@functools.cache
def planner_files() -> tuple[Path, ...]:
    """The package's files the planner imports without torch (:data:`CLOSURE`), then
    :data:`DATA`."""
    done = subprocess.run(
        [sys.executable, "-c", CLOSURE],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"the planner does not import without torch:\n{done.stderr}")
    package = ROOT / "src" / "trainscale"
    files = [Path(name) for name in json.loads(done.stdout)]
    outside = [f for f in files if package not in f.parents]
    if outside:
        raise SystemExit(f"trainscale imported from outside {package}: {outside}")
    return (*files, *(package / name for name in DATA))


def pack_planner(target: Path = OUT / "trainscale.zip") -> Path:
    """Zip :func:`planner_files` as ``trainscale/...``, byte for byte the same for the same
    tree (fixed dates, sorted names)."""
    package = ROOT / "src" / "trainscale"
    target.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(planner_files()):
            name = "trainscale/" + path.relative_to(package).as_posix()
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, path.read_bytes())
    if not target.exists() or target.read_bytes() != buffer.getvalue():
        target.write_bytes(buffer.getvalue())
    return target


def main() -> None:
    folder = fetch_pyodide()
    packed = pack_planner()
    with zipfile.ZipFile(packed) as archive:
        count = len(archive.namelist())
    size = sum(f.stat().st_size for f in folder.iterdir()) + packed.stat().st_size
    print(f"plan page: Pyodide {PYODIDE_VERSION} and {count} planner files, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
