"""How long each part of the book takes on this machine (``make bench``).

Timings are reported, never asserted: a loaded machine is slower, not wrong.
``phases`` times each phase of ``make test`` as make runs it, one after the other,
starting with the two virtual environments made afresh in a temporary folder (with
uv, and again with pip alone, for comparison); ``notebooks`` executes each chapter
alone, top to bottom. The table at the end is also written to ``_build/bench.txt``,
with a warning for each budget a figure passes. The budgets are CONTRIBUTING.md's,
for a 2-core machine: each notebook <= 45 s (warned from 40 s) and their median
<= 20 s, ``make check`` < 60 s, ``make test`` <= 10 min (warned from 9 min).

    python tools/bench.py                    # everything
    python tools/bench.py phases planner     # some parts: phases, notebooks, check,
                                             # planner, estimates (chapter 17's
                                             # full-size memory), page (the built site's
                                             # planner page in Chromium: make site first)
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NOTEBOOK_WARNING = 40.0
"""Seconds: a notebook past this is close to its 45 s budget."""
TEST_WARNING = 9 * 60.0
"""Seconds: ``make test`` past this is close to its 10-minute budget."""
BUDGETS = {"notebook": 45.0, "notebook median": 20.0, "check": 60.0, "make test": 600.0}
MAKE_TEST = "make test, phases added up"


def _timed(command: list[str], env: dict[str, str] | None = None) -> float:
    """Seconds ``command`` took, run from the repository root; raises if it failed."""
    started = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def notebooks() -> list[tuple[str, float]]:
    """Each notebook executed top to bottom in a fresh kernel, as nbclient runs it."""
    import nbformat
    from nbclient import NotebookClient

    rows = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        # cells nbval skips are timed elsewhere (chapter 17's full-size estimates)
        notebook.cells = [
            c for c in notebook.cells if "nbval-skip" not in c.get("metadata", {}).get("tags", [])
        ]
        resources = {"metadata": {"path": path.parent}}
        client = NotebookClient(notebook, timeout=600, resources=resources)
        started = time.perf_counter()
        client.execute()
        rows.append((f"notebook {path.stem}", time.perf_counter() - started))
    seconds = [s for _, s in rows]
    rows.append(("notebooks, median", statistics.median(seconds)))
    rows.append(("notebooks, all in turn", sum(seconds)))
    return rows


def check() -> list[tuple[str, float]]:
    return [("make check", _timed(["make", "check"]))]


def _make(target: str, **variables: str) -> float:
    """Seconds ``make target`` took, with make variables set (``VENV=...``)."""
    return _timed(["make", *(f"{k}={v}" for k, v in variables.items()), target])


def _fresh_venvs() -> list[tuple[str, float]]:
    """The book's venv and release-lint's, made afresh in a temporary folder: with
    uv (what ``make test`` does) and with pip alone (``INSTALLER=pip``)."""
    rows = []
    for installer in ("uv", "pip"):
        folder = Path(tempfile.mkdtemp(prefix=f"bench-venv-{installer}-"))
        try:
            venv = folder / "venv"
            settings = {"VENV": str(venv), "INSTALLER": installer}
            seconds = _make(f"{venv}/.installed", **settings)
            rows.append((f"venv ({installer}, package cache warm)", seconds))
            seconds = _make(f"{venv}/cffconvert/.installed", **settings)
            rows.append((f"release-lint's venv ({installer})", seconds))
        finally:
            shutil.rmtree(folder)
    return rows


PHASES = ("lint", "release-lint", "unit", "nbval", ("site-check", "nbval-alone"), "browser")
"""``make test``'s targets, in its order; a pair runs side by side, as ``make test`` runs it."""


def _side_by_side(targets: tuple[str, ...]) -> list[tuple[str, float]]:
    """Seconds each of ``targets`` took while they ran at the same time, and the pair's."""
    started = time.perf_counter()
    running = {
        target: subprocess.Popen(["make", target], cwd=ROOT, stdout=subprocess.DEVNULL)
        for target in targets
    }
    finished: dict[str, float] = {}
    while len(finished) < len(running):
        for target, process in running.items():
            if target not in finished and process.poll() is not None:
                if process.returncode != 0:
                    raise subprocess.CalledProcessError(process.returncode, ["make", target])
                finished[target] = time.perf_counter() - started
        time.sleep(0.1)
    rows = [(f"make {target} (side by side)", finished[target]) for target in targets]
    rows.append((" + ".join(targets) + ", together", max(finished.values())))
    return rows


def phases() -> list[tuple[str, float]]:
    """Each phase of ``make test`` in turn, then their sum with the uv venvs: what a
    fresh clone's ``make test`` takes (the pip rows are for comparison only)."""
    rows = _fresh_venvs()
    counted = [seconds for what, seconds in rows if "pip" not in what]
    for phase in PHASES:
        if isinstance(phase, tuple):
            pair = _side_by_side(phase)
            rows += pair
            counted.append(pair[-1][1])
        else:
            rows.append((f"make {phase}", _make(phase)))
            counted.append(rows[-1][1])
    rows.append((MAKE_TEST, sum(counted)))
    return rows


