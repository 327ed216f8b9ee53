"""Run a function on several real ``torch.distributed`` processes from a notebook.

``run_ranks(worker, 4, ...)`` starts four processes, joins them into one process
group and calls ``worker(rank, world_size, ...)`` in each; it returns what each
rank returned, in rank order, and prints what each rank printed, in rank order.
On a laptop the processes use the gloo backend on the CPU; on a machine with
enough GPUs the same workers run with NCCL, one GPU per rank
(:func:`backend_and_device` is the one place that decides).

Safety, because this runs on the reader's machine:

* everything listens on 127.0.0.1 only: the rendezvous store is created here,
  in the parent, on a socket bound to the loopback address (a ``TCPStore``
  given a host name still listens on every interface), and gloo is told to use
  the loopback interface;
* the port is picked by the operating system, so two runs never collide;
* a rank that raises, exits or hangs ends the whole run within ``timeout``
  seconds with an error naming the rank, and every process is reaped: none is
  left behind, even if the parent dies (each rank watches its parent).

Under ``torchrun`` (:func:`run_torchrun` starts such a job from a notebook), the
one way in is :func:`torchrun_main`: it joins the job with :func:`join_job`,
which keeps to the same loopback rules, and runs a worker as one rank.

Workers must live in an importable module: ranks are forked from a fork server
(a fresh interpreter that has imported torch and done nothing else, since forking
a process that already ran torch maths can hang), which receives the worker by
name and so cannot run a function defined in a notebook.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainscale import _checks

LOOPBACK = "127.0.0.1"


class RankError(RuntimeError):
    """A rank failed: it raised, exited, or did not finish in time."""


def backend_and_device(rank: int) -> tuple[str, torch.device]:
    """The collective backend and device for ``rank``: NCCL on GPU ``rank`` if there
    is one for every rank, gloo on the CPU otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        return "nccl", torch.device("cuda", rank)
    return "gloo", torch.device("cpu")


def device() -> torch.device:
    """The device this rank computes on (call inside a worker)."""
    return backend_and_device(dist.get_rank())[1]


def _watch_parent(parent: int) -> None:
    """End this rank if the process that started it is gone (no orphans).

    A rank is forked by the fork server that ``parent`` started, so two things are
    watched: ``parent`` itself, and the rank's own parent (the fork server, which
    exits when ``parent`` does; the rank is then re-parented and notices)."""
    forked_by = os.getppid()
    while True:
        if os.getppid() != forked_by or not _alive(parent):
            os._exit(3)
        time.sleep(0.5)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0 checks without sending anything)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, but belongs to someone else
        return True
    return True


def _redirect(fd: int, path: Path) -> None:
    """Send file descriptor ``fd`` (1 or 2) to ``path``, C-level output included."""
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(target, fd)
    os.close(target)


