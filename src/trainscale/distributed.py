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

Under ``torchrun`` (:func:`run_torchrun` starts such a job from a notebook, and
:func:`run_nodes` one of several "nodes" on this machine, losing and replacing
one if asked), the one way in is :func:`torchrun_main`: it joins the job with
:func:`join_job`, which keeps to the same loopback rules, and runs a worker as
one rank. The agents keep to them too: the rendezvous store they meet in is
created here, on 127.0.0.1 (torchrun's agent would host it on every interface),
and they are told to host no store of their own (:data:`RENDEZVOUS_CONF`,
:data:`JOB_ENVIRONMENT`).

Workers must live in an importable module: ranks are forked from a fork server
(a fresh interpreter that has imported torch and done nothing else, since forking
a process that already ran torch maths can hang), which receives the worker by
name and so cannot run a function defined in a notebook.
"""

from __future__ import annotations

import codecs
import contextlib
import datetime
import math
import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from trainscale import _checks

LOOPBACK = "127.0.0.1"


class RankError(RuntimeError):
    """A rank failed: it raised, exited, or did not finish in time."""


def backend_and_device(local_rank: int) -> tuple[str, torch.device]:
    """The collective backend and device for the rank that is ``local_rank`` on its
    machine: NCCL on GPU ``local_rank`` if this machine has a GPU for each of its
    ranks (``LOCAL_WORLD_SIZE``, which torchrun sets; ``WORLD_SIZE`` otherwise),
    gloo on the CPU otherwise. On 8 nodes of 8 GPUs each machine has 8 ranks and 8
    GPUs: ranks 8-15 use GPUs 0-7 of the second node."""
    world = os.environ.get("WORLD_SIZE", "1")
    on_this_machine = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if torch.cuda.is_available() and torch.cuda.device_count() >= on_this_machine:
        return "nccl", torch.device("cuda", local_rank)
    return "gloo", torch.device("cpu")


def device() -> torch.device:
    """The device this rank computes on (call inside a worker)."""
    return backend_and_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))[1]


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


PRELOADED = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",  # with DTensor and FSDP2: ~1 CPU-s per rank otherwise
    "torch.distributed.pipelining",  # ~0.8 CPU-s per rank otherwise
    "torch.distributed.tensor.parallel",
)
"""What the fork server imports once, so that each rank starts in milliseconds
(the capstone's ranks need all of them; importing does no maths and starts no threads)."""


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
    rendezvous store is beyond a worker's reach: :func:`run_nodes` hosts it on
    127.0.0.1 for the agents.)
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


def run_alone(worker: Callable[..., Any], *args: Any) -> Any:
    """Run ``worker(0, 1, *args)`` in this process, as the one rank of a job of one.

    What ``python -m trainscale.train`` does outside ``torchrun``: the process group's
    store listens on 127.0.0.1, on a port the operating system picked (no two runs
    collide), gloo on the loopback interface; NCCL on this machine's GPU if it has
    one (:func:`backend_and_device`). The group is left again whatever happens.
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend, dev = backend_and_device(0)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store, _ = _loopback_store(1, 300.0)
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        return worker(0, 1, *args)
    finally:
        dist.destroy_process_group()
        del store


RENDEZVOUS_CONF = "is_host=false,keep_alive_interval=1,keep_alive_max_attempt=5"
"""``--rdzv-conf`` of every agent :func:`run_nodes` starts. ``is_host=false``: no agent
hosts the rendezvous store, each only connects to it (the launcher hosts it, on
127.0.0.1; torch's ``c10d_rendezvous_backend._create_tcp_store`` would otherwise
let the agent whose endpoint matches this machine host it, and a ``TCPStore``
listens on every interface). A heartbeat a second, and a node silent for 5 s
counts as dead, so the survivors of a lost node regroup within seconds (torch's
defaults: every 5 s, dead after 15 s)."""


@dataclass(frozen=True)
class TorchrunJob:
    """What :func:`run_nodes` saw of one ``torchrun`` job."""

    output: str
    """Everything the agents and ranks printed, in the order they printed it."""
    listeners: tuple[tuple[str, int], ...]
    """``(address, port)`` of every socket that any process of the job (the launcher's
    rendezvous store, every agent, every rank) was seen listening on while it ran."""
    processes: int
    """Processes of the job that were watched: agents and ranks, replacements included."""
    replaced_nodes: int
    """Nodes that failed on purpose (``fail_node_after``) and were started again."""
    rendezvous_port: int
    """The port of the rendezvous store this process hosted for the agents."""
    failures: tuple[int, ...] = ()
    """The exit status of each agent that failed on its own, in the order they were
    started (negative: killed by that signal, as :mod:`subprocess` reports it)."""
    timed_out: bool = False
    """Whether the job outlasted its timeout and was stopped."""

    @property
    def exit_code(self) -> int:
        """0 if every agent finished, else the first failed agent's exit status."""
        return self.failures[0] if self.failures else 0


def torchrun_command(
    module: str, args: list[str], nnodes: int, nproc_per_node: int, max_restarts: int, port: int
) -> list[str]:
    """One node's ``torchrun`` command for a job whose rendezvous store listens on
    ``127.0.0.1:port``: the agent only connects to that store (:data:`RENDEZVOUS_CONF`)
    and tells its ranks that it lives at 127.0.0.1 (``--local-addr``)."""
    return [
        sys.executable,
        *("-m", "torch.distributed.run"),
        *(f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}"),
        *("--rdzv-backend=c10d", f"--rdzv-endpoint={LOOPBACK}:{port}"),
        *(f"--rdzv-conf={RENDEZVOUS_CONF}", f"--local-addr={LOOPBACK}"),
        *(f"--max-restarts={max_restarts}", "--monitor-interval=0.2", "-m", module, *args),
    ]


JOB_ENVIRONMENT = {
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    "OMP_NUM_THREADS": "1",
}
"""What every process of a :func:`run_nodes` job is told besides the launcher's own
environment. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: the agent of node 0 does not
host a second store for the ranks (torch 2.13's ``DynamicRendezvousHandler`` would,
listening on every interface, and stale addresses in it break gloo restarts); it
names a free port on ``--local-addr`` instead, where rank 0 hosts the ranks' store
on 127.0.0.1 (:func:`join_job`). gloo stays on the loopback interface, and so do NCCL's
bootstrap sockets on a GPU node (all its ranks are on this machine; NCCL picks a network
interface otherwise)."""


class _Nodes:
    """The agents of one job on this machine, the ranks they started, and every
    address any of them (or the launcher's store) listened on."""

    def __init__(self, command: list[str], log: Any, store_port: int) -> None:
        self.command, self.log, self.store_port = command, log, store_port
        self.agents: list[Any] = []  # psutil.Popen, one per node started
        self.ranks: dict[int, dict[int, Any]] = {}  # agent pid -> {rank pid: psutil.Process}
        self.failed_on_purpose: set[int] = set()
        self.listeners: set[tuple[str, int]] = set()

    def start_node(self) -> None:
        """Start one more node: an agent in a session of its own."""
        import psutil

        environment = {**os.environ, **JOB_ENVIRONMENT}
        agent = psutil.Popen(
            self.command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
        )
        self.agents.append(agent)
        self.ranks[agent.pid] = {}

    def running(self) -> bool:
        """Whether any agent is still running."""
        return any(agent.poll() is None for agent in self.agents)

    def look(self, listeners: bool = True) -> None:
        """Note every agent's ranks and, if ``listeners``, what every process of the job
        listens on."""
        import psutil

        for agent in self.agents:
            with contextlib.suppress(psutil.NoSuchProcess):
                self.ranks[agent.pid].update((p.pid, p) for p in agent.children(recursive=True))
        if not listeners:
            return
        watched = [*self.agents, *(p for ranks in self.ranks.values() for p in ranks.values())]
        for process in watched:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
                if process.is_running():  # the same process, not a reused pid
                    self.listeners.update(_listening(process))
        own = _listening(psutil.Process())
        self.listeners.update(a for a in own if a[1] == self.store_port)

    def fail_last_node(self) -> None:
        """Make the newest node fail as a machine would: SIGKILL to its agent's process
        group and to each of its ranks, which torchrun starts in sessions of their
        own (so the agent's group alone would leave them running); wait until all are gone."""
        import psutil

        agent = self.agents[-1]
        self.look()
        doomed = [agent, *self.ranks[agent.pid].values()]
        for process in doomed:
            with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                if process.is_running():
                    os.killpg(process.pid, signal.SIGKILL)
        agent.wait()
        psutil.wait_procs(doomed[1:], timeout=10)
        self.failed_on_purpose.add(agent.pid)

    def failures(self) -> list[int]:
        """Exit codes of the agents that failed on their own."""
        return [
            a.returncode
            for a in self.agents
            if a.returncode not in (None, 0) and a.pid not in self.failed_on_purpose
        ]

    def stop(self) -> None:
        """Kill whatever is left (after a timeout or an interruption) and reap it all:
        the agents, then their ranks, which live in sessions of their own."""
        import psutil

        self.look()  # ranks an agent started since the last look
        _kill([agent for agent in self.agents if agent.poll() is None])
        everything = [p for ranks in self.ranks.values() for p in ranks.values()]
        _kill(everything)
        psutil.wait_procs(everything, timeout=5)
        for agent in self.agents:
            agent.wait()

    def processes(self) -> int:
        return len(self.agents) + sum(len(ranks) for ranks in self.ranks.values())


def _listening(process: Any) -> set[tuple[str, int]]:
    """``(address, port)`` of each TCP socket that ``process`` (a ``psutil.Process``)
    listens on."""
    import psutil

    return {
        (c.laddr.ip, c.laddr.port)
        for c in process.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def run_nodes(
    module: str,
    args: list[str],
    nnodes: int = 2,
    nproc_per_node: int = 4,
    max_restarts: int = 0,
    timeout: float = 300.0,
    fail_node_after: str | None = None,
) -> TorchrunJob:
    """Run ``torchrun -m module args`` as ``nnodes`` nodes on this machine; return what it did.

    Each node is one ``torchrun`` agent (:func:`torchrun_command`) with
    ``nproc_per_node`` ranks; they meet through c10d rendezvous in a store that
    this process hosts on a socket bound to 127.0.0.1, and nothing of the job
    listens anywhere else (:data:`RENDEZVOUS_CONF`, :data:`JOB_ENVIRONMENT`):
    every process's listening sockets are recorded while it runs
    (:attr:`TorchrunJob.listeners`).

    ``fail_node_after``: once this text appears in the job's output, the newest
    node fails as a machine would (every process of it SIGKILLed) and a new one
    is started in its place, as a cluster scheduler would; the surviving agents
    see their ranks' collectives fail, restart them (one of their
    ``max_restarts``), and all nodes meet again in the next rendezvous round.
    Why a replacement, not the survivors carrying on: with ``--nnodes=2``
    (minimum = maximum = 2) their next round waits (up to ``join_timeout``,
    600 s) for a second node; elastic ``--nnodes=1:2`` would let one node go on
    alone once the lost one's heartbeat expired and ``last_call_timeout`` (30 s)
    passed, on half the ranks: another layout, to which the checkpoint must be
    resharded.

    Raises :class:`RankError` with the output if an agent fails or the job
    outlasts ``timeout`` seconds; no process is left behind either way.
    """
    limit = _checks.positive("timeout", timeout)
    job = run_job(module, args, nnodes, nproc_per_node, max_restarts, limit, fail_node_after)
    if job.timed_out:
        raise RankError(f"torchrun -m {module} did not finish within {limit:g} s:\n{job.output}")
    if job.failures:
        codes = list(job.failures)
        raise RankError(f"torchrun -m {module} failed (exit codes {codes}):\n{job.output}")
    return job


def run_job(
    module: str,
    args: list[str],
    nnodes: int = 1,
    nproc_per_node: int = 1,
    max_restarts: int = 0,
    timeout: float | None = None,
    fail_node_after: str | None = None,
    echo: TextIO | None = None,
    watch_listeners: bool = True,
) -> TorchrunJob:
    """Run a job as :func:`run_nodes` does, and report how it ended instead of raising.

    The same job, kept on 127.0.0.1 the same way; ``timeout`` ``None`` lets it run
    as long as it takes. ``echo``: a stream (the terminal's ``sys.stdout``) that
    receives everything the agents and ranks print, stdout and stderr in the order
    they wrote them, within a tenth of a second of its being written
    (:mod:`trainscale.launch` streams a job this way). ``watch_listeners``: record
    every process's listening sockets (:attr:`TorchrunJob.listeners`; it costs a
    look at each process ten times a second).

    Whatever ends the wait (the job, the timeout, a ``KeyboardInterrupt`` or any other
    exception), every agent and rank is stopped and reaped before this returns or
    raises; the job's own failure is :attr:`TorchrunJob.exit_code`, not an exception.
    """
    nodes_wanted = _checks.count("nnodes", nnodes, minimum=1)
    per_node = _checks.count("nproc_per_node", nproc_per_node, minimum=1)
    restarts = _checks.count("max_restarts", max_restarts)
    limit = math.inf if timeout is None else _checks.positive("timeout", timeout)
    store, port = _loopback_store(nodes_wanted, 300.0 if timeout is None else limit)
    command = torchrun_command(module, args, nodes_wanted, per_node, restarts, port)
    started, replaced = time.monotonic(), 0
    with tempfile.TemporaryDirectory(prefix="trainscale-torchrun-") as tmp:
        path = Path(tmp) / "output.log"
        with path.open("w") as log, path.open("rb") as written:
            nodes = _Nodes(command, log, port)
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

            def pass_on(final: bool = False) -> None:
                """Copy what the job wrote since the last call to ``echo``."""
                if echo is not None:
                    text = decoder.decode(written.read(), final=final)
                    if text:
                        echo.write(text)
                        echo.flush()

            try:
                for _ in range(nodes_wanted):
                    nodes.start_node()
                while nodes.running() and time.monotonic() - started <= limit:
                    nodes.look(listeners=watch_listeners)
                    pass_on()
                    if fail_node_after and not replaced and fail_node_after in path.read_text():
                        nodes.fail_last_node()
                        nodes.start_node()
                        replaced += 1
                    time.sleep(0.1)
                timed_out = nodes.running()
            finally:
                nodes.stop()
                del store
                pass_on(final=True)
        output = path.read_text()
    failures = nodes.failures()
    listeners = tuple(sorted(nodes.listeners))
    return TorchrunJob(
        output,
        listeners,
        nodes.processes(),
        replaced,
        port,
        failures=tuple(failures),
        timed_out=timed_out,
    )


def run_torchrun(
    module: str, args: list[str], nproc: int = 2, max_restarts: int = 0, timeout: float = 300.0
) -> str:
    """Run ``torchrun -m module args`` on one node of ``nproc`` ranks; return everything it printed.

    What a reader would type on one node, kept on 127.0.0.1 as :func:`run_nodes`
    keeps every job. With ``max_restarts`` > 0 torchrun restarts every rank when
    one dies. Raises :class:`RankError` with the output if the job fails or
    outlasts ``timeout`` seconds; no process is left behind either way.
    """
    job = run_nodes(module, args, 1, nproc, max_restarts, timeout)
    return job.output


def _kill(processes: list) -> None:
    """Kill each of these ``psutil`` processes that still exists."""
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