def planner() -> list[tuple[str, float]]:
    """Every layout of a 1T-parameter model on 16,384 GPUs (2,048 nodes of 8 H100)."""
    sys.path.insert(0, str(ROOT / "src"))
    from trainscale import planner as p

    model = p.Model(params=1e12, layers=128, hidden=25600, heads=160, seq_len=2048, vocab=51200)
    cluster = p.Cluster(nodes=2048, **p.H100_NODE)
    started = time.perf_counter()
    layouts = p.plan(model, cluster, global_batch=3072)
    seconds = time.perf_counter() - started
    rows = [(f"planner: {len(layouts):,} layouts, 1T on 16,384 GPUs", seconds)]
    for cached in (
        p.kernels._layer_times_at,
        p.kernels._roofline,
        p.memory._activations,
        p.memory._state,
        p.traffic.zero_collective_bytes,
    ):  # start cold again
        cached.cache_clear()
    started = time.perf_counter()  # every interleaving depth, as the command line searches
    count = len(p.plan(model, cluster, 3072, virtual_stages=p.INTERLEAVING))
    seconds = time.perf_counter() - started
    rows.append((f"planner: {count:,} layouts, every interleaving depth", seconds))
    started = time.perf_counter()  # context parallelism searched too (1T's 2,048 tokens
    layouts = p.plan(model, cluster, 3072, context_parallel=(1, 2, 4, 8))  # never need it)
    seconds = time.perf_counter() - started
    rows.append((f"planner: {len(layouts):,} layouts, CP 1-8 searched", seconds))
    return rows


def _served(site: Path) -> tuple[str, Callable[[], None]]:
    """``site`` served on 127.0.0.1 (a port the OS picks), and how to stop it."""
    import functools
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server.shutdown


def page() -> list[tuple[str, float]]:
    """The "Plan your run" page of the built site (``make site`` first) in headless Chromium:
    from opening it (a reader's click on its link) to the first plan on the screen, Pyodide's
    start within that, and a second plan (Plan pressed with other inputs). Also prints the
    page's weight: every file it loads, raw and gzipped."""
    import gzip

    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(ROOT / "tests" / "browser"))
    from conftest import CHROMIUM_ARGS, chromium_path

    site = ROOT / "_build" / "html"
    if not (site / "book" / "plan_your_run.html").exists():
        raise SystemExit(f"{site} has no plan_your_run.html: build the site first (make site)")
    base, stop = _served(site)
    done = "() => ['done', 'error'].includes(document.getElementById('plan-app').dataset.state)"
    loaded: list[str] = []
    try:
        with sync_playwright() as playwright:
            chromium = playwright.chromium
            browser = chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
            tab = browser.new_page()
            tab.on("requestfinished", lambda r: loaded.append(r.url))
            started = time.perf_counter()
            tab.goto(f"{base}/book/plan_your_run.html")
            tab.wait_for_function(done, timeout=600_000)
            first = time.perf_counter() - started
            start = tab.evaluate("window.planTimings.loaded")
            tab.fill("#plan__nodes", "16")
            started = time.perf_counter()
            tab.click("#plan-go")
            tab.wait_for_function(done, timeout=600_000)
            second = time.perf_counter() - started
            browser.close()
    finally:
        stop()
    files = [site / url.removeprefix(base + "/").split("?")[0] for url in dict.fromkeys(loaded)]
    raw = sum(f.stat().st_size for f in files if f.is_file())
    packed = sum(len(gzip.compress(f.read_bytes(), 6)) for f in files if f.is_file())
    print(
        f"plan page weight: {len(files)} files, {raw / 2**20:.1f} MiB raw,"
        f" {packed / 2**20:.1f} MiB gzipped"
    )
    return [
        ("plan page: opened to first plan (70B example)", first),
        ("plan page: Pyodide and the planner started", start),
        ("plan page: Plan pressed to plan (16 nodes)", second),
    ]


def estimates() -> list[tuple[str, float]]:
    """Chapter 17's three full-size memory checks (its cell tagged ``nbval-skip``): each
    layout's step on a fake world, torch's tracker beside the planner (printed too)."""
    sys.path.insert(0, str(ROOT / "src"))
    from trainscale import train
    from trainscale.train import full_size

    rows = []
    for name, flags in full_size.CASES.items():
        started = time.perf_counter()
        found = train.estimate.estimate_memory(train.parse_args(flags()))
        rows.append((f"estimate: {name}", time.perf_counter() - started))
        print("\n".join(full_size.table(name, found)))
    return rows


PARTS: dict[str, Callable[[], list[tuple[str, float]]]] = {
    "planner": planner,
    "estimates": estimates,
    "page": page,
    "check": check,
    "notebooks": notebooks,
    "phases": phases,
}


def warnings(rows: list[tuple[str, float]]) -> list[str]:
    """A line for each figure past its warning mark (never an error: timings vary)."""
    lines = []
    for what, seconds in rows:
        if what.startswith("notebook ") and seconds > NOTEBOOK_WARNING:
            lines.append(f"WARNING: {what} took {seconds:.1f} s (warned from {NOTEBOOK_WARNING:g})")
        if what == MAKE_TEST and seconds > TEST_WARNING:
            lines.append(f"WARNING: {what} took {seconds:.0f} s (warned from {TEST_WARNING:g})")
    return lines


def main(names: list[str]) -> None:
    chosen = names or list(PARTS)
    unknown = [name for name in chosen if name not in PARTS]
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; choose from {list(PARTS)}")
    rows: list[tuple[str, float]] = []
    for name in chosen:
        print(f"timing {name} ...", flush=True)
        rows += PARTS[name]()
    table = "\n".join(f"{what:52s} {seconds:7.1f} s" for what, seconds in rows)
    budgets = ", ".join(f"{k} <= {v:g} s" for k, v in BUDGETS.items())
    report = "\n".join([table, f"(budgets on 2 cores: {budgets})", *warnings(rows)])
    print(report)
    (ROOT / "_build").mkdir(exist_ok=True)
    (ROOT / "_build" / "bench.txt").write_text(report + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
