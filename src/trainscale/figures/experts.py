"""Figures of chapter 11: how many tokens each expert gets, and the all-to-all between ranks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from trainscale.figures.style import (
    INK,
    MUTED_INK,
    PALE_GREY,
    PALETTE,
    RANK_COLOURS,
    STYLE,
    new_figure,
    source_note,
)

DROPPED_COLOUR = PALETTE["red"]
"""Assignments beyond an expert's capacity."""

BYTES_MAP = LinearSegmentedColormap.from_list("bytes", ["white", PALETTE["blue"]])
"""White (nothing sent) to blue (the most any pair of ranks exchanges)."""


def _check_loads(loads: Mapping[str, Sequence[int]]) -> int:
    """The number of experts, the same in every series of ``loads``."""
    if not loads:
        raise ValueError("loads must hold at least one series, got none")
    lengths = {len(series) for series in loads.values()}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"loads must give every series the same experts, got lengths {lengths}")
    if any(v < 0 for series in loads.values() for v in series):
        raise ValueError("loads must be counts >= 0")
    return lengths.pop()


def expert_loads(
    loads: Mapping[str, Sequence[int]],
    *,
    title: str,
    source: str,
    capacity: int | None = None,
    even: float | None = None,
    top: float | None = None,
) -> Figure:
    """Tokens routed to each expert, one bar per expert and series, side by side.

    ``loads`` maps a label ("before balancing") to one count per expert. With
    ``capacity``, a dashed line marks it and the part of each bar above it, the
    dropped assignments, is drawn hatched in red; ``even`` draws a dotted line at
    the even share. ``top`` fixes the y-axis (so the figures of a slider compare).
    """
    n_experts = _check_loads(loads)
    series = list(loads.items())
    width = 0.8 / len(series)
    colours = [PALETTE["grey"], PALETTE["blue"], PALETTE["orange"], PALETTE["green"]]
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((7.0, 3.4))
        ax.set_axisbelow(True)
        for i, (label, counts) in enumerate(series):
            xs = [e - 0.4 + width * (i + 0.5) for e in range(n_experts)]
            kept = [min(c, capacity) if capacity is not None else c for c in counts]
            colour = colours[i % len(colours)] if len(series) > 1 else PALETTE["blue"]
            ax.bar(xs, kept, width=width * 0.92, color=colour, label=label)
            if capacity is not None:
                over = [max(0, c - capacity) for c in counts]
                ax.bar(
                    xs, over, bottom=kept, width=width * 0.92, color="white",
                    edgecolor=DROPPED_COLOUR, hatch="///", linewidth=0.8,
                )  # fmt: skip
        handles, _ = ax.get_legend_handles_labels()
        if capacity is not None:
            ax.axhline(capacity, color=INK, linestyle="--", linewidth=1.2)
            ax.annotate(
                f"capacity {capacity}", (n_experts - 0.5, capacity), xytext=(0, 3),
                textcoords="offset points", ha="right", va="bottom", fontsize=9, color=INK,
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1},
            )  # fmt: skip
            handles.append(
                Patch(facecolor="white", edgecolor=DROPPED_COLOUR, hatch="///", label="dropped")
            )
        if even is not None:
            handles.append(
                ax.axhline(
                    even, color=MUTED_INK, linestyle=":", linewidth=1.2,
                    label=f"even share ({even:g})",
                )
            )  # fmt: skip
        ax.set_xticks(range(n_experts), [str(e) for e in range(n_experts)])
        ax.set_xlabel("expert")
        ax.set_ylabel("tokens routed to it")
        if top is not None:
            ax.set_ylim(0, top)
        ax.set_title(title, loc="left")
        if len(handles) > 1:
            ax.legend(handles=handles, loc="upper right", fontsize=8)
        source_note(fig, source, left=True)
    return fig


def all_to_all_matrix(
    matrix: Sequence[Sequence[float]], *, title: str, source: str, unit: str = "bytes"
) -> Figure:
    """What each rank sends to each other rank in one all-to-all, as a grid.

    ``matrix[i][j]`` is what rank ``i`` (a row) sends to rank ``j`` (a column), in
    ``unit``; each cell is shaded by its value and labelled with it. The diagonal
    stays on its rank, so it is drawn grey and not counted as traffic.
    """
    n = len(matrix)
    if n == 0 or any(len(row) != n for row in matrix):
        raise ValueError(f"matrix must be square with at least one rank, got {n} rows")
    if any(v < 0 for row in matrix for v in row):
        raise ValueError("matrix must hold amounts >= 0")
    largest = max((matrix[i][j] for i in range(n) for j in range(n) if i != j), default=0)
    with plt.rc_context({**STYLE, "axes.grid": False}):
        fig, ax = new_figure((5.4, 4.4))
        for i in range(n):
            for j in range(n):
                value = matrix[i][j]
                share = value / largest if largest else 0.0
                colour = PALE_GREY if i == j else BYTES_MAP(share)
                ax.add_patch(Rectangle((j, i), 1, 1, facecolor=colour, edgecolor="white", lw=2))
                text_colour = "white" if i != j and share > 0.6 else INK
                ax.text(
                    j + 0.5, i + 0.5, f"{value:,.0f}", ha="center", va="center", fontsize=9,
                    color=text_colour, style="italic" if i == j else "normal",
                )  # fmt: skip
        ax.set_xlim(0, n)
        ax.set_ylim(n, 0)
        ticks = [k + 0.5 for k in range(n)]
        ax.set_xticks(ticks, [f"rank {k}" for k in range(n)])
        ax.set_yticks(ticks, [f"rank {k}" for k in range(n)])
        for k, label in enumerate(ax.get_yticklabels()):
            label.set_color(RANK_COLOURS[k % len(RANK_COLOURS)])
        ax.xaxis.tick_top()
        ax.set_xlabel(f"receives ({unit}; grey: stays on the rank)")
        ax.xaxis.set_label_position("top")
        ax.set_ylabel("sends")
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.set_title(title, loc="left")
        source_note(fig, source, left=True)
    return fig
