"""Figures of chapter 9: saved activations over a step, and one transformer layer's bytes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from trainscale.figures.style import PALETTE, STYLE, new_figure

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
