"""Every figure of the book, one function each, in one house style.

Each function takes numbers computed elsewhere in the package and returns a
matplotlib ``Figure``; none computes results of its own, so what a figure
shows is what a cell printed. Colours come from the Okabe-Ito palette, which
stays distinguishable for colour-blind readers and in greyscale print.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from trainscale.compute import Phase

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
    "axes.edgecolor": "#333333",
    "axes.grid": True,
    "axes.grid.axis": "x",
    "grid.color": "#dddddd",
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

    def __repr__(self) -> str:
        width, height = self.get_size_inches()
        return f"<BookFigure {width:g}x{height:g} in, {len(self.axes)} Axes>"


def _new(figsize: tuple[float, float]) -> tuple[BookFigure, Axes]:
    """A new figure and its axes; call inside ``plt.rc_context(STYLE)`` so the style applies."""
    fig = BookFigure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def step_timeline(phases: Sequence[Phase], gpus: int, title: str | None = None) -> Figure:
    """One data-parallel training step on ``gpus`` GPUs, one row per GPU.

    Every GPU runs the same ``phases`` (from :func:`trainscale.compute.step_timeline`).
    As in a profiler, each row has two lanes: compute on top and, below it, the
    communication that runs alongside, so overlap with backward is visible.
    """
    with plt.rc_context(STYLE):
        fig, ax = _new((7.0, 1.3 + 0.55 * gpus))
        for gpu in range(gpus):
            for phase in phases:
                is_comm = phase.name == "all-reduce"
                ax.barh(
                    gpu + (0.2 if is_comm else -0.1),
                    phase.end - phase.start,
                    left=phase.start,
                    height=0.22 if is_comm else 0.4,
                    color=PHASE_COLOURS[phase.name],
                    edgecolor="white",
                    linewidth=0.5,
                    label=phase.name if gpu == 0 else None,
                )
        end = max(p.end for p in phases)
        ax.set_yticks(range(gpus), [f"GPU {g}" for g in range(gpus)])
        ax.set_ylim(gpus - 0.5, -0.5)
        ax.set_xlim(0, end * 1.02)
        ax.set_xlabel("time within one step (s)")
        ax.set_title(title or f"One training step on {gpus} GPU{'s' * (gpus > 1)}: {end:.2f} s")
        fig.legend(loc="outside lower center", ncol=len(phases))
    return fig


def flop_bars(counts: Mapping[str, float], title: str) -> Figure:
    """Bars of counted FLOPs (in MFLOP), coloured by the phase that opens each label.

    ``counts`` maps a label such as ``"backward: weight gradient"`` to FLOPs;
    the word before the colon picks the colour, so the eye groups the phases.
    """
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = _new((7.0, 3.2))
        labels = list(counts)
        colours = [PHASE_COLOURS[label.split(":")[0]] for label in labels]
        bars = ax.bar(range(len(labels)), [v / 1e6 for v in counts.values()], color=colours)
        ax.bar_label(bars, fmt="%.1f")
        ax.set_xticks(range(len(labels)), [label.replace(": ", ":\n") for label in labels])
        ax.set_ylabel("MFLOP (counted)")
        ax.set_title(title)
    return fig


MEMORY_COLOURS = {
    "weights": PALETTE["blue"],
    "gradients": PALETTE["orange"],
    "optimiser state": PALETTE["purple"],
    "activations": PALETTE["green"],
}


def memory_stack(parts_gib: Mapping[str, float], capacity_gib: float, title: str) -> Figure:
    """One horizontal bar of memory parts (GiB) against a GPU's capacity line.

    ``parts_gib`` maps a part name (keys of ``MEMORY_COLOURS``) to GiB. Where the
    parts leave room, the rest of the GPU is drawn hatched as what is left for
    activations; where they do not, the overshoot is labelled.
    """
    with plt.rc_context(STYLE):
        fig, ax = _new((7.0, 2.3))
        left = 0.0
        for name, gib in parts_gib.items():
            ax.barh(
                0, gib, left=left, height=0.5, color=MEMORY_COLOURS[name], label=f"{name} {gib:.1f}"
            )
            left += gib
        if left < capacity_gib:
            ax.barh(
                0,
                capacity_gib - left,
                left=left,
                height=0.5,
                color="white",
                edgecolor=PALETTE["grey"],
                hatch="//",
                label=f"free {capacity_gib - left:.1f}",
            )
        ax.axvline(capacity_gib, color=PALETTE["red"], linewidth=2)
        ax.annotate(
            f"GPU holds {capacity_gib:.1f} GiB",
            (capacity_gib, 0.32),
            xytext=(-4, 0),
            textcoords="offset points",
            color=PALETTE["red"],
            ha="right",
            va="bottom",
        )
        verdict = "fits" if left <= capacity_gib else f"over by {left - capacity_gib:.1f} GiB"
        ax.set_xlim(0, max(left, capacity_gib) * 1.05)
        ax.set_ylim(-0.5, 0.75)
        ax.set_yticks([])
        ax.set_xlabel("GiB on one GPU")
        ax.set_title(f"{title}: {left:.1f} GiB, {verdict}")
        fig.legend(loc="outside lower center", ncol=4, title="GiB")
    return fig


def activations_against_batch(
    batches: Sequence[int], series_mib: Mapping[str, Sequence[float]]
) -> Figure:
    """Measured activation memory (MiB) against batch size, one line per series."""
    colours = [PALETTE["blue"], PALETTE["orange"], PALETTE["green"], PALETTE["purple"]]
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig, ax = _new((7.0, 3.4))
        for colour, (name, values) in zip(colours, series_mib.items(), strict=False):
            ax.plot(batches, values, marker="o", color=colour, label=name)
        ax.set_xlabel("batch size (examples)")
        ax.set_ylabel("saved activations (MiB)")
        ax.set_xticks(list(batches))
        ax.set_ylim(bottom=0)
        ax.set_title("What autograd keeps grows linearly with the batch")
        ax.legend()
    return fig