def _child(
    rank: int,
    world_size: int,
    port: int,
    folder: str,
    parent: int,
    env: dict[str, str],
    worker: Callable[..., Any],
    args: tuple,
) -> None:
    """Entry point of one rank, forked from the fork server with torch already imported."""
    os.environ.update(env)  # the fork server's environment is from when it started
    out = Path(folder)
    _redirect(1, out / f"{rank}.out")
    _redirect(2, out / f"{rank}.err")
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        torch.set_num_threads(1)
        backend, dev = backend_and_device(rank)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        result = worker(rank, world_size, *args)
    except BaseException:
        # Record the traceback before anything else: exiting closes this rank's
        # connections, which makes its peers fail too, and the first traceback
        # written is how the parent tells the cause from the knock-on failures.
        (out / f"{rank}.traceback").write_text(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()
    (out / f"{rank}.result").write_bytes(pickle.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()


def _loopback_store(world_size: int, timeout: float) -> tuple[dist.TCPStore, int]:
    """A rendezvous store listening on 127.0.0.1 only, on a port the OS picked."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((LOOPBACK, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        LOOPBACK,
        port,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
        use_libuv=False,
    )
    return store, port


def _report(folder: Path, world_size: int) -> None:
    """Print each rank's output in rank order, each line tagged with its rank."""
    for rank in range(world_size):
        for stream in ("out", "err"):
            text = (
                (folder / f"{rank}.{stream}").read_text()
                if (folder / f"{rank}.{stream}").exists()
                else ""
            )
            tag = f"[rank {rank}]" if stream == "out" else f"[rank {rank} stderr]"
            for line in text.splitlines():
                print(f"{tag} {line}")


def _stop(processes: list) -> None:
    """Terminate, then kill, every process still alive, and reap them all."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + 5
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


PRELOADED = ("torch", "torch.distributed")
"""What the fork server imports once, so that each rank starts in milliseconds."""


def _rank_context() -> mp.context.BaseContext:
    """Processes forked from a fork server that has imported torch and nothing else.

    Forking the notebook's own process is unsafe (after torch maths, its OpenMP
    threads can hang the children), and a fresh interpreter per rank (``spawn``)
    spends seconds of CPU importing torch each time. The fork server is a fresh
    interpreter started once, on the first run, that has only *imported* torch
    (no maths, no threads) and forks each rank from there. It lives as long as
    the process that started it, and exits with it.
    """
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    return context


def run_ranks(
    worker: Callable[..., Any], world_size: int = 4, *args: Any, timeout: float = 60.0
) -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` on ``world_size`` processes; return each result.

    ``worker`` must be a module-level function of an importable module, and its
    result picklable. Raises :class:`RankError` naming the first rank that
    failed (with its traceback) or, after ``timeout`` seconds, the ranks that had
    not finished.
    """
    if getattr(worker, "__module__", "__main__") == "__main__" or "<locals>" in getattr(
        worker, "__qualname__", ""
    ):
        raise ValueError("worker must be a module-level function of an importable module")
    n = _checks.count("world_size", world_size, minimum=1)
    limit = _checks.positive("timeout", timeout)
    context = _rank_context()
    with tempfile.TemporaryDirectory(prefix="trainscale-ranks-") as tmp:
        folder = Path(tmp)
        store, port = _loopback_store(n, limit)
        env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(n)}
        processes = []
        try:
            for rank in range(n):
                process = context.Process(
                    target=_child,
                    args=(rank, n, port, tmp, os.getpid(), env, worker, args),
                    name=f"rank-{rank}",
                    daemon=True,
                )
                process.start()
                processes.append(process)
            _wait(processes, folder, limit)
        finally:
            _stop(processes)
            del store
        _report(folder, n)
        return [pickle.loads((folder / f"{rank}.result").read_bytes()) for rank in range(n)]


def _first_failure(processes: list, folder: Path) -> int:
    """The rank whose failure came first: the others usually fail *because* of it,
    when a collective loses its partner. A rank that exited without a Python
    traceback was not failed by a collective; otherwise the earliest traceback wins."""
    failed = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
    silent = [r for r in failed if not (folder / f"{r}.traceback").exists()]
    if silent:
        return silent[0]
    return min(failed, key=lambda r: (folder / f"{r}.traceback").stat().st_mtime_ns)


