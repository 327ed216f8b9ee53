"""Figures of chapter 8: Megatron's split MLP, and where a layer's time goes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from trainscale.figures.style import LIGHT_GREY, MUTED_INK, PALETTE, STYLE, new_figure

_DEVICE_COLOURS = [
    PALETTE["blue"],
    PALETTE["orange"],
    PALETTE["green"],
    PALETTE["purple"],
    PALETTE["sky"],
    PALETTE["red"],
    PALETTE["yellow"],
    PALETTE["grey"],
]


def _matrix(ax, x, y, width, height, part, colour, horizontal: bool) -> None:
    """A matrix outline with one block filled: columns ``part`` if not ``horizontal``,
    rows ``part`` if it is (``part`` is a ``(start, stop)`` share between 0 and 1)."""
    ax.add_patch(Rectangle((x, y), width, height, facecolor="white", edgecolor=MUTED_INK, lw=0.8))
    start, stop = part
    if horizontal:
        block = Rectangle((x, y + start * height), width, (stop - start) * height)
    else:
        block = Rectangle((x + start * width, y), (stop - start) * width, height)
    block.set(facecolor=colour, edgecolor="none", alpha=0.85)
    ax.add_patch(block)


def _arrow(ax, start, end) -> None:
    ax.add_patch(
        FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=9, color=MUTED_INK, lw=0.8)
    )


def _dims(shape: tuple[int, int]) -> str:
    return f"{shape[0]:,} × {shape[1]:,}"  # noqa: RUF001 (a multiplication sign)


def tensor_parallel_mlp_diagram(
    shapes: Sequence[Mapping[str, tuple[int, int]]], title: str, note: str | None = None
) -> Figure:
    """Megatron's MLP split over ``len(shapes)`` devices, one lane per device.

    ``shapes`` comes from :func:`trainscale.parallel.tensor_parallel_shapes`. Each
    lane shows the full input, the device's column block of the first matrix,
    GELU on its slice of the hidden layer, the matching row block of the second
    matrix and its partial output; the lanes meet in the all-reduce (a sum) that
    gives every device the full output. ``note`` is written under the sum.
    """
    n = len(shapes)
    if n < 1:
        raise ValueError("shapes must describe at least 1 device, got none")
    ffn = sum(s["hidden slice"][1] for s in shapes)
    lane = 1.35
    with plt.rc_context({**STYLE, "axes.grid": False}):
        fig, ax = new_figure((7.4, 1.3 + 0.95 * n))
        start = 0
        for i, s in enumerate(shapes):
            colour = _DEVICE_COLOURS[i % len(_DEVICE_COLOURS)]
            y = i * lane
            part = (start / ffn, (start + s["hidden slice"][1]) / ffn)
            start += s["hidden slice"][1]
            ax.text(-0.15, y + 0.35, f"device {i}", ha="right", va="center", fontsize=9)
            below = y + 0.7
            # the input x, whole on every device
            ax.add_patch(
                Rectangle((0, y + 0.1), 0.35, 0.5, facecolor=LIGHT_GREY, edgecolor=MUTED_INK)
            )
            ax.text(0.175, y + 0.35, "x", ha="center", va="center")
            ax.text(0.175, below, f"input\n{_dims(s['input'])}", **_LABEL)
            # first matrix: my columns
            _matrix(ax, 0.8, y + 0.15, 1.2, 0.4, part, colour, horizontal=False)
            ax.text(1.4, below, f"W1, my columns\n{_dims(s['first matrix'])}", **_LABEL)
            # GELU on my slice of the hidden layer
            ax.add_patch(
                Rectangle((2.45, y + 0.15), 0.6, 0.4, facecolor=colour, alpha=0.25, ec=colour)
            )
            ax.text(2.75, y + 0.35, "GELU", ha="center", va="center", fontsize=8)
            ax.text(2.75, below, f"hidden slice\n{_dims(s['hidden slice'])}", **_LABEL)
            # second matrix: the matching rows
            _matrix(ax, 3.6, y + 0.0, 0.5, 0.6, part, colour, horizontal=True)
            ax.text(3.85, below, f"W2, my rows\n{_dims(s['second matrix'])}", **_LABEL)
            # my partial output
            ax.add_patch(
                Rectangle(
                    (4.7, y + 0.1), 0.45, 0.5, facecolor="white", edgecolor=colour, hatch="///"
                )
            )
            ax.text(4.925, y + 0.35, f"Z{i}", ha="center", va="center", fontsize=9,
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})  # fmt: skip
            ax.text(4.925, below, f"partial\n{_dims(s['partial output'])}", **_LABEL)
            for a, b in ((0.35, 0.8), (2.0, 2.45), (3.05, 3.6), (4.1, 4.7)):
                _arrow(ax, (a, y + 0.35), (b, y + 0.35))
            _arrow(ax, (5.15, y + 0.35), (5.7, (n - 1) * lane / 2 + 0.35))
        # the all-reduce
        middle = (n - 1) * lane / 2 + 0.35
        height = max(0.8, (n - 1) * lane + 0.4)
        label = "all-reduce\n(sum)" if n > 1 else "nothing\nto sum"
        ax.add_patch(
            Rectangle(
                (5.7, middle - height / 2),
                0.8,
                height,
                facecolor=PALETTE["green"],
                alpha=0.25,
                edgecolor=PALETTE["green"],
            )
        )
        ax.text(6.1, middle, label, ha="center", va="center", fontsize=9)
        _arrow(ax, (6.5, middle), (6.8, middle))
        ax.add_patch(
            Rectangle((6.8, middle - 0.25), 0.4, 0.5, facecolor=LIGHT_GREY, edgecolor=MUTED_INK)
        )
        ax.text(7.0, middle, "Z", ha="center", va="center")
        ax.text(7.0, middle + 0.35, "on every\ndevice", **_LABEL)
        if note:
            ax.text(6.1, middle + height / 2 + 0.1, note, **_LABEL)
        ax.set_xlim(-0.85, 7.35)
        ax.set_ylim((n - 1) * lane + 1.2 + (0.3 if note and n == 1 else 0), -0.3)
        ax.axis("off")
        ax.set_title(title)
    return fig


_LABEL = {"ha": "center", "va": "top", "fontsize": 7, "linespacing": 1.1}


_BAR_COLOURS = {"compute": PALETTE["blue"], "communication": PALETTE["green"]}


def time_bars(durations_ms: Mapping[str, float], title: str) -> Figure:
    """Horizontal bars of durations in milliseconds, one per label, top to bottom.

    The word before the colon in each label (``"compute"`` or
    ``"communication"``) picks the colour.
    """
    labels = list(durations_ms)
    kinds = [label.split(":")[0] for label in labels]
    unknown = sorted(set(kinds) - set(_BAR_COLOURS))
    if unknown:
        raise ValueError(
            f"durations_ms labels must start with one of {tuple(_BAR_COLOURS)} and a colon,"
            f" got {unknown}"
        )
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 1.2 + 0.5 * len(labels)))
        colours = [_BAR_COLOURS[kind] for kind in kinds]
        bars = ax.barh(range(len(labels)), list(durations_ms.values()), color=colours, height=0.6)
        ax.bar_label(bars, fmt="%.2f ms", padding=3)
        ax.set_yticks(range(len(labels)), [label.split(": ", 1)[-1] for label in labels])
        ax.invert_yaxis()
        ax.set_xlim(0, max(durations_ms.values()) * 1.2)
        ax.set_xlabel("milliseconds per layer and micro-batch")
        ax.set_title(title)
        handles = [Rectangle((0, 0), 1, 1, facecolor=c, label=k) for k, c in _BAR_COLOURS.items()]
        fig.legend(handles=handles, loc="outside lower center", ncol=2)
    return fig


_KEPT_COLOURS = {"split": PALETTE["blue"], "whole": PALETTE["orange"]}


def activation_memory_bars(
    kept: Mapping[str, tuple[float, float]], unsplit: float, title: str, unit: str = "MiB"
) -> Figure:
    """What one device keeps for backward, one stacked horizontal bar per scheme.

    ``kept`` maps a scheme's label to ``(split, whole)``: the part of its
    activations divided among the devices and the part every device keeps whole,
    both in ``unit``. A dashed line marks ``unsplit``, what one device would keep
    alone; the axis always runs to it, so bars of different figures compare.
    """
    if not kept:
        raise ValueError("kept must name at least 1 scheme, got none")
    if unsplit <= 0 or any(min(parts) < 0 for parts in kept.values()):
        raise ValueError("unsplit must be > 0 and every part in kept >= 0")
    labels = list(kept)
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 1.5 + 0.55 * len(labels)))
        left = [0.0] * len(labels)
        for index, (part, colour) in enumerate(_KEPT_COLOURS.items()):
            sizes = [kept[label][index] for label in labels]
            name = "split over the devices" if part == "split" else "whole on every device"
            ax.barh(range(len(labels)), sizes, left=left, color=colour, height=0.6, label=name)
            left = [a + b for a, b in zip(left, sizes, strict=True)]
        for row, total in enumerate(left):
            ax.text(total + unsplit * 0.01, row, f"{total:,.0f} {unit}", va="center", fontsize=9)
        ax.axvline(unsplit, color=MUTED_INK, lw=1, ls="--")
        ax.text(unsplit * 1.01, (len(labels) - 1) / 2, "one device\nalone", ha="left",
                va="center", fontsize=8, color=MUTED_INK)  # fmt: skip
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_xlim(0, unsplit * 1.18)
        ax.set_xlabel(f"activations kept per device and layer ({unit})")
        ax.set_title(title)
        fig.legend(loc="outside lower center", ncol=2)
    return fig
