"""Figures of chapter 16: the best layouts the planner finds, and why the others fail."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from trainscale.figures.style import (
    MEMORY_COLOURS,
    PALETTE,
    STYLE,
    TIME_COLOURS,
    VERDICT_STYLES,
    BookFigure,
    source_note,
    stacked_bar,
)
from trainscale.memory import GIB, USABLE_MEMORY

if TYPE_CHECKING:  # figures sit below the planner: its types only, never its code
    from trainscale.planner import Layout

GIB_TICKS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def _capacity_lines(ax, capacity_gib: float, usable_share: float, y: float) -> None:
    """The GPU's capacity (solid) and the share the planner lets layouts fill (dashed)."""
    ax.axvline(capacity_gib, color=PALETTE["red"], linewidth=2)
    ax.axvline(usable_share * capacity_gib, color=PALETTE["red"], linewidth=1, linestyle="--")
    ax.annotate(
        f"GPU {capacity_gib:.1f} GiB\n(dashed: {usable_share:.0%} usable)",
        (capacity_gib, y),
        xytext=(4, 4),
        textcoords="offset points",
        color=PALETTE["red"],
        ha="left",
        va="bottom",
        fontsize=8,
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1},
    )


MIN_SHARE = 0.005
"""Smallest share of a layout's step a part must take, in some layout drawn, to be drawn
and named in the legend: a part under half a per cent of every bar is invisible (the
optimiser step, or recomputation when no layout recomputes), and context- or
expert-parallel traffic appears only where a layout spends time on it."""


def _time_parts_shown(rows: Sequence[Layout]) -> set[str]:
    return {
        part
        for lay in rows
        for part, seconds in lay.times.items()
        if seconds >= MIN_SHARE * lay.step_seconds
    }


def planner_top_layouts(
    layouts: Sequence[Layout],
    capacity_bytes: float,
    usable_share: float = USABLE_MEMORY,
    title: str | None = None,
) -> Figure:
    """The given layouts (best first) as two bar charts that share their rows.

    Left: the estimated step time split into its causes (:data:`~trainscale.planner.TIME_PARTS`),
    labelled with the MFU. Right: the memory on one GPU of the fullest pipeline
    stage (:data:`~trainscale.planner.MEMORY_PARTS`, GiB) against the GPU's capacity
    and the ``usable_share`` of it the planner allowed.
    """
    rows = [lay for lay in layouts if lay.verdict != "invalid"]
    if not rows:
        raise ValueError("layouts must hold at least one layout that is not invalid")
    capacity = capacity_bytes / GIB
    with plt.rc_context(STYLE):
        fig = BookFigure(figsize=(7.6, 1.6 + 0.62 * len(rows)), layout="constrained")
        time_ax, memory_ax = fig.subplots(1, 2, sharey=True, width_ratios=(1.25, 1))
        labels = [f"{lay.name}\n{lay.settings}" for lay in rows]
        used = _time_parts_shown(rows)
        for row, lay in enumerate(rows):
            times = {part: sec for part, sec in lay.times.items() if part in used}  # TIME_PARTS
            step = stacked_bar(
                time_ax, row, times, TIME_COLOURS, labelled=row == 0, horizontal=True
            )
            time_ax.annotate(f" MFU {lay.mfu:.0%}", (step, row), va="center", ha="left", fontsize=9)
            gib = {part: size / GIB for part, size in lay.memory_parts.items()}  # MEMORY_PARTS
            stacked_bar(memory_ax, row, gib, MEMORY_COLOURS, labelled=row == 0, horizontal=True)
        longest = max(lay.step_seconds for lay in rows)
        time_ax.set_xlim(0, longest * 1.3)
        time_ax.set_yticks(range(len(rows)), labels, fontsize=8)
        time_ax.set_ylim(len(rows) - 0.5, -0.5)
        time_ax.set_xlabel("estimated step time (s)")
        _capacity_lines(memory_ax, capacity, usable_share, len(rows) - 0.5)
        fullest = max(lay.memory_bytes for lay in rows) / GIB
        memory_ax.set_xlim(0, max(capacity, fullest) * 1.45)
        memory_ax.set_xlabel("memory per GPU (GiB)")
        for ax, where, name in ((time_ax, "left", "step time"), (memory_ax, "right", "memory")):
            fig.legend(
                *ax.get_legend_handles_labels(),
                loc=f"outside lower {where}",
                ncol=2,
                fontsize=8,
                title=name,
                title_fontsize=8,
            )
        fig.suptitle(title or "The fastest layouts that fit", fontweight="bold")
    return fig


