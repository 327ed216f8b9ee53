"""Figures of chapter 3: saved activations over a step, one transformer layer's bytes, and
the measured price of recomputation."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from trainscale.figures.style import MUTED_INK, PALETTE, STYLE, new_figure

MIB = 2**20


def memory_timelines(
    timelines: Mapping[str, Sequence[tuple[float, int]]],
    title: str,
    top_mib: float | None = None,
) -> Figure:
    """Saved activations (MiB) over one training step, one line per way of running it.

    ``timelines`` maps a label to ``(time, bytes)`` points from
    :func:`trainscale.checkpointing.memory_timeline`; the first is drawn dashed
    in grey as the reference, the others solid. Each line's peak is marked, and
    where a line ends says how long its step took. ``top_mib`` fixes the y axis,
    so that figures of one widget share it.
    """
    colours = [PALETTE["grey"], PALETTE["blue"], PALETTE["orange"], PALETTE["green"]]
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig, ax = new_figure((7.0, 3.8))
        for index, (colour, (label, points)) in enumerate(
            zip(colours, timelines.items(), strict=False)
        ):
            times = [t for t, _ in points]
            mib = [b / MIB for _, b in points]
            peak = max(mib)
            ax.plot(
                times,
                mib,
                color=colour,
                linewidth=1.4 if index == 0 else 2.0,
                linestyle="--" if index == 0 else "-",
                label=f"{label}: peak {peak:.2f} MiB",
            )
            ax.axhline(peak, color=colour, linewidth=0.8, linestyle=":")
        ax.set_xlabel("time, in forward passes of one block (a block's backward counts 2)")
        ax.set_ylabel("saved activations (MiB)")
        ax.set_xlim(left=0)
        ax.set_ylim(0, top_mib if top_mib else None)
        ax.set_title(title)
        fig.legend(loc="outside lower center", ncol=len(timelines))
    return fig


def layer_bytes(measured: Mapping[str, int], estimates: Mapping[str, int], title: str) -> Figure:
    """Horizontal bars of measured bytes for variants of one layer, with estimate lines.

    ``measured`` maps a variant to the bytes autograd kept; ``estimates`` maps a
    label to a formula's bytes, drawn as vertical dashed lines across the bars.
    """
    lines = [PALETTE["red"], PALETTE["green"], PALETTE["purple"]]
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 1.4 + 0.45 * len(measured)))
        names = list(measured)
        values = [measured[n] / MIB for n in names]
        bars = ax.barh(range(len(names)), values, height=0.6, color=PALETTE["sky"])
        ax.bar_label(bars, fmt="%.2f", padding=3)
        for colour, (label, value) in zip(lines, estimates.items(), strict=False):
            ax.axvline(
                value / MIB,
                color=colour,
                linestyle="--",
                linewidth=1.5,
                label=f"{label}: {value / MIB:.2f}",
            )
        ax.set_yticks(range(len(names)), names)
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_xlim(0, max(values + [v / MIB for v in estimates.values()]) * 1.15)
        ax.set_xlabel("saved activations of one layer (MiB)")
        ax.set_title(title)
        fig.legend(loc="outside lower center", ncol=min(3, len(estimates)), title="estimate, MiB")
    return fig


def recompute_slowdown(
    sizes: Sequence[int],
    slowdowns: Sequence[float],
    references: Mapping[str, float],
    title: str,
    xlabel: str,
    note: str,
) -> Figure:
    """Measured slowdown of a checkpointed step against the size of the model's layers.

    ``slowdowns[i]`` is the time of a training step with checkpointing divided by
    the time without, measured at ``sizes[i]`` (drawn on a base-2 logarithmic axis).
    ``references`` maps a label to a counted ratio (of FLOPs, of operators), each
    drawn as a dashed horizontal line; ``note`` (where the data come from, how
    FLOPs are counted) is written under the axes, wrapped at 110 characters.
    """
    if len(sizes) != len(slowdowns) or not sizes:
        raise ValueError(
            f"sizes and slowdowns must be non-empty and of equal length,"
            f" got {len(sizes)} and {len(slowdowns)}"
        )
    lines = [PALETTE["orange"], PALETTE["grey"], PALETTE["green"]]
    styles = ["--", ":", "-."]
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig, ax = new_figure((7.0, 3.8))
        ax.plot(
            sizes,
            slowdowns,
            color=PALETTE["blue"],
            marker="o",
            linewidth=2.0,
            label="step time with / without checkpointing (measured)",
        )
        for colour, style, (label, value) in zip(lines, styles, references.items(), strict=False):
            ax.axhline(value, color=colour, linestyle=style, linewidth=1.5, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(sizes), [str(s) for s in sizes])
        ax.minorticks_off()
        top = max([*slowdowns, *references.values()])
        ax.set_ylim(1.0, top * 1.08)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("slowdown (x)")
        ax.set_title(title)
        ax.legend(loc="upper right", fontsize=9)
        fig.supxlabel(textwrap.fill(note, 110), fontsize=8, color=MUTED_INK)
    return fig
