"""``python -m trainscale.launch``: a ``torchrun`` job on this computer, on 127.0.0.1 only.

What the book's chapters tell you to type on your own computer::

    python -m trainscale.launch --nproc-per-node=4 -m trainscale.workers.collectives
    python -m trainscale.launch --nproc-per-node=2 --max-restarts=1 \\
        -m trainscale.train --parallel fsdp --ckpt-dir /tmp/ckpt

It takes ``torchrun``'s common flags (``--nproc-per-node``, ``--max-restarts``,
``-m MODULE`` and the module's own arguments after it) and runs the job exactly
as :func:`trainscale.distributed.run_nodes` does, as one node: a ``torchrun``
agent starts the ranks, and everything the job prints reaches your terminal as
it is printed. It returns the job's exit status (0 when every rank finished),
and Ctrl-C (or SIGTERM, or closing the terminal) stops the agent and every
rank before it exits with 128 + the signal's number.

Why not plain ``torchrun``: a torch 2.13 ``TCPStore`` listens on every network
interface whatever address it is given, so ``torchrun --rdzv-endpoint=127.0.0.1:29500``
still opens port 29500 to the network while it runs, and each job two more
ports for its ranks' store. Here this process hosts the rendezvous store on a
socket bound to 127.0.0.1, the agent only connects to it, rank 0 hosts the
ranks' store on 127.0.0.1 (:func:`trainscale.distributed.join_job`) and gloo
stays on the loopback interface (:data:`trainscale.distributed.JOB_ENVIRONMENT`).
The last two hold for modules whose ranks join through
:func:`trainscale.distributed.torchrun_main` or ``join_job``, as every module
of the package does; a script of your own that calls
``torch.distributed.init_process_group()`` hosts its store on every interface again.

A cluster needs the network: there each node runs ``torchrun`` itself (the
command ``python -m trainscale.planner`` prints), the agent on the head node
hosts the rendezvous store on port 29500 of every interface, and the ranks'
store and their NCCL or gloo connections open further ports on the nodes'
network, which belongs behind the cluster's firewall.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

from trainscale import _checks, distributed

PROG = "python -m trainscale.launch"


@dataclass(frozen=True)
class Launch:
    """One job to launch: ``module`` with ``args`` on ``nproc_per_node`` ranks of this
    computer, started again up to ``max_restarts`` times when a rank fails."""

    module: str
    args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if not self.module or self.module.startswith("-"):
            raise ValueError(f"-m must name a module, got {self.module!r}")
        _checks.count("--nproc-per-node", self.nproc_per_node, minimum=1)
        _checks.count("--max-restarts", self.max_restarts)

    def command(self) -> str:
        """The command line that launches this job."""
        flags = [f"--nproc-per-node={self.nproc_per_node}"]
        if self.max_restarts:
            flags.append(f"--max-restarts={self.max_restarts}")
        return " ".join([PROG, *flags, "-m", self.module, *self.args])


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m trainscale.launch``: ``torchrun``'s common flags."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Run a torchrun job of one node on this computer with every listening socket"
            " on 127.0.0.1 (plain torchrun's stores listen on every interface)."
        ),
        epilog=f"example: {PROG} --nproc-per-node=4 -m trainscale.workers.collectives",
    )
    add = p.add_argument
    add("--nproc-per-node", "--nproc_per_node", type=int, default=1, help="ranks (processes)")
    add(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="start every rank again this many times when one fails",
    )
    add("--nnodes", default="1", help="only 1: one node, this computer (a cluster uses torchrun)")
    add("-m", "--module", action="store_true", help="run the target as a module (required)")
    add("target", help="the module, e.g. trainscale.train")
    add("args", nargs=argparse.REMAINDER, help="the module's own arguments")
    return p


def parse(argv: Sequence[str] | None = None) -> Launch:
    """The job ``argv`` asks for; a value out of range raises ``ValueError`` naming its flag
    (argparse itself ends the program on an unknown flag or a missing module)."""
    args = parser().parse_args(argv)
    if args.nnodes != "1":
        raise ValueError(
            f"--nnodes must be 1 (one node, this computer; a cluster runs torchrun on each"
            f" node), got {args.nnodes!r}"
        )
    if not args.module:
        raise ValueError(
            f"-m must come before the target: the launcher runs modules (-m {args.target}),"
            " not scripts"
        )
    return Launch(args.target, tuple(args.args), args.nproc_per_node, args.max_restarts)


class Stopped(Exception):
    """The launcher was told to stop by ``signal_number`` (SIGINT, SIGTERM or SIGHUP)."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(signal.Signals(signal_number).name)
        self.signal_number = signal_number


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Ctrl-C, ``kill``, and the terminal closing: each stops the job, then the launcher."""


def _stop(signal_number: int, frame: FrameType | None) -> None:
    """Stop the job: raise :class:`Stopped`, once; a second signal while the job's
    processes are being stopped is ignored, so that nothing is left half stopped."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    raise Stopped(signal_number)


@contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """Each of :data:`STOP_SIGNALS` raises :class:`Stopped` while this lasts, so that
    :func:`trainscale.distributed.run_job` stops the job before this process exits."""
    before = {number: signal.signal(number, _stop) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


def exit_status(code: int) -> int:
    """The shell's exit status for a process that ended with ``code`` as :mod:`subprocess`
    reports it: its own status, or 128 + N when signal N killed it."""
    return 128 - code if code < 0 else code


def run(job: Launch) -> int:
    """Run ``job`` as one node (:func:`trainscale.distributed.run_job`), its output
    streamed to this process's stdout; return its exit status."""
    ended = distributed.run_job(
        job.module,
        list(job.args),
        nnodes=1,
        nproc_per_node=job.nproc_per_node,
        max_restarts=job.max_restarts,
        echo=sys.stdout,
        watch_listeners=False,
    )
    return exit_status(ended.exit_code)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status: the job's, 2 for bad input,
    128 + N when signal N (Ctrl-C: 2) stopped it."""
    try:
        job = parse(argv)
    except ValueError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    try:
        with _stopped_by_signals():
            return run(job)
    except Stopped as stop:
        number = stop.signal_number
    name = signal.Signals(number).name
    print(f"{PROG}: stopped by {name}; every process of the job has ended", file=sys.stderr)
    return 128 + number


if __name__ == "__main__":
    sys.exit(main())
