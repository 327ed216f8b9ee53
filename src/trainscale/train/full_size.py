"""Chapter 17's checks at full size: the planner's memory beside torch's tracker for three
real layouts, each measured by :func:`trainscale.train.estimate.estimate_memory` on a fake
world of its full size.

* Llama 3 8B on one node of 8 H100s and 70B on 8 nodes, at the layout whose command
  ``python -m trainscale.planner`` prints (the fastest the capstone can hold,
  :func:`planned_flags`);
* Llama 3 405B at Meta's layout, TP 8 x PP 16 x DP 128 on 16,384 H100s (Dubey et al.
  2024, arXiv 2407.21783, Table 4), with sixteen micro-batches of one sequence, the
  same 16 sequences per data-parallel rank and step as Meta's eight of two: torch's
  interleaved schedule needs a multiple of the 16 stages (:func:`meta_405b_flags`).

``make bench`` times them (``python tools/bench.py estimates``).
"""

from __future__ import annotations

import contextlib
import io
import shlex
from collections.abc import Callable
from typing import Any


def planned_flags(argv: list[str]) -> list[str]:
    """The ``trainscale.train`` flags of the cluster command ``python -m trainscale.planner
    argv`` prints, as a reader would copy them."""
    from trainscale.planner import cli

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        cli.main(argv)
    command = printed.getvalue().split("\ntorchrun ", 1)[1].split("\n\n", 1)[0]
    words = shlex.split(command.replace("\\\n", " "))
    flags = words[words.index("trainscale.train") + 1 :]
    at = flags.index("--peak-flops")  # for the training log's MFU only
    return flags[:at] + flags[at + 2 :]


def meta_405b_flags() -> list[str]:
    """Meta's 405B layout of the published row (TP 8 x PP 16 x DP 128, interleaved, ZeRO
    as the planner reads it), one sequence per micro-batch and sixteen of them."""
    from trainscale import planner
    from trainscale.planner.commands import train_flags
    from trainscale.published import published_runs

    (run,) = [r for r in published_runs() if "405B" in r.name and r.dp == 128]
    layout = planner.estimate_run(run).layout
    flags = train_flags(layout, planner.published_model(run), 1.0)
    flags = flags[: flags.index("--peak-flops")]
    at = flags.index("--micro-batch")
    sequences = layout.micro_batch * layout.accumulation
    flags[at + 1 : at + 4 : 2] = ["1", str(sequences)]  # --micro-batch 1 --grad-accum 16
    return flags


CASES: dict[str, Callable[[], list[str]]] = {
    "Llama 3 8B on 8 H100s, the planner's command": lambda: planned_flags(
        ["--model", "llama-3-8b"]
    ),
    "Llama 3 70B on 64 H100s, the planner's command": lambda: planned_flags(
        ["--model", "llama-3-70b", "--nodes", "8"]
    ),
    "Llama 3 405B on 16,384 H100s, Meta's layout": meta_405b_flags,
}
"""The three cases, each a function giving its ``python -m trainscale.train`` flags."""


def table(name: str, found: dict[str, Any], gpu_bytes: float | None = None) -> list[str]:
    """``name``, the layout and its fullest pipeline rank, then ``found``
    (:func:`~trainscale.train.estimate.estimate_memory`'s result) beside the planner
    (:func:`~trainscale.train.estimate.comparison_lines`), against a GPU of ``gpu_bytes``
    (``None``: an H100-80GB's,
    :func:`~trainscale.train.estimate.h100_bytes`)."""
    from trainscale.train.estimate import comparison_lines, h100_bytes

    whose = "an H100's" if gpu_bytes is None else "the GPU's"
    gpu = h100_bytes() if gpu_bytes is None else gpu_bytes
    return [
        f"{name}: {found['layout'].describe()}, pipeline rank {found['pp_rank']} the fullest",
        *comparison_lines(found, gpu, whose),
    ]
