"""Figures of chapter 14: where a transformer's FLOPs go, and the cost calculator."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from trainscale.figures.style import LIGHT_GREY, MUTED_INK, PALETTE, STYLE, TABLE_HEADER, new_figure

PART_COLOURS = [PALETTE["blue"], PALETTE["sky"], PALETTE["orange"], PALETTE["purple"]]


def flop_breakdown(parts: Mapping[str, float], counted: float, title: str) -> Figure:
    """Two horizontal bars: the formula's parts stacked (``parts``, in FLOPs),
    and what PyTorch's counter measured (``counted``), in GFLOP."""
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 2.6))
        left = 0.0
        for colour, (name, flops) in zip(PART_COLOURS, parts.items(), strict=False):
            ax.barh(1, flops / 1e9, left=left, height=0.55, color=colour, label=name)
            left += flops / 1e9
        ax.barh(0, counted / 1e9, height=0.55, color=PALETTE["grey"])
        ax.set_yticks([0, 1], ["counted by\nFlopCounterMode", "formula"])
        ax.set_ylim(-0.5, 1.5)
        ax.set_xlim(0, max(left, counted / 1e9) * 1.02)
        ax.set_xlabel("GFLOP for one training step (forward and backward)")
        ax.set_title(title)
        fig.legend(loc="outside lower center", ncol=len(parts))
    return fig


def attention_share(
    contexts: Sequence[int], shares: Mapping[str, Sequence[float]], title: str
) -> Figure:
    """Attention's extra FLOPs as a percentage of ``6N``, against the context length.

    ``shares`` maps a model's label to one share (a fraction) per context.
    """
    colours = [PALETTE["red"], PALETTE["orange"], PALETTE["blue"], PALETTE["green"]]
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig, ax = new_figure((7.0, 3.4))
        for colour, (label, values) in zip(colours, shares.items(), strict=False):
            ax.plot(contexts, [100 * v for v in values], marker="o", color=colour, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(list(contexts), [f"{c:,}" for c in contexts])
        ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g} %"))
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("attention FLOPs / 6N")
        ax.set_title(title)
        ax.legend(title="d_model")
    return fig


def budget_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], title: str, note: str = ""
) -> Figure:
    """A table of already-formatted cells (the cost calculator's page), as a figure,
    with an optional ``note`` (the assumptions behind it) underneath."""
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 0.75 + 0.32 * (len(rows) + 1)))
        ax.axis("off")
        table = ax.table(
            cellText=[list(r) for r in rows],
            colLabels=list(header),
            loc="center",
            cellLoc="right",
            colLoc="right",
        )
        table.auto_set_font_size(False)
        table.set_fontsize(10)
        table.auto_set_column_width(list(range(len(header))))
        table.scale(1.2, 1.4)
        for (row, _), cell in table.get_celld().items():
            cell.set_edgecolor(LIGHT_GREY)
            if row == 0:
                cell.set_text_props(fontweight="bold")
                cell.set_facecolor(TABLE_HEADER)
        ax.set_title(title)
        if note:
            fig.text(0.5, 0.02, note, ha="center", va="bottom", fontsize=9, color=MUTED_INK)
    return fig