def _wait(processes: list, folder: Path, timeout: float) -> None:
    """Wait for every rank; raise as soon as one fails, or when time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if any(p.exitcode not in (None, 0) for p in processes):
            time.sleep(0.3)  # let knock-on failures land, then find the first one
            rank = _first_failure(processes, folder)
            _stop(processes)
            trace = folder / f"{rank}.traceback"
            detail = trace.read_text() if trace.exists() else "(exited without a Python traceback)"
            _report(folder, len(processes))
            code = processes[rank].exitcode
            raise RankError(f"rank {rank} failed (exit code {code}):\n{detail}")
        if all(p.exitcode == 0 for p in processes):
            return
        if time.monotonic() > deadline:
            waiting = [r for r, p in enumerate(processes) if p.exitcode is None]
            _stop(processes)
            _report(folder, len(processes))
            raise RankError(f"ranks {waiting} did not finish within {timeout:g} s")
        time.sleep(0.02)


def join_job() -> tuple[int, int]:
    """Join the job ``torchrun`` described in the environment; return ``(rank, world size)``.

    ``torchrun`` tells each process ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
    where the job's key-value store is (``MASTER_ADDR``, ``MASTER_PORT``). The
    backend and device are :func:`backend_and_device`'s for ``LOCAL_RANK``. When
    the store is on this machine's loopback address and the processes do not
    share torchrun's own store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which
    :func:`run_torchrun` sets), rank 0 hosts the store on a socket bound to
    127.0.0.1 (a ``TCPStore`` given an address still listens on every interface)
    and gloo is kept on the loopback interface (``GLOO_SOCKET_IFNAME=lo``); on a
    cluster this is the standard ``env://`` rendezvous. (``torchrun``'s own
    rendezvous store, in the launcher, listens on every interface; that part is
    beyond a worker's reach.)
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend, dev = backend_and_device(int(os.environ.get("LOCAL_RANK", rank)))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    on_this_machine = address in (LOOPBACK, "localhost")
    if on_this_machine:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if not on_this_machine or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend)  # env://: the store named by MASTER_ADDR/PORT
        return rank, world_size
    listener = None
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, port))
        listener.listen(128)
    store = dist.TCPStore(
        LOOPBACK,
        port,
        world_size,
        is_master=rank == 0,
        master_listen_fd=listener.detach() if listener else None,
        use_libuv=False,
    )
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    return rank, world_size


def torchrun_main(worker: Callable[..., Any], *args: Any) -> Any:
    """Run ``worker`` as one rank of a job started by ``torchrun``.

    ``torchrun --nproc-per-node=8 -m trainscale.workers.some_module`` starts one
    process per GPU and tells each its rank through environment variables; this
    joins the process group with :func:`join_job`, calls
    ``worker(rank, world_size, *args)`` and leaves the group again, whatever
    happens. The workers' modules and the training script
    (:mod:`trainscale.train`) all start this way.
    """
    rank, world_size = join_job()
    try:
        return worker(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def run_torchrun(
    module: str, args: list[str], nproc: int = 2, max_restarts: int = 0, timeout: float = 300.0
) -> str:
    """Run ``torchrun -m module args`` on this machine and return everything it printed.

    What a reader would type on one node, with ``nproc`` ranks, on 127.0.0.1:
    ``torchrun --nproc-per-node=N --max-restarts=R -m module ...``. With
    ``max_restarts`` > 0 torchrun restarts every rank when one dies (gloo needs
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` for that, set here). Raises
    :class:`RankError` with the output if the job fails or outlasts ``timeout``
    seconds; no process is left behind either way (torchrun starts its workers
    in sessions of their own, so they are tracked by pid and killed if needed).
    """
    import psutil  # a dependency of Jupyter, so always there with the book

    n = _checks.count("nproc", nproc, minimum=1)
    restarts = _checks.count("max_restarts", max_restarts)
    limit = _checks.positive("timeout", timeout)
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        *("-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={n}"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint={LOOPBACK}:{port}"),
        *(f"--max-restarts={restarts}", "--monitor-interval=0.2", "-m", module, *args),
    ]
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }
    started = time.monotonic()
    seen: dict[int, psutil.Process] = {}
    with tempfile.TemporaryFile("w+") as log:
        launcher = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        agent = psutil.Process(launcher.pid)
        timed_out = False
        try:
            while launcher.poll() is None:
                if time.monotonic() - started > limit:
                    timed_out = True
                    break
                with contextlib.suppress(psutil.NoSuchProcess):
                    seen.update((p.pid, p) for p in agent.children(recursive=True))
                time.sleep(0.2)
        finally:
            if launcher.poll() is None:  # timed out, or interrupted
                _kill([agent])
            # Workers normally end with the launcher; any that outlived it are killed.
            _, left = psutil.wait_procs(list(seen.values()), timeout=5)
            _kill(left)
            launcher.wait()
        log.seek(0)
        output = log.read()
    if timed_out:
        raise RankError(f"torchrun -m {module} did not finish within {limit:g} s:\n{output}")
    if launcher.returncode != 0:
        raise RankError(f"torchrun -m {module} failed (exit code {launcher.returncode}):\n{output}")
    return output


def _kill(processes: list) -> None:
    """Kill each of these ``psutil`` processes that still exists."""
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
