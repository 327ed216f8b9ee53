"""Figures of chapter 12: number formats, gradients against fp16's range, loss scaling, fp8."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.figure import Figure

from trainscale.figures.style import PALETTE, STYLE, BookFigure, new_figure
from trainscale.loss_scaling import StepRecord
from trainscale.precision import FloatFormat, ScaledCast

FP16_ZERO_BELOW = 2.0**-25
"""fp16 rounds a magnitude to 0 up to here (half the smallest subnormal, ties to even)."""
FP16_NORMAL_FROM = 2.0**-14
"""fp16's smallest normal number: below it, numbers keep fewer significant bits."""
FP16_INF_FROM = 65520.0
"""fp16 rounds a magnitude to infinity from here (65504 is the largest finite number)."""


def power_label(value: float) -> str:
    """``2^k`` for a power of two, with its decimal value when that is short."""
    k = math.log2(value)
    if k.is_integer():
        return f"2^{int(k)} = {value:,.0f}" if 0 < k <= 24 else f"2^{int(k)}"
    return f"{value:g}"


def format_ranges(
    formats: Sequence[FloatFormat], title: str = "The range of each format: fp16's is narrow"
) -> Figure:
    """The positive numbers each format can hold, on a logarithmic axis.

    One bar per format: lighter from the smallest subnormal number to the
    smallest normal one (fewer significant bits there), solid up to the largest.
    """
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 0.9 + 0.55 * len(formats)))
        for row, fmt in enumerate(formats):
            low, mid, high = (
                math.log10(fmt.smallest_subnormal),
                math.log10(fmt.smallest_normal),
                math.log10(fmt.largest),
            )
            ax.barh(
                row,
                mid - low,
                left=low,
                height=0.5,
                color=PALETTE["sky"],
                alpha=0.6,
                label="subnormal (fewer bits)" if row == 0 else None,
            )
            ax.barh(
                row,
                high - mid,
                left=mid,
                height=0.5,
                color=PALETTE["blue"],
                label="normal" if row == 0 else None,
            )
        ax.axvline(0.0, color=PALETTE["grey"], linewidth=1, linestyle=":")
        labels = [
            f"{f.name}\n{f.exponent_bits} exp + {f.mantissa_bits} mantissa bits" for f in formats
        ]
        ax.set_yticks(range(len(formats)), labels)
        ax.set_ylim(len(formats) - 0.5, -0.5)
        ax.set_xlabel("magnitude (power of ten; the dotted line is 1.0)")
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"1e{v:.0f}"))
        ax.set_title(title)
        fig.legend(loc="outside lower center", ncol=2)
    return fig


def gradient_histogram(
    magnitudes: torch.Tensor | np.ndarray,
    scale: float,
    underflow: float,
    overflow: float,
    show_unscaled: bool = True,
) -> Figure:
    """Histogram of ``magnitudes * scale`` against fp16's limits (log axis).

    Shaded bands mark what fp16 rounds to 0 and what it rounds to infinity, and
    a light band its subnormal range. ``underflow`` and ``overflow`` are the
    shares lost (from :func:`trainscale.precision.fp16_cast_losses`); they go
    in the title. With ``show_unscaled`` the unscaled gradients are outlined
    for comparison. Values beyond the axis are counted in its end bins.
    """
    values = np.asarray(magnitudes, dtype=np.float64)
    edges = np.arange(-14.0, 8.01, 0.25)

    def counts(factor: float) -> np.ndarray:
        logs = np.clip(np.log10(values * factor), edges[0] + 1e-9, edges[-1] - 1e-9)
        return np.histogram(logs, bins=edges)[0] / values.size * 100

    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((7.0, 3.4))
        zero, normal, inf = (
            math.log10(v) for v in (FP16_ZERO_BELOW, FP16_NORMAL_FROM, FP16_INF_FROM)
        )
        ax.axvspan(edges[0], zero, color=PALETTE["red"], alpha=0.15, lw=0, label="fp16 rounds to 0")
        ax.axvspan(zero, normal, color=PALETTE["yellow"], alpha=0.25, lw=0, label="fp16 subnormal")
        ax.axvspan(
            inf, edges[-1], color=PALETTE["purple"], alpha=0.25, lw=0, label="fp16 rounds to inf"
        )
        if show_unscaled and scale != 1:
            ax.stairs(counts(1.0), edges, color=PALETTE["grey"], linewidth=1.2, label="unscaled")
        ax.stairs(
            counts(scale),
            edges,
            fill=True,
            color=PALETTE["blue"],
            alpha=0.85,
            label=f"x {power_label(scale)}",
        )
        ax.set_xlim(edges[0], edges[-1])
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"1e{v:.0f}"))
        ax.set_xlabel("gradient magnitude x loss scale (as stored in fp16)")
        ax.set_ylabel("% of gradients")
        ax.set_title(
            f"Scale {power_label(scale)}: {underflow:.1%} round to 0, {overflow:.2%} overflow"
        )
        fig.legend(loc="outside lower center", ncol=3)
    return fig


