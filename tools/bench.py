"""How long each part of the book takes on this machine (``make bench``).

Timings are reported, never asserted: a loaded machine is slower, not wrong.
Each part runs as ``make test`` runs it, one after the other, and the table at
the end is also written to ``_build/bench.txt``. The budgets are those of
CONTRIBUTING.md, for a 2-core machine: each notebook <= 45 s and their median
<= 20 s, ``make check`` < 60 s, the site build <= 60 s, ``make test`` <= 10 min.

    python tools/bench.py                  # everything
    python tools/bench.py notebooks planner  # some parts: notebooks, check, unit,
                                             # nbval, site, browser, planner
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BUDGETS = {"notebook": 45.0, "notebook median": 20.0, "check": 60.0, "site": 60.0}


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


def unit() -> list[tuple[str, float]]:
    return [("unit tests (pytest -n 2 tests)", _timed(["make", "unit"]))]


def nbval() -> list[tuple[str, float]]:
    return [("nbval, other kernels (-n 2)", _timed(["make", "notebooks"]))]


def site() -> list[tuple[str, float]]:
    return [("site build from a clean _build", _timed(["make", "site-check"]))]


def browser() -> list[tuple[str, float]]:
    return [("browser tests", _timed(["make", "browser"]))]


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
        p.memory._activations,
        p.memory._state,
    ):  # start cold again
        cached.cache_clear()
    started = time.perf_counter()  # every interleaving depth estimate_run searches
    count = sum(len(p.plan(model, cluster, 3072, virtual_stages=v)) for v in p.INTERLEAVING)
    seconds = time.perf_counter() - started
    rows.append((f"planner: {count:,} layouts, every interleaving depth", seconds))
    started = time.perf_counter()  # context parallelism searched too (1T's 2,048 tokens
    layouts = p.plan(model, cluster, 3072, context_parallel=(1, 2, 4, 8))  # never need it)
    seconds = time.perf_counter() - started
    rows.append((f"planner: {len(layouts):,} layouts, CP 1-8 searched", seconds))
    return rows


PARTS: dict[str, Callable[[], list[tuple[str, float]]]] = {
    "planner": planner,
    "check": check,
    "notebooks": notebooks,
    "unit": unit,
    "nbval": nbval,
    "site": site,
    "browser": browser,
}


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
    report = f"{table}\n(budgets on 2 cores: {budgets}; make test <= 600 s)"
    print(report)
    (ROOT / "_build").mkdir(exist_ok=True)
    (ROOT / "_build" / "bench.txt").write_text(report + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
