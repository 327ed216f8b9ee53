"""Chapter 17's device mesh, drawn: every rank as a box, grouped by pipeline stage and
data-parallel index, with one rank's groups outlined.

The groups come from :func:`trainscale.workers.mesh_exercise.reference_groups`, the
chapter's exercise reference, which its tests check against torch's
``init_device_mesh``; this module only places them on the page.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from trainscale import _checks
from trainscale.figures.style import (
    INK,
    LIGHT_GREY,
    MUTED_INK,
    PALE_GREY,
    PALETTE,
    STYLE,
    new_figure,
)
from trainscale.workers.mesh_exercise import DIMS, describe, reference_groups

MAX_RANKS = 64
"""The most ranks the figure draws legibly (a box of about a centimetre each)."""

OUTLINED = {
    "tp": (PALETTE["orange"], 0.06, "TP"),
    "cp": (PALETTE["red"], 0.11, "CP"),
    "dp": (PALETTE["green"], 0.16, "DP"),
    "pp": (PALETTE["blue"], 0.21, "PP"),
}
"""The groups outlined around the highlighted rank: colour (the step-time colours of
each kind of traffic), how far outside a rank's box the outline runs (box widths), and
the name in the legend. ``dp`` is ``dp_replicate x dp_shard`` together; ``cp`` is
outlined only where it has more than one rank."""

BOX = 0.8
"""A rank's box, in grid cells (the rest of the cell is the gap to its neighbours)."""

DP_GAP = 0.6
"""Extra room between two data-parallel indices of one row, in grid cells."""

STAGE_GAP = 0.7
"""Extra room between two pipeline stages, in grid cells."""

SOURCE = (
    "Groups: trainscale.workers.mesh_exercise.reference_groups (row-major over pp,"
    " dp_replicate, dp_shard, cp, tp), checked against torch's init_device_mesh."
)
"""Where the figure's groups come from."""


def _check(sizes: Sequence[int], highlight_rank: int) -> tuple[tuple[int, ...], int]:
    """``sizes`` (one whole number >= 1 per name of ``DIMS``, at most ``MAX_RANKS`` ranks)
    and ``highlight_rank`` (a rank of that mesh), checked."""
    if isinstance(sizes, str | bytes) or not isinstance(sizes, Sequence) or len(sizes) != 5:
        raise ValueError(f"sizes must hold 5 sizes, one per {DIMS}, got {sizes!r}")
    shape = tuple(
        _checks.count(f"sizes[{name!r}]", s, minimum=1) for name, s in zip(DIMS, sizes, strict=True)
    )
    world = math.prod(shape)
    if world > MAX_RANKS:
        raise ValueError(f"sizes must make at most {MAX_RANKS} ranks to draw, got {world}")
    rank = _checks.count("highlight_rank", highlight_rank)
    if rank >= world:
        raise ValueError(f"highlight_rank must be in 0 .. {world - 1}, got {highlight_rank}")
    return shape, rank