def loss_scale_trace(
    ours: Sequence[StepRecord], reference: Sequence[StepRecord], reference_name: str
) -> Figure:
    """The loss scale and the share of zero gradients, step by step, for two scalers.

    Top: the scale each step used (log 2 axis), ours as a thick line and the
    reference drawn thin on top of it; skipped steps marked. Bottom: the share
    of gradient entries that came out exactly 0.
    """
    steps = np.arange(len(ours))
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig = BookFigure(figsize=(7.0, 4.6), layout="constrained")
        top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
        for ax, name, records, style in (
            (top, "DynamicLossScaler", ours, {"linewidth": 4, "color": PALETTE["sky"]}),
            (top, reference_name, reference, {"linewidth": 1.2, "color": PALETTE["blue"]}),
        ):
            ax.step(steps, [math.log2(r.scale) for r in records], where="mid", label=name, **style)
        skipped = [i for i, r in enumerate(ours) if r.skipped]
        top.plot(
            skipped,
            [math.log2(ours[i].scale) for i in skipped],
            "x",
            color=PALETTE["red"],
            markersize=8,
            markeredgewidth=2,
            label="step skipped (overflow)",
        )
        top.set_ylabel("log2(loss scale)")
        top.yaxis.set_major_locator(plt.MaxNLocator(integer=True))
        top.set_title("Dynamic loss scaling: grow until overflow, halve, repeat")
        top.legend(loc="lower right")
        bottom.plot(steps, [100 * r.zero_share for r in ours], color=PALETTE["orange"])
        bottom.set_ylabel("% gradients = 0")
        bottom.set_xlabel("training step")
        bottom.set_ylim(bottom=0)
    return fig


def accumulation(traces: Mapping[str, Sequence[float]], update: float) -> Figure:
    """A weight after each added ``update``, one line per way of storing it."""
    colours = [PALETTE["blue"], PALETTE["red"], PALETTE["green"], PALETTE["purple"]]
    styles = ["-", "-", "-", "--"]
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig, ax = new_figure((7.0, 3.4))
        for colour, line, (name, values) in zip(colours, styles, traces.items(), strict=False):
            ax.plot(range(len(values)), values, line, color=colour, label=name, linewidth=1.8)
        ax.set_xlabel(f"updates of {update:g} added")
        ax.set_ylabel("weight")
        ax.set_title("Small updates vanish in bf16; an fp32 master copy keeps them")
        ax.legend(loc="upper left")
    return fig


def scaled_cast_histogram(
    values: torch.Tensor | np.ndarray, scale: float, fmt: FloatFormat, cast: ScaledCast
) -> Figure:
    """Histogram of ``|values| * scale`` against the range of ``fmt`` (log axis).

    Shaded bands mark what the format rounds to 0 (below half its smallest subnormal
    number), its subnormal range, and what it saturates (above its largest number).
    ``cast`` (from :func:`trainscale.precision.scaled_cast`) gives the title's shares.
    Zeros are left out; values beyond the axis are counted in its end bins.
    """
    magnitudes = np.abs(np.asarray(values, dtype=np.float64).ravel())
    magnitudes = magnitudes[magnitudes > 0] * scale
    zero = math.log10(fmt.smallest_subnormal / 2)
    normal, top = math.log10(fmt.smallest_normal), math.log10(fmt.largest)
    edges = np.arange(math.floor(zero) - 3.0, math.ceil(top) + 3.01, 0.25)
    logs = np.clip(np.log10(magnitudes), edges[0] + 1e-9, edges[-1] - 1e-9)
    counts = np.histogram(logs, bins=edges)[0] / max(magnitudes.size, 1) * 100
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((7.0, 3.4))
        ax.axvspan(edges[0], zero, color=PALETTE["red"], alpha=0.15, lw=0, label="rounds to 0")
        ax.axvspan(zero, normal, color=PALETTE["yellow"], alpha=0.25, lw=0, label="subnormal")
        ax.axvspan(top, edges[-1], color=PALETTE["purple"], alpha=0.25, lw=0, label="saturates")
        ax.stairs(counts, edges, fill=True, color=PALETTE["blue"], alpha=0.85, label="values")
        ax.set_xlim(edges[0], edges[-1])
        ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"1e{v:.0f}"))
        ax.set_xlabel(f"|value| x scale (as stored in {fmt.name})")
        ax.set_ylabel("% of values")
        ax.set_title(
            f"Scale {power_label(scale)}: {cast.underflowed:.1%} round to 0,"
            f" {cast.saturated:.2%} saturate, error {cast.relative_error:.1%}"
        )
        fig.legend(loc="outside lower center", ncol=4)
    return fig
