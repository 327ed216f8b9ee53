"""The processes a test started itself, for the checks that a run leaves none behind."""

from __future__ import annotations

import contextlib

import psutil

# multiprocessing's long-lived helpers: each is started once per process that uses
# it, exits with that process, and is therefore no orphan. The resource tracker
# comes with spawn and forkserver; the fork server is what run_ranks forks ranks from.
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def is_helper(process: psutil.Process) -> bool:
    """Whether ``process`` is one of multiprocessing's helpers (see :data:`HELPERS`)."""
    with contextlib.suppress(psutil.Error):
        return any(name in " ".join(process.cmdline()) for name in HELPERS)
    return False


def own_children() -> set[int]:
    """Live descendants of this process, multiprocessing's helpers left out.

    Only descendants count: processes of other tests or notebooks running at the
    same time on the machine (pytest-xdist) are never mistaken for leftovers."""
    alive = set()
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if (
                child.is_running()
                and child.status() != psutil.STATUS_ZOMBIE
                and not is_helper(child)
            ):
                alive.add(child.pid)
    return alive
