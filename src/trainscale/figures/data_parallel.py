"""Figures of chapter 5: how data parallelism cuts a batch, what averaging gives, and when
DDP's gradient buckets are all-reduced."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from trainscale.figures.style import (
    MUTED_INK,
    PHASE_COLOURS,
    RANK_COLOURS,
    STYLE,
    BookFigure,
    new_figure,
)


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


def bucket_timeline(
    labels: Sequence[str],
    launched_ms: Sequence[float],
    completed_ms: Sequence[float],
    backward_ms: float,
    title: str,
) -> Figure:
    """One backward pass under DDP: when each gradient bucket's all-reduce ran.

    Bucket ``i`` (``labels[i]``, e.g. the blocks whose gradients it holds) was
    launched at ``launched_ms[i]`` and completed at ``completed_ms[i]``, in ms
    after backward started; ``backward()`` returned at ``backward_ms``. The top
    lane is backward: computing until the last bucket's launch (its last
    gradient), then waiting for the all-reduces still running. A figure of
    measured times: show it with ``fig.measured()``.
    """
    if not len(labels) == len(launched_ms) == len(completed_ms) > 0:
        raise ValueError(
            "labels, launched_ms and completed_ms must be equally long and not empty, got"
            f" {len(labels)}, {len(launched_ms)} and {len(completed_ms)}"
        )
    compute_end = max(launched_ms)
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 1.6 + 0.4 * len(labels)))
        ax.barh(0, compute_end, height=0.6, color=PHASE_COLOURS["backward"])
        ax.barh(
            0,
            backward_ms - compute_end,
            left=compute_end,
            height=0.6,
            color="white",
            edgecolor=PHASE_COLOURS["backward"],
            hatch="///",
            linewidth=0.0,
        )
        for row, (start, stop) in enumerate(zip(launched_ms, completed_ms, strict=True), start=1):
            ax.barh(row, stop - start, left=start, height=0.6, color=PHASE_COLOURS["all-reduce"])
        ax.axvline(compute_end, color=MUTED_INK, linestyle="--", linewidth=0.8)
        ax.set_yticks(range(len(labels) + 1), ["backward", *labels])
        ax.set_ylim(len(labels) + 0.6, -0.6)
        ax.set_xlim(0, max(backward_ms, *completed_ms) * 1.02)
        ax.set_xlabel("time since backward started (ms)")
        ax.set_title(title)
        handles = [
            Patch(color=PHASE_COLOURS["backward"], label="computing gradients"),
            Patch(
                facecolor="white",
                edgecolor=PHASE_COLOURS["backward"],
                hatch="///",
                label="waiting for all-reduces",
            ),
            Patch(color=PHASE_COLOURS["all-reduce"], label="bucket's all-reduce"),
        ]
        fig.legend(handles=handles, loc="outside lower center", ncol=3)
    return fig
