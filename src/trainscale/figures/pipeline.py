"""Figures of chapter 9: pipeline timelines and the bubble against the number of micro-batches."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, PathPatch
from matplotlib.path import Path

from trainscale.figures.style import MUTED_INK, PALE_GREY, PALETTE, STYLE, BookFigure
from trainscale.pipeline import Timeline

SCHEDULE_NAMES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved": "Interleaved 1F1B",
    "zb-h1": "ZB-H1",
    "zb-v": "ZB-V",
    "dualpipev": "DualPipeV",
}
"""How the figures spell each schedule."""

_FILL = {  # (kind, chunk parity) -> (face colour, opacity, text colour)
    ("forward", 0): (PALETTE["blue"], 1.0, "white"),
    ("backward", 0): (PALETTE["orange"], 1.0, "black"),
    ("forward", 1): (PALETTE["sky"], 1.0, "black"),
    ("backward", 1): (PALETTE["yellow"], 1.0, "black"),
    ("input", 0): (PALETTE["red"], 1.0, "white"),
    ("weight", 0): (PALETTE["green"], 1.0, "white"),
    ("input", 1): (PALETTE["red"], 0.5, "black"),
    ("weight", 1): (PALETTE["green"], 0.5, "black"),
}
_LEGEND = {
    ("forward", 0): "forward",
    ("backward", 0): "backward",
    ("input", 0): "input gradient (B)",
    ("weight", 0): "weight gradient (W)",
    ("forward", 1): "forward, 2nd chunk",
    ("backward", 1): "backward, 2nd chunk",
    ("input", 1): "B, 2nd chunk",
    ("weight", 1): "W, 2nd chunk",
}
_IDLE = PALE_GREY
_BAR = 0.72  # height of a stage's row of boxes


def _opacity(alpha: float) -> dict[str, float]:
    """``alpha`` as a keyword only when it is not opaque, so opaque boxes draw as before."""
    return {"alpha": alpha} if alpha < 1 else {}


def timeline_title(timeline: Timeline) -> str:
    """The default panel title: the schedule, its size, its bubble and its peak memory."""
    name = SCHEDULE_NAMES.get(timeline.schedule, timeline.schedule)
    if timeline.chunks > 1 and timeline.schedule == "interleaved":
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
                    color=_FILL[key][2],
                )
                label.set_in_layout(False)  # inside the axes: no need to lay it out
    for key, polygons in rectangles.items():
        if not polygons:
            continue
        codes = [Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY]
        path = Path([point for polygon in polygons for point in polygon], codes * len(polygons))
        face, opacity, _ = _FILL[key]
        patch = PathPatch(path, facecolor=face, edgecolor="white", linewidth=0.6)
        patch.set(**_opacity(opacity))
        ax.add_patch(patch)


def pipeline_timelines(
    timelines: Sequence[Timeline],
    titles: Sequence[str] | None = None,
    xlabel: str = "time (in forward passes of one micro-batch on one stage)",
    end: float | None = None,
    numbers: bool = True,
) -> Figure:
    """One panel per timeline, stacked on a shared time axis, one row per stage.

    Boxes are forward (blue) and backward (orange) passes, numbered by
    micro-batch, or, for the zero-bubble schedules, the backward's two halves:
    input gradient (red) and weight gradient (green); the grey band behind them is
    idle time, the bubble. With several chunks per device the second chunk is
    drawn in lighter colours. The legend lists the kinds of box drawn. ``end``
    fixes the right end of the time axis (default: the longest timeline), so
    several figures can share one scale. ``numbers=False`` leaves
    the micro-batch numbers out: a lighter figure, for sliders.
    """
    if not timelines:
        raise ValueError("timelines must hold at least 1 timeline, got none")
    names = list(titles) if titles is not None else [timeline_title(t) for t in timelines]
    if len(names) != len(timelines):
        raise ValueError(f"titles must hold {len(timelines)} titles, got {len(names)}")
    right = end if end is not None else max(t.makespan for t in timelines)
    present = {(op.kind, op.chunk % 2) for t in timelines for ops in t.ops for op in ops}
    handles = [
        Patch(color=_FILL[key][0], label=label, **_opacity(_FILL[key][1]))
        for key, label in _LEGEND.items()
        if key in present
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


def schedule_comparison(
    timelines: Sequence[Timeline], source: str, title: str | None = None
) -> Figure:
    """Two bar panels, one bar per timeline: the bubble (% of the step) and the most
    micro-batches' activations any device held at once. ``source`` (required) is
    printed under the panels: where the timelines come from."""
    if not timelines:
        raise ValueError("timelines must hold at least 1 timeline, got none")
    if not source.strip():
        raise ValueError("source must say where the timelines come from, got ''")
    names = [SCHEDULE_NAMES.get(t.schedule, t.schedule) for t in timelines]
    bubbles = [100 * t.bubble for t in timelines]
    held = [max(t.peak_activations, default=0) for t in timelines]
    rows = range(len(timelines))
    colours = [PALETTE["blue"], PALETTE["sky"], PALETTE["red"], PALETTE["green"], PALETTE["purple"]]
    bar_colours = [colours[i % len(colours)] for i in rows]
    with plt.rc_context(STYLE):
        fig = BookFigure(figsize=(7.0, 0.45 * len(timelines) + 1.3), layout="constrained")
        left, right = fig.subplots(1, 2, sharey=True)
        for ax, values, label, fmt in (
            (left, bubbles, "bubble (% of the step)", "{:.0f}%"),
            (right, held, "most micro-batches held", "{:g}"),
        ):
            ax.barh(rows, values, color=bar_colours, height=0.6)
            for row, value in zip(rows, values, strict=True):
                ax.annotate(
                    fmt.format(value),
                    (value, row),
                    xytext=(3, 0),
                    textcoords="offset points",
                    va="center",
                    fontsize=9,
                )
            ax.set_xlabel(label)
            ax.set_xlim(0, max(values, default=1) * 1.25 or 1)
        left.set_yticks(list(rows), names)
        left.invert_yaxis()
        t = timelines[0]
        fig.suptitle(
            title or f"{t.stages} devices, {t.micro_batches} micro-batches: bubble and memory",
            fontweight="bold",
        )
        fig.supxlabel(source, fontsize=7.5, color=MUTED_INK)
    return fig
