"""Figures of chapter 3: how data parallelism cuts a batch, and what averaging gives."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from trainscale.figures.style import RANK_COLOURS, STYLE, BookFigure


def _error_text(error: float) -> str:
    """A relative error in words: rounding noise reads as a match, not as a number."""
    return "matches (within 1e-6)" if error < 1e-6 else f"off by {100 * error:.2g} %"


def batch_split(sizes: Sequence[int], plain_error: float, weighted_error: float) -> Figure:
    """A batch cut into one slice per replica, and how far each way of averaging lands.

    ``sizes[r]`` is replica ``r``'s number of examples (as
    :func:`trainscale.workers.data_parallel.slice_sizes` cuts them). The top row
    is the whole batch, one square per example in its replica's colour; below
    it each replica's slice on its own row, with its share of the batch, the
    weight its gradient needs. ``plain_error`` and ``weighted_error`` are the
    largest relative differences from the full-batch gradient of the plain and
    the weighted mean of the replicas' gradients.
    """
    batch, replicas = sum(sizes), len(sizes)
    starts = [sum(sizes[:r]) for r in range(replicas)]
    with plt.rc_context({**STYLE, "axes.grid": False, "axes.spines.left": False}):
        # A fixed layout (no layout engine): a slider draws dozens of these.
        width, height = 7.0, 1.9 + 0.32 * replicas
        fig = BookFigure(figsize=(width, height))
        ax = fig.add_axes((0.75 / width, 0.85 / height, 1 - 0.95 / width, 1 - 1.3 / height))
        for r, (start, size) in enumerate(zip(starts, sizes, strict=True)):
            colour = RANK_COLOURS[r % len(RANK_COLOURS)]
            examples = range(start, start + size)
            ax.barh([0] * size, 0.9, left=[e + 0.05 for e in examples], height=0.7, color=colour)
            ax.barh(r + 1.2, size, left=start, height=0.7, color=colour)
            ax.text(
                batch + 0.02 * batch + 0.3,
                r + 1.2,
                f"{size} examples, weight {size}/{batch} = {size / batch:.3f}",
                va="center",
                fontsize=9,
            )
        ax.set_yticks(
            [0] + [r + 1.2 for r in range(replicas)],
            ["batch"] + [f"GPU {r}" for r in range(replicas)],
        )
        ax.tick_params(axis="y", length=0)
        ax.set_ylim(replicas + 0.8, -0.6)
        ax.set_xlim(0, batch * 1.75 + 2)
        ax.set_xticks([0, batch])
        ax.spines["bottom"].set_bounds(0, batch)
        ax.set_xlabel("examples of the batch")
        if replicas == 1:
            title = f"A batch of {batch} on one GPU: nothing to average"
        else:
            kind = "equal" if len(set(sizes)) == 1 else "unequal"
            title = f"A batch of {batch} on {replicas} replicas: {kind} slices"
        ax.set_title(title)
        fig.text(
            0.5,
            0.01,
            f"plain mean of the gradients: {_error_text(plain_error)};  "
            f"weighted by slice: {_error_text(weighted_error)}",
            ha="center",
            va="bottom",
            fontsize=10,
        )
    return fig
