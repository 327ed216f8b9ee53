"""Figures of the hardware primer: what is in a node, a GEMM's tiles in waves, the
roofline, and a GEMM's share of peak against its size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

from trainscale.figures.style import (
    INK,
    LIGHT_GREY,
    MUTED_INK,
    PALE_GREY,
    PALETTE,
    RANK_COLOURS,
    STYLE,
    new_figure,
    source_note,
)

NVLINK_COLOUR = PALETTE["blue"]
"""NVLink and NVSwitch: the links inside a node."""

NETWORK_COLOUR = PALETTE["orange"]
"""The network cards and the links between nodes."""


def _box(ax: Axes, x: float, y: float, w: float, h: float, text: str, colour: str, **kw) -> None:
    """A rounded box with its bottom-left corner at ``(x, y)`` and centred text."""
    ax.add_patch(
        FancyBboxPatch(
            (x, y),
            w,
            h,
            boxstyle="round,pad=0.02,rounding_size=0.08",
            facecolor=colour,
            edgecolor=INK,
            linewidth=0.8,
        )
    )
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", **kw)


def _plain_axes() -> dict:
    return {**STYLE, "axes.grid": False, "axes.spines.left": False, "axes.spines.bottom": False}


def node_diagram(
    gpu: str,
    gpus: int,
    nvlink_bandwidth: float,
    nic_bandwidth: float,
    memory_bandwidth: float,
    source: str,
) -> Figure:
    """One node: ``gpus`` GPUs, each with its memory (``memory_bandwidth`` B/s), joined
    all to all by NVSwitch (``nvlink_bandwidth`` B/s each way per GPU), one network card
    per GPU (``nic_bandwidth`` B/s each way), and the host beside them."""
    if gpus < 1:
        raise ValueError(f"gpus must be at least 1, got {gpus}")
    width = 1.0
    with plt.rc_context(_plain_axes()):
        fig, ax = new_figure((7.0, 3.9))
        ax.set_xlim(-0.1, gpus + 2.3)
        ax.set_ylim(-0.35, 5.1)
        ax.set_xticks([])
        ax.set_yticks([])
        switch_y, gpu_y, nic_y = 4.2, 2.55, 1.2
        _box(ax, 0.05, switch_y, gpus - 0.1, 0.5, "NVSwitch", NVLINK_COLOUR, color="white")
        for i in range(gpus):
            x = i * width + 0.1
            ax.plot([x + 0.4, x + 0.4], [gpu_y + 1.0, switch_y], color=NVLINK_COLOUR, lw=2.5)
            ax.plot([x + 0.4, x + 0.4], [nic_y + 0.5, gpu_y], color=MUTED_INK, lw=1.2)
            ax.annotate(
                "",
                (x + 0.4, 0.15),
                (x + 0.4, nic_y),
                arrowprops={"arrowstyle": "<->", "color": NETWORK_COLOUR, "lw": 1.5},
            )
            _box(ax, x, gpu_y, 0.8, 1.0, f"GPU\n{i}", PALE_GREY, fontsize=9)
            _box(ax, x, nic_y, 0.8, 0.5, "NIC", NETWORK_COLOUR, fontsize=8)
        host_x = gpus + 0.3
        _box(
            ax,
            host_x,
            nic_y,
            1.9,
            gpu_y + 1.0 - nic_y,
            "host:\nCPUs,\nmain memory,\nPCIe switches\nto GPUs\nand NICs",
            LIGHT_GREY,
            fontsize=8,
        )
        ax.text(
            gpus / 2,
            switch_y + 0.72,
            f"NVLink: {nvlink_bandwidth / 1e9:,.0f} GB/s each way per GPU, to any other GPU",
            ha="center",
            va="bottom",
            color=NVLINK_COLOUR,
        )
        ax.text(
            gpus / 2,
            -0.05,
            f"to the other nodes: {nic_bandwidth / 1e9:,.0f} GB/s each way per GPU"
            f" ({nic_bandwidth * 8 / 1e9:,.0f} Gb/s)",
            ha="center",
            va="top",
            color=NETWORK_COLOUR,
        )
        ax.text(
            host_x + 0.95,
            nic_y - 0.15,
            f"each GPU's own\nmemory (HBM):\n{memory_bandwidth / 1e12:,.2f} TB/s",
            ha="center",
            va="top",
            fontsize=8,
            color=MUTED_INK,
        )
        ax.text(0.55, (nic_y + 0.5 + gpu_y) / 2, "PCIe", fontsize=7, color=MUTED_INK, va="center")
        ax.set_title(f"One node of {gpus} {gpu}")
        source_note(fig, source)
    return fig


def gemm_tile_waves(
    tile_rows: int, tile_cols: int, multiprocessors: int, title: str, source: str
) -> Figure:
    """A GEMM's output as a grid of ``tile_rows x tile_cols`` tiles (each drawn as tall as
    it has rows, 256 for 128 columns), coloured by the wave that computes it when
    ``multiprocessors`` SMs take one tile each, in launch order (row by row)."""
    if min(tile_rows, tile_cols, multiprocessors) < 1:
        raise ValueError("tile_rows, tile_cols and multiprocessors must be at least 1")
    tiles = tile_rows * tile_cols
    waves = -(-tiles // multiprocessors)
    colours = [RANK_COLOURS[w % len(RANK_COLOURS)] for w in range(waves)]
    with plt.rc_context(_plain_axes()):
        fig, ax = new_figure((7.0, 4.2))
        for index in range(tiles):
            row, col = divmod(index, tile_cols)
            ax.add_patch(
                Rectangle(
                    (col, -2 * (row + 1)),
                    1,
                    2,
                    facecolor=colours[index // multiprocessors],
                    edgecolor="white",
                    linewidth=0.6,
                )
            )
        ax.set_xlim(0, tile_cols)
        ax.set_ylim(-2 * tile_rows, 0)
        ax.set_aspect("equal")
        ax.set_xticks([])
        ax.set_yticks([])
        handles = []
        for w in range(waves):
            busy = min(multiprocessors, tiles - w * multiprocessors)
            idle = f", {multiprocessors - busy} idle" if busy < multiprocessors else ""
            label = f"wave {w + 1}: {busy} tiles on {multiprocessors} SMs{idle}"
            handles.append(Patch(color=colours[w], label=label))
        fig.legend(handles=handles, loc="outside right center")
        fig.suptitle(title, fontweight="bold", fontsize=12)
        source_note(fig, source)
    return fig


def roofline(
    roofs: Mapping[str, tuple[float, float]],
    points: Mapping[str, tuple[float, float]],
    title: str,
    source: str,
    unit: tuple[float, str] = (1e12, "TFLOP/s"),
) -> Figure:
    """Log-log roofline: attainable FLOP/s against arithmetic intensity (FLOP/B).

    ``roofs`` maps a machine's name to ``(peak FLOP/s, bandwidth B/s)``, each drawn as
    the lower of its two roofs, its balance point marked; ``points`` maps a kernel's name
    to ``(intensity, FLOP/s)``. ``unit`` is ``(FLOP/s per unit, its name)``."""
    if not roofs:
        raise ValueError("roofs must name at least one machine")
    scale, name = unit
    balances = [peak / bw for peak, bw in roofs.values()]
    xs = [x for x, _ in points.values()] + balances
    low, high = min(xs) / 4, max(xs) * 4
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig, ax = new_figure((7.0, 4.0))
        for i, (machine, (peak, bw)) in enumerate(roofs.items()):
            colour = [PALETTE["blue"], PALETTE["purple"], PALETTE["green"], INK][i % 4]
            balance = peak / bw
            ax.plot(
                [low, balance, high],
                [low * bw / scale, peak / scale, peak / scale],
                color=colour,
                lw=2,
                label=f"{machine}: balance {balance:,.0f} FLOP/B",
            )
            ax.plot([balance], [peak / scale], marker="o", color=colour)
        for i, (label, (x, y)) in enumerate(sorted(points.items(), key=lambda p: p[1][0])):
            ax.plot([x], [y / scale], marker="D", color=PALETTE["orange"], ms=7)
            above = i % 2 == 1  # alternate, so that close points' labels do not collide
            ax.annotate(
                label,
                (x, y / scale),
                xytext=(0, 9 if above else -11),
                textcoords="offset points",
                ha="center",
                va="bottom" if above else "top",
                bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1},
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(low, high)
        tops = [peak / scale for peak, _ in roofs.values()]
        ax.set_ylim(top=max(tops) * 4)
        ax.set_xlabel("arithmetic intensity (FLOPs per byte moved, log scale)")
        ax.set_ylabel(f"attainable {name} (log scale)")
        ax.legend(loc="lower right")
        ax.set_title(title)
        source_note(fig, source)
    return fig


def gemm_share_against_size(
    sizes: Sequence[int], shares: Sequence[float], fastest: float | None, title: str, source: str
) -> Figure:
    """A square GEMM's share of the datasheet peak (drawn in %) against its size ``n``
    (``n x n`` by ``n x n``), with the fastest GEMM measured on the GPU (``fastest``, a
    share; ``None``: not measured) drawn across."""
    if len(sizes) != len(shares) or not sizes:
        raise ValueError("sizes and shares must be non-empty and of the same length")
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((7.0, 3.6))
        ax.plot(list(sizes), [100 * s for s in shares], color=PALETTE["blue"], lw=1.6)
        ax.axhline(100, color=INK, lw=1)
        ax.annotate(
            "datasheet peak", (sizes[0], 100), xytext=(2, -3), textcoords="offset points", va="top"
        )
        if fastest is not None:
            ax.axhline(100 * fastest, color=PALETTE["red"], ls="--", lw=1.2)
            ax.annotate(
                f"fastest GEMM measured: {fastest:.0%}",
                (sizes[0], 100 * fastest),
                xytext=(2, 3),
                textcoords="offset points",
                va="bottom",
                color=PALETTE["red"],
            )
        ax.set_xscale("log", base=2)
        ticks = [s for s in (256, 512, 1024, 2048, 4096, 8192, 16384) if sizes[0] <= s <= sizes[-1]]
        ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
        ax.minorticks_off()
        ax.set_ylim(0, 105)
        ax.set_xlabel("GEMM size n (an n x n by n x n product, log scale)")
        ax.set_ylabel("share of peak (%)")
        ax.set_title(title)
        source_note(fig, source)
    return fig
