"""Figures of chapter 5: model state per GPU at each ZeRO stage, and one FSDP step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from trainscale.figures.style import (
    EDGE_GREY,
    INK,
    MEMORY_COLOURS,
    PALE_GREY,
    PALETTE,
    PHASE_COLOURS,
    STYLE,
    new_figure,
)
from trainscale.sharding import FsdpMoment


def zero_stage_bars(
    parts_gib: Mapping[str, Mapping[str, float]], capacity_gib: float, title: str
) -> Figure:
    """One stacked bar per ZeRO stage: the model state one GPU holds, in GiB.

    ``parts_gib`` maps a stage's label (``"DDP"``, ``"ZeRO-1"``, ...) to its parts
    (keys of ``MEMORY_COLOURS``: weights, gradients, optimiser state) in GiB. A red
    line marks the GPU's capacity; each bar is labelled with its total.
    """
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((7.0, 3.6))
        stages = list(parts_gib)
        totals = []
        for x, stage in enumerate(stages):
            bottom = 0.0
            for part, gib in parts_gib[stage].items():
                ax.bar(
                    x,
                    gib,
                    bottom=bottom,
                    width=0.6,
                    color=MEMORY_COLOURS[part],
                    label=part if x == 0 else None,
                )
                bottom += gib
            totals.append(bottom)
        top = max([*totals, capacity_gib])
        for x, total in enumerate(totals):
            verdict = "fits" if total <= capacity_gib else "too big"
            ax.annotate(
                f"{total:.1f} GiB\n{verdict}",
                (x, total),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                va="bottom",
            )
        ax.axhline(capacity_gib, color=PALETTE["red"], linewidth=2, zorder=4)
        ax.annotate(
            f"GPU holds {capacity_gib:.1f} GiB",
            (len(stages) - 0.5, capacity_gib),
            xytext=(-2, 4),
            textcoords="offset points",
            color=PALETTE["red"],
            ha="right",
            va="bottom",
            zorder=5,
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1},
        )
        ax.set_xticks(range(len(stages)), stages)
        ax.set_xlim(-0.5, len(stages) - 0.5)
        ax.set_ylim(0, top * 1.25)
        ax.set_ylabel("GiB on each GPU")
        ax.set_title(title)
        fig.legend(loc="outside lower center", ncol=3)
    return fig


_CELL = {
    "sharded": PALE_GREY,
    "prefetched": PALETTE["sky"],
}


def fsdp_timeline(
    moments: Sequence[FsdpMoment],
    layer_names: Sequence[str],
    upto: int | None = None,
    title: str | None = None,
) -> Figure:
    """One FSDP step as a grid: a column per moment, a row per layer.

    A cell is grey while the layer is only a shard on this GPU, coloured while its
    full weights are here: blue for the forward compute, orange for backward, light
    blue for a layer being prefetched. Under the grid, each column lists the
    all-gathers (AG) it issues and the reduce-scatters (RS) that follow it, and
    the count of whole layers. With ``upto``, the moments after it are left blank,
    so a slider can step through the step.
    """
    n_layers = len(layer_names)
    last = len(moments) - 1 if upto is None else upto
    if not 0 <= last < len(moments):
        raise ValueError(f"upto must be between 0 and {len(moments) - 1}, got {upto}")
    with plt.rc_context({**STYLE, "axes.grid": False}):
        fig, ax = new_figure((7.0, 1.9 + 0.42 * n_layers))
        for col, moment in enumerate(moments):
            shown = col <= last
            for row in range(n_layers):
                if not shown:
                    colour = "white"
                elif row == moment.layer:
                    colour = PHASE_COLOURS[moment.phase]
                elif row in moment.whole:
                    colour = _CELL["prefetched"]
                else:
                    colour = _CELL["sharded"]
                ax.add_patch(
                    Rectangle((col, row), 0.92, 0.86, facecolor=colour, edgecolor=EDGE_GREY, lw=0.5)
                )
            if moment.phase == "optimiser" and shown:
                ax.add_patch(
                    Rectangle(
                        (col, 0),
                        0.92,
                        n_layers - 0.14,
                        facecolor=PHASE_COLOURS["optimiser"],
                        alpha=0.35,
                        edgecolor="none",
                    )
                )
            if not shown:
                continue
            notes = [f"AG {i}" for i in moment.all_gathers]
            notes += [f"RS {i}" for i in moment.reduce_scatters]
            ax.text(
                col + 0.46,
                n_layers + 0.15,
                "\n".join(notes),
                ha="center",
                va="top",
                fontsize=8,
                color=INK,
            )
            ax.text(
                col + 0.46,
                -0.2,
                str(len(moment.whole)),
                ha="center",
                va="bottom",
                fontsize=9,
                color=INK,
            )
        if last < len(moments) and last >= 0:
            ax.add_patch(
                Rectangle(
                    (last - 0.04, -0.08),
                    1.0,
                    n_layers + 0.02,
                    fill=False,
                    edgecolor=INK,
                    lw=1.6,
                )
            )
        labels = [
            "step" if m.phase == "optimiser" else f"{m.phase[0].upper()}{m.layer}" for m in moments
        ]
        ax.set_xticks([c + 0.46 for c in range(len(moments))], labels)
        ax.xaxis.tick_top()
        ax.tick_params(axis="x", length=0)
        ax.set_yticks([r + 0.43 for r in range(n_layers)], layer_names)
        ax.tick_params(axis="y", length=0)
        ax.set_xlim(-0.1, len(moments))
        ax.set_ylim(n_layers + 1.1, -0.75)
        for spine in ax.spines.values():
            spine.set_visible(False)
        ax.text(-0.15, -0.2, "whole:", ha="right", va="bottom", fontsize=9)
        ax.text(-0.15, n_layers + 0.15, "comm:", ha="right", va="top", fontsize=9)
        ax.set_title(title or "One FSDP step, moment by moment (F = forward, B = backward)", pad=24)
        handles = [
            Rectangle((0, 0), 1, 1, facecolor=PHASE_COLOURS["forward"], label="whole: forward"),
            Rectangle((0, 0), 1, 1, facecolor=PHASE_COLOURS["backward"], label="whole: backward"),
            Rectangle((0, 0), 1, 1, facecolor=_CELL["prefetched"], label="whole: prefetched"),
            Rectangle(
                (0, 0), 1, 1, facecolor=_CELL["sharded"], edgecolor=EDGE_GREY, label="shard only"
            ),
            Rectangle(
                (0, 0),
                1,
                1,
                facecolor=PHASE_COLOURS["optimiser"],
                alpha=0.35,
                label="update own shards",
            ),
        ]
        fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8)
    return fig
