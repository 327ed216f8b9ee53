"""Figures of chapter 13: the learning-rate schedule, training runs that go wrong, weight decay."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from trainscale.figures.style import INK, MUTED_INK, PALETTE, STYLE, BookFigure, new_figure

NICE_TICKS = (0.1, 0.15, 0.2, 0.3, 0.5, 1, 1.5, 2, 3, 5, 10, 15, 20, 30, 50, 100)
RUN_COLOURS = [PALETTE["red"], PALETTE["orange"], PALETTE["purple"], PALETTE["blue"]]


def lr_schedule(
    steps: Sequence[int],
    rates: Sequence[float],
    warmup: int,
    total: int,
    title: str,
    checked: Mapping[int, float] | None = None,
    y_max: float | None = None,
) -> Figure:
    """The learning rate against the step: ``rates[i]`` is the rate of step ``steps[i]``.

    The warmup and the end of the decay are marked with dotted lines;
    ``checked`` (step -> rate), if given, is drawn as dots on the curve, e.g.
    the rates a ``torch.optim.lr_scheduler`` gave at those steps. ``y_max``
    fixes the top of the axis (so that slider positions compare); by default
    it follows the curve.
    """
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((7.0, 3.2))
        ax.plot(steps, rates, color=PALETTE["blue"], linewidth=2, label="formula")
        if checked:
            ax.plot(
                list(checked),
                list(checked.values()),
                "o",
                color=PALETTE["orange"],
                markersize=5,
                label="torch.optim.lr_scheduler",
            )
            ax.legend(loc="lower left", bbox_to_anchor=(0.08, 0.02))
        top = max(rates) if y_max is None else y_max / 1.15
        for step, text in ((warmup, "end of warmup"), (total, "end of decay")):
            if 0 < step < steps[-1]:
                ax.axvline(step, color=PALETTE["grey"], linestyle=":", linewidth=1)
                ax.annotate(
                    text,
                    (step, top * 1.02),
                    xytext=(3, 0),
                    textcoords="offset points",
                    fontsize=9,
                    color=MUTED_INK,
                    va="bottom",
                )
        ax.set_xlim(0, steps[-1])
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.set_ylim(0, top * 1.15)
        ax.set_xlabel("step")
        ax.set_ylabel("learning rate")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        ax.set_title(title)
    return fig


def training_curves(
    runs: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    best_loss: float,
    title: str,
    *,
    loss_range: tuple[float, float] = (1.0, 20.0),
    norm_range: tuple[float, float] = (0.1, 100.0),
    alarms: Mapping[str, int] | None = None,
) -> Figure:
    """Loss (left) and gradient norm (right) of several runs, on log scales.

    ``runs`` maps a label to ``(losses, grad_norms)``, one value per step. The
    axes are limited to ``loss_range`` and ``norm_range`` so that the runs that
    train stay readable. A run whose last value is above the top of a panel, or
    not finite, has diverged: a cross on that panel's top edge marks its last
    step (where :func:`trainscale.stability.train` stopped it).
    ``best_loss``, the lowest loss any model can reach, is a dashed line.
    ``alarms`` (label -> step) are drawn as dotted vertical lines in both panels.
    """
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig = BookFigure(figsize=(7.6, 3.8), layout="constrained")
        loss_ax, norm_ax = fig.subplots(1, 2, sharex=True)
        longest = max(len(curves[0]) for curves in runs.values())
        panels = ((loss_ax, loss_range), (norm_ax, norm_range))
        for colour, (label, curves) in zip(RUN_COLOURS, runs.items(), strict=False):
            for (ax, (_, top)), values in zip(panels, curves, strict=True):
                finite = [v for v in values if math.isfinite(v)]
                ax.plot(range(len(finite)), finite, color=colour, linewidth=1.4, label=label)
                if not values[-1] <= top:  # above the panel, inf or NaN: stopped there
                    last = len(values) - 1
                    ax.plot(last, top, "x", color=colour, markersize=9, mew=2, clip_on=False)
        loss_ax.axhline(best_loss, color=INK, linestyle="--", linewidth=1)
        loss_ax.annotate(
            "best possible loss",
            (longest, best_loss),
            xytext=(0, -3),
            textcoords="offset points",
            ha="right",
            va="top",
            fontsize=9,
        )
        for i, (name, step) in enumerate(sorted((alarms or {}).items(), key=lambda a: a[1])):
            for ax in (loss_ax, norm_ax):
                ax.axvline(step, color=MUTED_INK, linestyle=":", linewidth=1)
            norm_ax.annotate(  # the first label left of its line, the others right of theirs
                name,
                (step, norm_range[0]),
                xytext=(-3 if i == 0 else 3, 3),
                textcoords="offset points",
                ha="right" if i == 0 else "left",
                va="bottom",
                fontsize=8,
                color=MUTED_INK,
            )
        labels = ("training loss (nats)", "gradient norm, before clipping")
        for (ax, limits), label in zip(panels, labels, strict=True):
            ax.set_yscale("log")
            if limits[1] / limits[0] < 100:  # less than two decades: label 1, 1.5, 2, 3, 5...
                ax.set_yticks([v for v in NICE_TICKS if limits[0] <= v <= limits[1]])
            ax.set_ylim(*limits)
            ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(plt.NullFormatter())
            ax.set_xlabel("step")
            ax.set_ylabel(label)
            ax.set_xlim(0, longest)
        fig.suptitle(title, fontweight="bold", fontsize=12)
        fig.legend(*loss_ax.get_legend_handles_labels(), loc="outside lower center", ncol=len(runs))
    return fig


def decay_bars(shares: Mapping[str, Sequence[float]], labels: Sequence[str], title: str) -> Figure:
    """Grouped bars: for each optimiser (key of ``shares``), each weight's final
    value as a share of its value without the penalty (1 = not decayed)."""
    colours = [PALETTE["orange"], PALETTE["blue"], PALETTE["green"], PALETTE["purple"]]
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((7.0, 3.2))
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            xs = [g + (i - (len(labels) - 1) / 2) * width for g in range(len(shares))]
            heights = [values[i] for values in shares.values()]
            bars = ax.bar(xs, heights, width * 0.95, color=colours[i % len(colours)], label=label)
            ax.bar_label(bars, fmt="%.2f", padding=2)
        ax.axhline(1.0, color=INK, linestyle=":", linewidth=1)
        ax.set_xticks(range(len(shares)), list(shares))
        ax.set_ylim(0, 1.2)
        ax.set_ylabel("final weight / weight\nwithout the penalty")
        ax.set_title(title)
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
