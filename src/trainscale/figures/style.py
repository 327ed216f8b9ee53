"""The house style every figure of the book shares, and how figures display.

Colours come from the Okabe-Ito palette, which stays distinguishable for
colour-blind readers and in greyscale print.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Mapping

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

PALETTE = {
    "blue": "#0072B2",
    "orange": "#E69F00",
    "green": "#009E73",
    "red": "#D55E00",
    "purple": "#CC79A7",
    "sky": "#56B4E9",
    "yellow": "#F0E442",
    "grey": "#999999",
}
"""Okabe-Ito colours by name."""

INK = "#333333"
"""Dark grey: axes frames, reference lines, labels inside cells, data summed over every rank."""

MUTED_INK = "#555555"
"""Mid grey: notes, thin arrows and outlines, annotations that must not compete with data."""

LIGHT_GREY = "#dddddd"
"""Grid lines, table rules and light fills."""

PALE_GREY = "#eeeeee"
"""Idle time and empty (sharded-away) cells."""

EDGE_GREY = "#cccccc"
"""Thin edges between cells."""

TABLE_HEADER = "#f2f2f2"
"""The header row of a table."""

PARTIAL_GREY = "#b8b8b8"
"""Data summed over some ranks but not yet all."""

PHASE_COLOURS = {
    "forward": PALETTE["blue"],
    "backward": PALETTE["orange"],
    "all-reduce": PALETTE["green"],
    "optimiser": PALETTE["purple"],
}

STYLE = {
    "figure.figsize": (7.0, 3.2),
    "figure.dpi": 100,
    "figure.facecolor": "white",
    "axes.facecolor": "white",
    "axes.edgecolor": INK,
    "axes.grid": True,
    "axes.grid.axis": "x",
    "grid.color": LIGHT_GREY,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 12,
    "axes.titleweight": "bold",
    "axes.labelsize": 11,
    "font.size": 10,
    "legend.frameon": False,
}
"""The house style: white background, light grid, no top or right frame."""


SVG_SETTINGS = {"svg.fonttype": "none", "svg.hashsalt": "trainscale"}
"""Text stays text (small, searchable) and element ids do not change between runs."""


def svg_text(fig: Figure) -> str:
    """``fig`` as an SVG document, byte-identical from run to run (no date, fixed ids)."""
    buffer = io.StringIO()
    with plt.rc_context(SVG_SETTINGS):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    return buffer.getvalue()


class BookFigure(Figure):
    """A matplotlib ``Figure`` that shows itself as SVG wherever a cell returns it.

    It lives outside pyplot's registry, so it is displayed once (pyplot would
    also show every figure it knows at the end of a cell) and needs no closing;
    and it does not depend on which matplotlib backend the kernel runs.
    """

    def _repr_svg_(self) -> str:
        return svg_text(self)

    def measured(self):
        """This figure as a PNG image, for figures of *measured* data.

        A measured figure differs from run to run, and nbval compares SVG
        outputs byte for byte but skips PNG; make ``fig.measured()`` the
        cell's last expression instead of ``fig``.
        """
        from IPython.display import Image

        buffer = io.BytesIO()
        self.savefig(buffer, format="png", dpi=150)
        return Image(buffer.getvalue(), width=int(self.get_size_inches()[0] * 96))

    def __repr__(self) -> str:
        width, height = self.get_size_inches()
        return f"<BookFigure {width:g}x{height:g} in, {len(self.axes)} Axes>"


def new_figure(figsize: tuple[float, float]) -> tuple[BookFigure, Axes]:
    """A new figure and its axes; call inside ``plt.rc_context(STYLE)`` so the style applies."""
    fig = BookFigure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


MEMORY_COLOURS = {
    "weights": PALETTE["blue"],
    "gradients": PALETTE["orange"],
    "optimiser state": PALETTE["purple"],
    "activations": PALETTE["green"],
}
"""One colour per part of a GPU's memory, the same in every chapter."""

TIME_COLOURS = {
    "compute": PALETTE["blue"],
    "recomputation": PALETTE["sky"],
    "tensor-parallel traffic": PALETTE["orange"],
    "context-parallel traffic": PALETTE["red"],
    "expert-parallel traffic": PALETTE["purple"],
    "pipeline sends": PALETTE["yellow"],
    "data-parallel traffic": PALETTE["green"],
    "optimiser step": MUTED_INK,
    "pipeline bubble": PALETTE["grey"],
}
"""One colour per part of an estimated step time (the planner's ``TIME_PARTS``)."""

VERDICT_STYLES = {
    "fits": (PALETTE["green"], "o"),
    "TP across nodes": (PALETTE["orange"], "s"),
    "bubble too large": (PALETTE["purple"], "^"),
    "out of memory": (PALETTE["grey"], "x"),
}
"""Colour and marker of each planner verdict that has an estimate to draw."""

RANK_COLOURS = [
    PALETTE["blue"],
    PALETTE["orange"],
    PALETTE["green"],
    PALETTE["purple"],
    PALETTE["sky"],
    PALETTE["yellow"],
    PALETTE["red"],
    PALETTE["grey"],
]
"""One colour per rank (up to 8), for data that came from that rank alone."""


def source_note(fig: Figure, source: str, *, left: bool = False) -> None:
    """Where a figure's numbers come from, in small grey type under its axes, kept in the
    layout (``supxlabel``: constrained layout makes room for it below the x-label).
    ``left`` wraps a long note to the figure's width and aligns it left."""
    if not source.strip():
        raise ValueError("source must say where the figure's numbers come from, got ''")
    if left:
        text = textwrap.fill(source, width=int(fig.get_size_inches()[0] * 17))
        fig.supxlabel(text, x=0.01, ha="left", fontsize=7, color=MUTED_INK)
    else:
        fig.supxlabel(source, fontsize=7.5, color=MUTED_INK)


def stacked_bar(
    ax: Axes,
    position: float,
    parts: Mapping[str, float],
    colours: Mapping[str, str],
    *,
    labelled: bool,
    horizontal: bool = False,
) -> float:
    """One bar of ``parts`` (each a size in the axis's unit) stacked in their order at
    ``position``, each coloured from ``colours``, 0.6 thick; ``labelled``: the parts name
    themselves in the legend (one bar of a chart should). Returns the bar's total."""
    end = 0.0
    for part, size in parts.items():
        style = {"color": colours[part], "label": part if labelled else None}
        if horizontal:
            ax.barh(position, size, left=end, height=0.6, **style)
        else:
            ax.bar(position, size, bottom=end, width=0.6, **style)
        end += size
    return end
