"""``python -m trainscale.train``: one rank's job (:func:`worker`) and the command line
that checks its flags before any process group exists (:func:`main`)."""

from __future__ import annotations

import math
import os
import shlex
import sys

from trainscale.distributed import backend_and_device, run_alone, torchrun_main
from trainscale.train.config import DIMS, TrainConfig, parse_args, parser
from trainscale.train.loop import train


def worker(rank: int, world_size: int, argv: list[str] | None = None) -> dict:
    """One rank of the training job, in an initialised process group: run it with
    ``torchrun`` (``python -m trainscale.train``) or
    ``trainscale.distributed.run_ranks(worker, 8, [...])``."""
    config = parse_args(argv)
    config.layout(world_size)  # every rank refuses a bad layout before any collective
    local = int(os.environ.get("LOCAL_RANK", rank))
    return train(config, rank, world_size, backend_and_device(local)[1])


TORCHRUN_ENVIRONMENT = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What ``torchrun`` tells every rank, and :func:`main` looks for to tell whether it runs
under it: all of them, or none (one process alone)."""


def ranks_needed(config: TrainConfig) -> int:
    """How many ranks the flags' layout needs: the product of the sizes given, or 1 with
    none (or ``--parallel``), since data parallelism then fills whatever ranks there are."""
    if config.parallel is not None:
        return 1
    return math.prod(getattr(config, name) or 1 for name in DIMS)


def runs_alone(argv: list[str]) -> bool:
    """Check ``argv`` and the environment before any process group exists; return whether
    this process runs alone (not under ``torchrun``). Raises ``ValueError`` with the one
    line to say: a bad flag, a layout that does not fit ``WORLD_SIZE`` (or, alone, one
    process, saying how to launch it), a torchrun environment with parts missing."""
    config = parse_args(argv)
    found = [name for name in TORCHRUN_ENVIRONMENT if name in os.environ]
    if found and len(found) < len(TORCHRUN_ENVIRONMENT):
        missing = [name for name in TORCHRUN_ENVIRONMENT if name not in os.environ]
        raise ValueError(
            f"the environment sets {', '.join(found)} but not {', '.join(missing)}: start"
            " the job with python -m trainscale.launch (or torchrun), or unset them to run"
            " one process"
        )
    if found:
        config.layout(int(os.environ["WORLD_SIZE"]))
        return False
    needed = ranks_needed(config)
    if needed > 1:
        raise ValueError(
            f"this layout needs {needed} ranks and this is one process (no torchrun): run"
            f" python -m trainscale.launch --nproc-per-node={needed} -m trainscale.train"
            f" {shlex.join(argv)}"
        )
    config.layout(1)
    return True


def main(argv: list[str] | None = None) -> dict:
    """``python -m trainscale.train``: check the arguments, then train.

    Under ``torchrun`` (or ``python -m trainscale.launch``, which runs it), with
    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set: check the
    layout against ``WORLD_SIZE``, join the job
    (:func:`trainscale.distributed.torchrun_main`) and train as one of its ranks.
    Alone, with none of them set: train as a job of one process
    (:func:`trainscale.distributed.run_alone`), if the layout fits one. A bad flag,
    or a layout that needs more ranks than there are, ends the program with
    argparse's one-line error (status 2) before any process group exists; for a
    layout of several ranks run alone, the line says how to launch it.
    """
    arguments = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    if "--estimate-memory" in arguments:  # one process, whatever the layout's size
        try:
            config = parse_args(arguments)
        except ValueError as error:
            p.exit(2, f"{p.prog}: error: {error}\n")
        from trainscale.train.estimate import report  # imports the fake process group

        lines = report(config, config.estimate_all_layers)
        print("\n".join(lines))
        return {"estimate": lines}
    try:
        alone = runs_alone(arguments)
    except ValueError as error:
        p.exit(2, f"{p.prog}: error: {error}\n")
    if alone:
        return run_alone(worker, arguments)
    return torchrun_main(worker, arguments)
