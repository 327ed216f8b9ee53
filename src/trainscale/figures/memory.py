"""Figures of chapter 2: memory on one GPU, and activations against the batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from trainscale.figures.style import MEMORY_COLOURS, PALETTE, STYLE, new_figure, stacked_bar


def memory_stack(parts_gib: Mapping[str, float], capacity_gib: float, title: str) -> Figure:
    """One horizontal bar of memory parts (GiB) against a GPU's capacity line.

    ``parts_gib`` maps a part name (keys of ``MEMORY_COLOURS``) to GiB. Where the
    parts leave room, the rest of the GPU is drawn hatched as what is left for
    activations; where they do not, the overshoot is labelled.
    """
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 2.3))
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
        fig, ax = new_figure((7.0, 3.4))
        for colour, (name, values) in zip(colours, series_mib.items(), strict=False):
            ax.plot(batches, values, marker="o", color=colour, label=name)
        ax.set_xlabel("batch size (examples)")
        ax.set_ylabel("saved activations (MiB)")
        ax.set_xticks(list(batches))
        ax.set_ylim(bottom=0)
        ax.set_title("What autograd keeps grows linearly with the batch")
        ax.legend()
    return fig


def _capacity_line(ax, capacity_gib: float, bars: int) -> None:
    """The GPU's capacity as a labelled red line across ``bars`` bars."""
    ax.axhline(capacity_gib, color=PALETTE["red"], linewidth=2, zorder=4)
    ax.annotate(
        f"GPU holds {capacity_gib:.1f} GiB",
        (bars - 0.5, capacity_gib),
        xytext=(-2, 4),
        textcoords="offset points",
        color=PALETTE["red"],
        ha="right",
        va="bottom",
        zorder=5,
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1},
    )


def state_bars(
    parts: Mapping[str, Mapping[str, float]],
    title: str,
    *,
    unit: str = "GiB",
    capacity: float | None = None,
) -> Figure:
    """One stacked bar per label: the parts of a GPU's model state, in ``unit``.

    ``parts`` maps a bar's label (a ZeRO stage, a mixed-precision recipe) to its parts
    (keys of ``MEMORY_COLOURS``: weights, gradients, optimiser state), each in ``unit``
    (GiB on a GPU, or bytes per parameter). With ``capacity`` (GiB), a red line marks
    the GPU's and each bar says whether it fits; each bar is labelled with its total
    (the number alone without ``capacity``: the axis names the unit).
    """
    if not parts:
        raise ValueError("parts must name at least one bar, got none")
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((7.0, 3.6))
        labels = list(parts)
        totals = [
            stacked_bar(ax, x, parts[label], MEMORY_COLOURS, labelled=x == 0)
            for x, label in enumerate(labels)
        ]
        top = max([*totals, capacity or 0.0])
        for x, total in enumerate(totals):
            verdict = "" if capacity is None else "\nfits" if total <= capacity else "\ntoo big"
            ax.annotate(
                f"{total:g}" if capacity is None else f"{total:.1f} {unit}{verdict}",
                (x, total),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
            )
        if capacity is not None:
            _capacity_line(ax, capacity, len(labels))
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlim(-0.5, len(labels) - 0.5)
        ax.set_ylim(0, top * 1.25)
        ax.set_ylabel(f"{unit} on each GPU" if capacity is not None else unit)
        ax.set_title(title)
        fig.legend(loc="outside lower center", ncol=3)
    return fig
