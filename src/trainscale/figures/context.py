"""Chapter 10's figures: the ring's steps, attention work per rank, traffic against length."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from trainscale.figures.style import (
    INK,
    MUTED_INK,
    PALE_GREY,
    PALETTE,
    STYLE,
    BookFigure,
    new_figure,
    source_note,
)

WORK_COLOURS = {1.0: PALETTE["blue"], 0.5: PALETTE["sky"], 0.0: PALE_GREY}
"""A block of work by its share: whole (dark), half (light), skipped (grey)."""

LAYOUT_COLOURS = {"contiguous": PALETTE["orange"], "zigzag": PALETTE["blue"]}
"""One colour per way of dealing out the sequence."""

SCHEME_COLOURS = {
    "ring attention": PALETTE["blue"],
    "all-to-all (Ulysses)": PALETTE["green"],
    "tensor parallelism": PALETTE["orange"],
}
"""One colour per way of splitting attention's work."""


def ring_attention_steps(
    schedule: Sequence[Sequence[tuple[int, float]]], title: str, source: str
) -> Figure:
    """One row per rank, one column per ring step: whose keys it holds and how much it computes.

    ``schedule[rank][step] = (source rank, blocks)`` as
    :func:`trainscale.context.ring_schedule` returns it; ``blocks`` is ``1``
    (whole), ``0.5`` (half) or ``0`` (skipped). The row total is printed at the right.
    """
    shares = {blocks for steps in schedule for _, blocks in steps}
    if not schedule or not shares <= set(WORK_COLOURS):
        raise ValueError(f"schedule blocks must be among {tuple(WORK_COLOURS)}, got {shares}")
    n = len(schedule)
    with plt.rc_context({**STYLE, "axes.grid": False}):
        # At least 6.4 in wide: the title spans the figure, the legend at the right included.
        fig, ax = new_figure((max(6.4, 2.6 + 0.95 * n), 1.3 + 0.5 * n))
        for rank, steps in enumerate(schedule):
            for step, (sender, blocks) in enumerate(steps):
                ax.add_patch(
                    Rectangle(
                        (step, rank), 0.94, 0.9, facecolor=WORK_COLOURS[blocks], edgecolor="white"
                    )
                )
                colour = "white" if blocks == 1.0 else INK
                ax.text(
                    step + 0.47,
                    rank + 0.45,
                    f"K/V {sender}",
                    ha="center",
                    va="center",
                    fontsize=8.5,
                    color=colour,
                )
            total = sum(blocks for _, blocks in steps)
            ax.text(n + 0.1, rank + 0.45, f"{total:g}", va="center", fontsize=9, color=INK)
        ax.set_xlim(0, n + 0.6)
        ax.set_ylim(n, 0)
        ax.set_xticks([s + 0.47 for s in range(n)], [str(s) for s in range(n)])
        ax.set_yticks([r + 0.45 for r in range(n)], [f"rank {r}" for r in range(n)])
        ax.set_xlabel("ring step (blocks of work at the right)")
        ax.tick_params(length=0)
        for side in ("left", "bottom"):
            ax.spines[side].set_visible(False)
        fig.suptitle(title, fontweight="bold")
        labels = {1.0: "whole block", 0.5: "half a block", 0.0: "skipped (masked)"}
        handles = [Patch(facecolor=WORK_COLOURS[b], label=labels[b]) for b in sorted(shares)[::-1]]
        fig.legend(handles=handles, loc="outside right center", fontsize=8)
        source_note(fig, source)
    return fig


def attention_work_per_rank(
    work: Mapping[str, Sequence[float]],
    title: str,
    source: str,
    ylabel: str = "attention work (blocks)",
    note: str | None = None,
) -> Figure:
    """Grouped bars: each rank's attention work, one bar per layout (``contiguous``, ``zigzag``).

    A dashed line marks the mean: the work every rank would do if it were even.
    """
    unknown = sorted(set(work) - set(LAYOUT_COLOURS))
    lengths = {len(v) for v in work.values()}
    if not work or unknown or len(lengths) != 1:
        raise ValueError(
            f"work must map layouts among {tuple(LAYOUT_COLOURS)} to equally long lists,"
            f" got {sorted(work)}"
        )
    n = lengths.pop()
    width = 0.8 / len(work)
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((6.4, 3.2))
        for i, (layout, values) in enumerate(work.items()):
            offsets = [r - 0.4 + width * (i + 0.5) for r in range(n)]
            ax.bar(offsets, values, width=width * 0.92, color=LAYOUT_COLOURS[layout], label=layout)
        first = next(iter(work.values()))
        ax.axhline(sum(first) / n, color=MUTED_INK, linestyle="--", linewidth=1, label="mean")
        ax.set_xticks(range(n), [str(r) for r in range(n)] if n <= 16 else [""] * n)
        ax.set_xlabel("rank")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(loc="upper left", fontsize=8)
        if note:
            ax.set_ylim(0, max(max(v) for v in work.values()) * 1.5)
            ax.text(
                0.99,
                0.97,
                note,
                transform=ax.transAxes,
                ha="right",
                va="top",
                fontsize=8,
                color=INK,
                bbox={"facecolor": "white", "edgecolor": PALE_GREY},
            )
        source_note(fig, source)
    return fig


def context_traffic_against_sequence(
    seq_lens: Sequence[int],
    bytes_sent: Mapping[str, Sequence[float]],
    comm_to_compute: Mapping[str, Sequence[float]],
    title: str,
    source: str,
) -> Figure:
    """Two panels against the sequence length: bytes each rank sends per layer (left) and the
    communication time over the compute it could hide under (right, 1 = break-even).

    Keys of both mappings name schemes in :data:`SCHEME_COLOURS`.
    """
    for name, table in (("bytes_sent", bytes_sent), ("comm_to_compute", comm_to_compute)):
        unknown = sorted(set(table) - set(SCHEME_COLOURS))
        if unknown or any(len(v) != len(seq_lens) for v in table.values()):
            raise ValueError(
                f"{name} must map schemes among {tuple(SCHEME_COLOURS)} to one value per"
                f" sequence length, got {sorted(table)}"
            )
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig = BookFigure(figsize=(7.4, 3.4), layout="constrained")
        left, right = fig.subplots(1, 2)
        for name, values in bytes_sent.items():
            left.plot(
                seq_lens,
                [v / 2**20 for v in values],
                marker="o",
                markersize=3,
                color=SCHEME_COLOURS[name],
                label=name,
            )
        for name, values in comm_to_compute.items():
            right.plot(
                seq_lens, values, marker="o", markersize=3, color=SCHEME_COLOURS[name], label=name
            )
        right.axhline(1.0, color=INK, linewidth=1, linestyle="--")
        right.text(seq_lens[0], 1.08, "communication = compute", fontsize=8, color=INK)
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length (tokens)")
        left.set_ylabel("MiB sent per rank and layer")
        right.set_ylabel("communication / compute")
        left.legend(fontsize=8, loc="upper left")
        fig.suptitle(title, fontweight="bold")
        source_note(fig, source)
    return fig
