"""Figures of chapter 13's noise scale: how it grows during a run, and what it predicts."""

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


def batch_scaling(
    lrs: Sequence[float],
    gaps: Sequence[float],
    batches: Sequence[int],
    useful: Sequence[float],
    title: str,
) -> Figure:
    """Two limits of the linear scaling rule, on log-log axes.

    Left: how far ``k`` small SGD steps land from one step at ``k`` times the rate
    (``gaps[i]``, a share of the large step; :func:`trainscale.stability.linear_scaling_gap`)
    at learning rate ``lrs[i]``, with a line proportional to the rate through the first
    point. Right: how far Adam's later steps move along the true gradient
    (``useful[i]``, in learning rates; :func:`trainscale.stability.adam_step_sizes`) at
    batch ``batches[i]``, with a line proportional to the square root of the batch
    through the first point, and the ceiling of one learning rate per step.
    """
    if not len(lrs) == len(gaps) > 1 or not len(batches) == len(useful) > 1:
        raise ValueError("lrs and gaps, and batches and useful, must be equally long (2 or more)")
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig = BookFigure(figsize=(7.6, 3.4), layout="constrained")
        sgd, adam = fig.subplots(1, 2)
        sgd.plot(lrs, gaps, "o-", color=PALETTE["blue"], linewidth=1.6, label="measured gap")
        sgd.plot(
            lrs,
            [gaps[0] * lr / lrs[0] for lr in lrs],
            linestyle="--",
            color=MUTED_INK,
            linewidth=1,
            label="proportional to the rate",
        )
        sgd.set_xlabel("learning rate")
        sgd.set_ylabel("gap (share of the large step)")
        sgd.set_title("SGD: the rule is exact at small rates", fontsize=11)
        adam.plot(batches, useful, "o-", color=PALETTE["orange"], linewidth=1.6, label="AdamW")
        adam.plot(
            batches,
            [useful[0] * math.sqrt(b / batches[0]) for b in batches],
            linestyle="--",
            color=MUTED_INK,
            linewidth=1,
            label="proportional to √batch",
        )
        adam.axhline(1.0, color=PALETTE["grey"], linestyle=":", linewidth=1)
        adam.annotate(
            "one learning rate per step",
            (batches[0], 1.0),
            xytext=(2, 3),
            textcoords="offset points",
            fontsize=8,
            color=MUTED_INK,
        )
        adam.set_xscale("log", base=2)
        adam.set_xticks(list(batches))
        adam.set_yscale("log")
        adam.set_yticks([0.125, 0.25, 0.5, 1.0])
        adam.set_ylim(min(useful) / 1.5, 1.4)
        adam.set_xlabel("batch size (examples)")
        adam.set_ylabel("later steps' useful move (x lr)")
        adam.set_title("Adam: a larger batch gains less", fontsize=11)
        sgd.set_xscale("log")
        sgd.set_yscale("log")
        for ax in (sgd, adam):
            ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(plt.NullFormatter())
            ax.legend(fontsize=8, loc="lower right")
        fig.suptitle(title, fontweight="bold", fontsize=12)
    return fig
