"""Figures of chapter 7: pipeline timelines and the bubble against the number of micro-batches."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, PathPatch
from matplotlib.path import Path

from trainscale.figures.style import PALE_GREY, PALETTE, STYLE, BookFigure
from trainscale.pipeline import Timeline

SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved 1F1B"}
"""How the figures spell each schedule."""

_FILL = {  # (kind, chunk parity) -> (face colour, text colour)
    ("forward", 0): (PALETTE["blue"], "white"),
    ("backward", 0): (PALETTE["orange"], "black"),
    ("forward", 1): (PALETTE["sky"], "black"),
    ("backward", 1): (PALETTE["yellow"], "black"),
}
_IDLE = PALE_GREY
_BAR = 0.72  # height of a stage's row of boxes


def timeline_title(timeline: Timeline) -> str:
    """The default panel title: the schedule, its size, its bubble and its peak memory."""
    name = SCHEDULE_NAMES.get(timeline.schedule, timeline.schedule)
    if timeline.chunks > 1:
        name = f"Interleaved, {timeline.chunks} chunks"
    m = timeline.micro_batches
    held = max(timeline.peak_activations, default=0)
    return (
        f"{name}, {timeline.stages} stages, {m} micro-batch{'es' * (m != 1)}:"
        f" bubble {timeline.bubble:.0%}, at most {held:g} held"
    )


def _boxes(ax: Axes, timeline: Timeline, label_width: float | None) -> None:
    """Every operation as a box; one compound path per colour keeps the SVG small."""
    rectangles: dict[tuple[str, int], list] = {key: [] for key in _FILL}
    for stage, ops in enumerate(timeline.ops):
        top = stage - _BAR / 2
        for op in ops:
            key = (op.kind, op.chunk % 2)
            x0, x1, y0, y1 = op.start, op.end, top, top + _BAR
            rectangles[key].append([(x0, y0), (x1, y0), (x1, y1), (x0, y1), (x0, y0)])
            if label_width is not None and op.end - op.start >= label_width:
                label = ax.text(
                    (op.start + op.end) / 2,
                    stage,
                    str(op.micro_batch),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color=_FILL[key][1],
                )
                label.set_in_layout(False)  # inside the axes: no need to lay it out
    for key, polygons in rectangles.items():
        if not polygons:
            continue
        codes = [Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY]
        path = Path([point for polygon in polygons for point in polygon], codes * len(polygons))
        ax.add_patch(PathPatch(path, facecolor=_FILL[key][0], edgecolor="white", linewidth=0.6))


def pipeline_timelines(
    timelines: Sequence[Timeline],
    titles: Sequence[str] | None = None,
    xlabel: str = "time (in forward passes of one micro-batch on one stage)",
    end: float | None = None,
    numbers: bool = True,
) -> Figure:
    """One panel per timeline, stacked on a shared time axis, one row per stage.

    Boxes are forward (blue) and backward (orange) passes, numbered by
    micro-batch; the grey band behind them is idle time, the bubble. With
    interleaved schedules the second chunk of each device is drawn in lighter
    colours. ``end`` fixes the right end of the time axis (default: the longest
    timeline), so several figures can share one scale. ``numbers=False`` leaves
    the micro-batch numbers out: a lighter figure, for sliders.
    """
    if not timelines:
        raise ValueError("timelines must hold at least 1 timeline, got none")
    names = list(titles) if titles is not None else [timeline_title(t) for t in timelines]
    if len(names) != len(timelines):
        raise ValueError(f"titles must hold {len(timelines)} titles, got {len(names)}")
    right = end if end is not None else max(t.makespan for t in timelines)
    handles = [
        Patch(color=PALETTE["blue"], label="forward"),
        Patch(color=PALETTE["orange"], label="backward"),
    ]
    if any(t.chunks > 1 for t in timelines):
        handles += [
            Patch(color=PALETTE["sky"], label="forward, 2nd chunk"),
            Patch(color=PALETTE["yellow"], label="backward, 2nd chunk"),
        ]
    handles.append(Patch(color=_IDLE, label="idle (bubble)"))
    columns = min(len(handles), 3)
    # A fixed layout, in inches: constrained layout would measure every label of
    # every figure, which makes a slider of many timelines slow to precompute.
    width, left, right_margin, title, gap, axis = 7.0, 0.8, 0.15, 0.3, 0.1, 0.6
    panels = [0.3 * t.stages + 0.15 for t in timelines]
    legend = 0.28 * math.ceil(len(handles) / columns) + 0.1
    height = sum(panels) + len(panels) * title + (len(panels) - 1) * gap + axis + legend
    with plt.rc_context(STYLE):
        fig = BookFigure(figsize=(width, height))
        top = height
        axes: list[Axes] = []
        for panel in panels:
            top -= title
            box = [left / width, (top - panel) / height, 1 - (left + right_margin) / width]
            axes.append(fig.add_axes([*box, panel / height], sharex=axes[0] if axes else None))
            top -= panel + gap
        plot_width = width - left - right_margin
        # a label fits a box at least ~0.12 inch wide
        label_width = 0.12 * right / plot_width if numbers else None
        for ax, timeline, name in zip(axes, timelines, names, strict=True):
            k = timeline.stages
            ax.barh(range(k), [timeline.makespan] * k, height=_BAR, color=_IDLE, zorder=0)
            _boxes(ax, timeline, label_width)
            ax.set_yticks(range(k), [f"stage {s}" for s in range(k)])
            ax.set_ylim(k - 0.5, -0.5)
            ax.set_xlim(0, right * 1.01)
            # titles start at the figure's left edge, above the stage labels
            ax.set_title(name, fontsize=10, loc="left", x=-(left - 0.1) / plot_width)
            ax.tick_params(axis="y", length=0)
            ax.tick_params(axis="x", labelbottom=ax is axes[-1])
            ax.set_axisbelow(True)  # grid lines behind the boxes
        axes[-1].set_xlabel(xlabel)
        fig.legend(handles=handles, loc="lower center", ncol=columns, bbox_to_anchor=(0.5, 0))
    return fig


def bubble_curves(
    curves: Mapping[int, tuple[Sequence[int], Sequence[float]]],
    marks: Mapping[int, tuple[int, float]] | None = None,
    threshold: float | None = None,
) -> Figure:
    """The bubble against the number of micro-batches, one line per stage count.

    ``curves`` maps a number of stages to ``(micro-batches, bubbles)``; ``marks``
    maps a number of stages to one ``(micro-batches, bubble)`` point to circle;
    ``threshold`` draws a dashed horizontal line at that bubble.
    """
    colours = [PALETTE["blue"], PALETTE["orange"], PALETTE["green"], PALETTE["purple"]]
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig = BookFigure(figsize=(7.0, 3.6), layout="constrained")
        ax = fig.add_subplot()
        for colour, (stages, (ms, bubbles)) in zip(colours, curves.items(), strict=False):
            ax.plot(ms, [100 * b for b in bubbles], color=colour, label=f"{stages} stages")
            if marks and stages in marks:
                m, b = marks[stages]
                ax.plot(m, 100 * b, "o", color=colour, markersize=6)
        if threshold is not None:
            ax.axhline(100 * threshold, color=PALETTE["grey"], linestyle="--", linewidth=1)
            ax.annotate(
                f"{threshold:.0%}",
                (1, 100 * threshold),
                xycoords=("axes fraction", "data"),
                xytext=(-2, 2),
                textcoords="offset points",
                ha="right",
                va="bottom",
                color=PALETTE["grey"],
            )
        ax.set_xscale("log", base=2)
        ticks = [2**i for i in range(max(max(ms) for ms, _ in curves.values()).bit_length())]
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("micro-batches per step (log scale)")
        ax.set_ylabel("bubble (% of the step)")
        ax.set_ylim(0, 100)
        ax.set_title("More micro-batches shrink the bubble; more stages grow it")
        ax.legend(title="dots: micro-batches = 4 x stages" if marks else None)
    return fig