def planner_rejections(
    layouts: Sequence[Layout],
    capacity_bytes: float,
    usable_share: float = USABLE_MEMORY,
    title: str | None = None,
) -> Figure:
    """Every layout the planner tried: memory per GPU against estimated MFU, by verdict.

    Each point is one layout (shape, ZeRO stage, recomputation, micro-batch); its
    marker says what the planner thinks of it; the solid line is the GPU's
    capacity, the dashed one the ``usable_share`` the planner allowed. ``invalid``
    layouts have no estimate and are only counted, in the title.
    """
    counts = Counter(lay.verdict for lay in layouts)
    drawn = [lay for lay in layouts if lay.verdict != "invalid"]
    if not drawn:
        raise ValueError("layouts must hold at least one layout that is not invalid")
    capacity = capacity_bytes / GIB
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig = BookFigure(figsize=(7.0, 4.2), layout="constrained")
        ax = fig.add_subplot()
        for verdict in VERDICT_STYLES:  # every verdict but "invalid", which has no estimate
            points = [lay for lay in drawn if lay.verdict == verdict]
            if not points:
                continue
            colour, marker = VERDICT_STYLES[verdict]
            ax.scatter(
                [lay.memory_bytes / GIB for lay in points],
                [100 * lay.mfu for lay in points],
                s=16,
                marker=marker,
                color=colour,
                alpha=0.75,
                linewidths=1.0,
                label=f"{verdict} ({counts[verdict]})",
            )
        _capacity_lines(ax, capacity, usable_share, 0)
        ax.set_xscale("log")
        low = min(min(lay.memory_bytes for lay in drawn) / GIB, usable_share * capacity)
        high = max(max(lay.memory_bytes for lay in drawn) / GIB, capacity)
        ax.set_xticks([t for t in GIB_TICKS if low / 1.2 <= t <= high * 1.2])
        ax.set_xticklabels([f"{t:g}" for t in GIB_TICKS if low / 1.2 <= t <= high * 1.2])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("memory per GPU, fullest stage (GiB, log scale)")
        ax.set_ylabel("estimated MFU (%)")
        fig.legend(loc="outside lower center", ncol=4, fontsize=9)
        invalid = counts["invalid"]
        ax.set_title(title or f"{len(layouts)} layouts tried, {invalid} invalid and not drawn")
    return fig


def planner_calibration(
    published: Sequence[float],
    estimates: Sequence[tuple[float, float, float]],
    groups: Sequence[str],
    title: str | None = None,
    *,
    source: str,
) -> Figure:
    """Predicted MFU range against published MFU, one vertical bar per run, on ``y = x``.

    ``published[i]`` is run ``i``'s published MFU; ``estimates[i]`` its ``(low, point,
    high)`` estimate (all shares of peak); ``groups[i]`` names its source, one colour
    per distinct source. A bar that crosses the line holds the published value.
    ``source`` names where the published figures come from (printed under the axes).
    """
    if not (len(published) == len(estimates) == len(groups)) or not published:
        raise ValueError("published, estimates and groups must be non-empty and of one length")
    colours = list(PALETTE.values())
    names = list(dict.fromkeys(groups))
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig = BookFigure(figsize=(7.0, 4.6), layout="constrained")
        ax = fig.add_subplot()
        top = max(max(published), *(high for _, _, high in estimates)) * 108
        ax.plot([0, top], [0, top], color=PALETTE["grey"], linewidth=1, label="y = x")
        for k, name in enumerate(names):
            rows = [i for i, g in enumerate(groups) if g == name]
            xs = [published[i] * 100 for i in rows]
            ax.vlines(
                xs,
                [estimates[i][0] * 100 for i in rows],
                [estimates[i][2] * 100 for i in rows],
                color=colours[k % len(colours)],
                linewidth=2,
            )
            ax.plot(
                xs,
                [estimates[i][1] * 100 for i in rows],
                "o",
                color=colours[k % len(colours)],
                markersize=4,
                label=name,
            )
        ax.set_xlim(0, top)
        ax.set_ylim(0, top)
        ax.set_xlabel("published MFU, 6N convention (%)")
        ax.set_ylabel("planner's estimate (%): dot and range")
        ax.set_title(title or "The planner against published runs")
        ax.legend(fontsize=7, loc="upper left")
        source_note(fig, source, left=True)
    return fig
