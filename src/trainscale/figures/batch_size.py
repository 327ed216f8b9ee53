"""Figures of chapter 10's noise scale: how it grows during a run, and what it predicts."""

from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from trainscale.batch_size import optimal_lr_share
from trainscale.figures.style import INK, MUTED_INK, PALETTE, STYLE, BookFigure

POINT_COLOURS = [
    PALETTE["red"],
    PALETTE["orange"],
    PALETTE["green"],
    PALETTE["sky"],
    PALETTE["blue"],
    PALETTE["purple"],
]


def noise_scale_growth(
    steps: Sequence[int],
    losses: Sequence[float],
    noise_scales: Sequence[float],
    batch: int,
    title: str,
    source: str,
) -> Figure:
    """Left: the simple noise scale ``noise_scales[i]`` (sequences, log scale) after
    ``steps[i]`` steps, each point labelled with the run's loss there
    (``losses[i]``, nats), and the run's own ``batch`` as a dashed line. Right: for
    each point, McCandlish et al.'s best SGD learning rate at batch ``B`` as a
    share of the best with the exact gradient, ``1 / (1 + B_simple / B)``
    (:func:`trainscale.batch_size.optimal_lr_share`), on log-log axes, where the
    linear scaling rule is the straight rising part. ``source`` is printed under
    the panels.
    """
    if not len(steps) == len(losses) == len(noise_scales) > 0:
        raise ValueError("steps, losses and noise_scales must be equally long and not empty")
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig = BookFigure(figsize=(7.6, 3.9), layout="constrained")
        growth, rates = fig.subplots(1, 2)
        colours = [POINT_COLOURS[i % len(POINT_COLOURS)] for i in range(len(steps))]
        growth.plot(steps, noise_scales, color=INK, linewidth=1, zorder=1)
        growth.scatter(steps, noise_scales, c=colours, s=36, zorder=2)
        for step, loss, scale in zip(steps, losses, noise_scales, strict=True):
            growth.annotate(
                f"loss {loss:.2f}",
                (step, scale),
                xytext=(4, -11),
                textcoords="offset points",
                fontsize=8,
                color=MUTED_INK,
            )
        growth.axhline(batch, color=MUTED_INK, linestyle="--", linewidth=1)
        growth.annotate(
            f"the run's batch: {batch}",
            (0, batch),
            xytext=(2, 3),
            textcoords="offset points",
            fontsize=8,
            color=MUTED_INK,
        )
        growth.set_yscale("log")
        low, high = min(*noise_scales, batch), max(*noise_scales, batch)
        growth.set_ylim(low / 1.8, high * 1.5)  # room for the labels under the points
        span = max(steps) - min(steps) or 1
        growth.set_xlim(min(steps) - 0.05 * span, max(steps) + 0.15 * span)
        growth.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        growth.set_xlabel("training step")
        growth.set_ylabel("simple noise scale (sequences)")
        growth.set_title("B_simple grows as the loss falls", fontsize=11)

        batches = [2.0**k for k in range(0, 15)]
        for step, scale, colour in zip(steps, noise_scales, colours, strict=True):
            shares = [optimal_lr_share(b, scale) for b in batches]
            rates.plot(batches, shares, color=colour, linewidth=1.6, label=f"step {step}")
        rates.axvline(batch, color=MUTED_INK, linestyle="--", linewidth=1)
        rates.annotate(
            "the run's batch",
            (batch, 0.02),
            xycoords=("data", "axes fraction"),
            xytext=(3, 0),
            textcoords="offset points",
            fontsize=8,
            color=MUTED_INK,
        )
        rates.set_xscale("log", base=2)
        rates.set_xticks([b for b in batches if math.log2(b) % 3 == 0])
        rates.set_yscale("log")
        rates.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        rates.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
        rates.set_xlabel("batch size B (sequences)")
        rates.set_ylabel("best learning rate / its limit")
        rates.set_title("1 / (1 + B_simple / B)", fontsize=11)
        rates.legend(fontsize=8, loc="lower right")
        fig.suptitle(title, fontweight="bold", fontsize=12)
        fig.supxlabel(source, fontsize=7.5, color=MUTED_INK)
    return fig