def _coordinates(shape: Sequence[int], rank: int) -> tuple[int, ...]:
    """``rank``'s mesh coordinates, row-major (the last dimension varies fastest)."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    return tuple(rank // stride % size for stride, size in zip(strides, shape, strict=True))


def _positions(sizes: Sequence[int]) -> dict[int, tuple[float, float]]:
    """Where :func:`device_mesh` draws each rank: the bottom-left corner of its box, in
    grid cells (x to the right, y down). Rows are pipeline stages, each ``cp`` rows tall;
    columns are data-parallel indices (``dp_replicate`` outer, ``dp_shard`` inner), each
    ``tp`` columns wide."""
    shape, _ = _check(sizes, 0)
    _, _, shard, cp, tp = shape
    positions = {}
    for rank in range(math.prod(shape)):
        p, r, s, c, t = _coordinates(shape, rank)
        dp_index = r * shard + s
        x = dp_index * (tp + DP_GAP) + t
        y = p * (cp + STAGE_GAP) + c
        positions[rank] = (float(x), float(y))
    return positions


def device_mesh(sizes: Sequence[int], highlight_rank: int, *, source: str = SOURCE) -> Figure:
    """The device mesh of shape ``sizes`` (in the order of ``DIMS``, as
    ``trainscale.train.Layout.sizes``) as a grid of rank boxes with their global rank
    numbers: one grey band per pipeline stage, one box per data-parallel index inside it,
    so that a row of neighbours is a tensor-parallel group and the same place in another
    box of the band is a data-parallel partner. ``highlight_rank``'s groups
    (``reference_groups``) are outlined, one colour each, and named in the legend."""
    shape, rank = _check(sizes, highlight_rank)
    if not source.strip():
        raise ValueError("source must say where the figure's groups come from, got ''")
    pp, rep, shard, cp, tp = shape
    dp = rep * shard
    groups = reference_groups(list(shape), rank)
    positions = _positions(shape)
    width = dp * tp + (dp - 1) * DP_GAP
    height = pp * cp + (pp - 1) * STAGE_GAP
    plain = {**STYLE, "axes.grid": False, "axes.spines.left": False, "axes.spines.bottom": False}
    with plt.rc_context(plain):
        span_x, span_y = width + 2.0, height + 0.95  # the axes' limits below
        axes_height = min(6.6 * span_y / span_x, 0.7 * span_y)  # inches, at most 0.7 a cell
        fig, ax = new_figure((7.0, axes_height + 1.5))
        inset = (1 - BOX) / 2
        for p in range(pp):  # one band per pipeline stage
            y = p * (cp + STAGE_GAP)
            band = Rectangle((-0.35, y - 0.1), width + 0.7, cp + 0.2, fc=PALE_GREY, ec="none")
            ax.add_patch(band)
            ax.text(-0.45, y + cp / 2, f"stage {p}", ha="right", va="center", color=INK)
            for d in range(dp):  # one box per data-parallel index in the band
                x = d * (tp + DP_GAP)
                ax.add_patch(
                    Rectangle((x - 0.04, y), tp + 0.08, cp, fc="white", ec=MUTED_INK, lw=0.8)
                )
                if p == 0:
                    r, s = divmod(d, shard)
                    name = f"dp {d}" if rep == 1 or shard == 1 else f"dp {d} ({r}, {s})"
                    ax.text(x + tp / 2, -0.3, name, ha="center", va="bottom", color=MUTED_INK)
        for r, (x, y) in positions.items():
            box = Rectangle((x + inset, y + inset), BOX, BOX, fc="white", ec=LIGHT_GREY, lw=0.8)
            box.set_gid(f"rank-{r}")
            ax.add_patch(box)
            weight = "bold" if r == rank else "normal"
            ax.text(x + 0.5, y + 0.5, str(r), ha="center", va="center", weight=weight)
        handles = []
        for name, (colour, pad, label) in OUTLINED.items():
            members = groups[name]
            if name == "cp" and len(members) == 1:
                continue
            for member in members:
                x, y = positions[member]
                ring = Rectangle(
                    (x + inset - pad, y + inset - pad),
                    BOX + 2 * pad,
                    BOX + 2 * pad,
                    fc="none",
                    ec=colour,
                    lw=2.0,
                )
                ring.set_gid(f"{name}-{member}")
                ax.add_patch(ring)
            ranks = ", ".join(str(m) for m in members)
            handles.append(
                Patch(fc="none", ec=colour, lw=2.0, label=f"rank {rank}'s {label} group: {ranks}")
            )
        ax.set_xlim(-1.6, width + 0.4)
        ax.set_ylim(height + 0.2, -0.75)  # y down: stage 0 on top
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"The device mesh of {describe(shape)}: rank {rank}'s groups")
        ax.legend(
            handles=handles,
            loc="upper center",
            bbox_to_anchor=(0.5, 0.0),
            ncols=2,
            fontsize=9,
            handlelength=1.2,
        )
        fig.supxlabel(textwrap.fill(source, width=120), fontsize=7, color=MUTED_INK)
    return fig
