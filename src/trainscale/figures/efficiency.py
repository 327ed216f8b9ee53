"""Figures of chapter 15: measured matmul rates, step times and MFU, and a loader timeline."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from trainscale.efficiency import Span
from trainscale.figures.style import PALETTE, STYLE, new_figure


def _log2_axis(ax, values: Sequence[int]) -> None:
    """An x axis on a log-2 scale with a labelled tick at each value."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(values), [f"{v:,}" for v in values])
    ax.minorticks_off()


def matmul_throughput(rates: Mapping[int, float]) -> Figure:
    """Measured FLOP/s of square matrix products against their size, best one marked.

    ``rates`` maps the matrix size ``n`` (of an ``n x n`` by ``n x n`` product)
    to FLOP/s, as :func:`trainscale.efficiency.matmul_rates` returns it.
    """
    sizes = list(rates)
    gflops = [rates[n] / 1e9 for n in sizes]
    best = max(gflops)
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((7.0, 3.4))
        ax.plot(sizes, gflops, marker="o", color=PALETTE["blue"], label="measured, best run")
        ax.axhline(best, color=PALETTE["red"], linestyle="--", linewidth=1.5)
        ax.annotate(
            f"measured peak {best:.1f} GFLOP/s",
            (sizes[0], best),
            xytext=(0, -4),
            textcoords="offset points",
            color=PALETTE["red"],
            va="top",
        )
        _log2_axis(ax, sizes)
        ax.set_ylim(0, best * 1.15)
        ax.set_xlabel("matrix size n (an n x n by n x n product)")
        ax.set_ylabel("GFLOP/s")
        ax.set_title("Matrix products on this machine: small ones waste it")
    return fig


def step_durations(seconds: Sequence[float], warmup: int) -> Figure:
    """One bar per training step (ms), the first ``warmup`` steps in their own colour,
    with the mean of the steady steps drawn across.

    The time axis is logarithmic, so a start-up step many times longer than the
    rest does not flatten them.
    """
    ms = [s * 1e3 for s in seconds]
    steady = ms[warmup:]
    mean = sum(steady) / len(steady)
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((7.0, 3.5))
        steps = range(1, len(ms) + 1)
        colours = [PALETTE["orange"]] * warmup + [PALETTE["blue"]] * len(steady)
        ax.bar(steps, ms, color=colours)
        line = ax.axhline(mean, color=PALETTE["grey"], linestyle="--", label="steady mean")
        ax.set_yscale("log")
        ax.set_ylim(10 ** math.floor(math.log10(min(ms) / 1.5)), max(ms) * 1.5)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(
            FuncFormatter(lambda value, _: f"{value:,.0f}" if value >= 1 else f"{value:g}")
        )
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(list(steps))
        ax.set_xlabel("step")
        ax.set_ylabel("step time (ms, log scale)")
        ax.set_title("Every step of the loop, warmup first")
        fig.legend(
            handles=[
                Patch(color=PALETTE["orange"], label="warmup (left out)"),
                Patch(color=PALETTE["blue"], label="steady steps"),
                line,
            ],
            loc="outside lower center",
            ncol=3,
        )
    return fig


def mfu_against_batch(batches: Sequence[int], mfu: Sequence[float]) -> Figure:
    """Measured MFU (a share, drawn in %) against the micro-batch size."""
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((7.0, 3.4))
        percent = [100 * m for m in mfu]
        ax.plot(batches, percent, marker="o", color=PALETTE["blue"])
        for b, p in zip(batches, percent, strict=True):
            ax.annotate(
                f"{p:.1f} %", (b, p), xytext=(0, 6), textcoords="offset points", ha="center"
            )
        _log2_axis(ax, batches)
        ax.set_ylim(0, max(percent) * 1.2)
        ax.set_xlabel("micro-batch (examples per step)")
        ax.set_ylabel("MFU (% of measured peak)")
        ax.set_title("Bigger micro-batches keep the hardware busier")
    return fig


def step_breakdown(parts_ms: Mapping[str, tuple[float, float]]) -> Figure:
    """Stacked horizontal bars of the mean time per step, one per way of feeding the loop.

    ``parts_ms`` maps a name to ``(computing, waiting)``, the milliseconds a
    step spent computing and waiting for its batch; the waiting part is hatched
    like the idle gaps of :func:`loader_timeline` and labelled with its share.
    """
    names = list(parts_ms)
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 1.5 + 0.55 * len(names)))
        rows = range(len(names))
        busy = [parts_ms[n][0] for n in names]
        idle = [parts_ms[n][1] for n in names]
        ax.barh(rows, busy, height=0.6, color=PALETTE["blue"])
        ax.barh(
            rows,
            idle,
            left=busy,
            height=0.6,
            color="white",
            edgecolor=PALETTE["red"],
            hatch="///",
            linewidth=0.0,
        )
        for row, (b, w) in enumerate(zip(busy, idle, strict=True)):
            ax.annotate(
                f"{w / (b + w):.0%} waiting",
                (b + w, row),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
            )
        ax.set_yticks(list(rows), names)
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_xlim(0, max(b + w for b, w in zip(busy, idle, strict=True)) * 1.25)
        ax.set_xlabel("mean time per step (ms)")
        ax.set_title("A slow loader starves the loop; prefetching feeds it")
        handles = [
            Patch(color=PALETTE["blue"], label="computing"),
            Patch(
                facecolor="white", edgecolor=PALETTE["red"], hatch="///", label="waiting for data"
            ),
        ]
        fig.legend(handles=handles, loc="outside lower center", ncol=2)
    return fig


LANES = {"load": 0, "compute": 1}


def loader_timeline(
    spans: Sequence[Span], title: str, unit: str = "compute steps", xmax: float | None = None
) -> Figure:
    """A loader lane and a compute lane over time, with the compute lane's idle gaps hatched.

    ``spans`` come from :func:`trainscale.efficiency.loader_timeline`; times are
    drawn as given, in ``unit``. Give every figure of a series the same ``xmax``
    so that a longer timeline looks longer.
    """
    work = sorted((s for s in spans if s.lane == "compute"), key=lambda s: s.start)
    end = max(s.end for s in spans) if xmax is None else xmax
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 2.4))
        for span in spans:
            is_load = span.lane == "load"
            ax.barh(
                LANES[span.lane],
                span.end - span.start,
                left=span.start,
                height=0.6,
                color=PALETTE["sky"] if is_load else PALETTE["blue"],
                edgecolor="white",
                linewidth=0.8,
            )
            if span.end - span.start >= 0.03 * end:
                ax.text(
                    (span.start + span.end) / 2,
                    LANES[span.lane],
                    str(span.step + 1),
                    ha="center",
                    va="center",
                    color="black" if is_load else "white",
                    fontsize=7,
                )
        idle_from = 0.0
        for span in work:
            if span.start > idle_from + 1e-9:
                ax.barh(
                    LANES["compute"],
                    span.start - idle_from,
                    left=idle_from,
                    height=0.6,
                    color="white",
                    edgecolor=PALETTE["red"],
                    hatch="///",
                    linewidth=0.0,
                )
            idle_from = span.end
        handles = [
            Patch(color=PALETTE["sky"], label="loading a batch"),
            Patch(color=PALETTE["blue"], label="computing a step"),
            Patch(
                facecolor="white", edgecolor=PALETTE["red"], hatch="///", label="waiting for data"
            ),
        ]
        ax.set_yticks([LANES["load"], LANES["compute"]], ["loader", "GPU"])
        ax.set_ylim(1.6, -0.6)
        ax.set_xlim(0, end * 1.01)
        ax.set_xlabel(f"time ({unit})")
        ax.set_title(title)
        fig.legend(handles=handles, loc="outside lower center", ncol=3)
    return fig


def restated_utilisation(
    labels: Sequence[str],
    reported: Sequence[float],
    restated: Sequence[float],
    band: tuple[float, float],
    title: str,
) -> Figure:
    """Published utilisations, one row each: as the source counts it and restated.

    ``reported`` and ``restated`` are shares of peak (drawn in %), one per label: the
    first as the source counted it (an outlined bar), the second in the book's
    ``6N`` count (a filled bar inside it, labelled). ``band`` (low, high), a range
    of shares, is shaded behind the rows.
    """
    if not len(labels) == len(reported) == len(restated) > 0:
        raise ValueError("labels, reported and restated must be equally long and not empty")
    rows = range(len(labels))
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 1.4 + 0.3 * len(labels)))
        ax.axvspan(100 * band[0], 100 * band[1], color=PALETTE["sky"], alpha=0.25, linewidth=0)
        ax.barh(
            rows,
            [100 * r for r in reported],
            height=0.7,
            color="white",
            edgecolor=PALETTE["grey"],
            linewidth=1.0,
        )
        ax.barh(rows, [100 * r for r in restated], height=0.45, color=PALETTE["blue"])
        for row, (shown, own) in enumerate(zip(restated, reported, strict=True)):
            ax.annotate(
                f"{shown:.1%}",
                (100 * max(shown, own), row),
                xytext=(4, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        ax.set_yticks(list(rows), labels, fontsize=8)
        ax.set_ylim(len(labels) - 0.5, -0.5)
        ax.set_xlim(0, 100 * max(max(reported), max(restated)) * 1.15)
        ax.set_xlabel("share of the GPUs' dense peak (%)")
        ax.set_title(title)
        handles = [
            Patch(facecolor="white", edgecolor=PALETTE["grey"], label="as the source counts"),
            Patch(color=PALETTE["blue"], label="in 6N, the book's count"),
            Patch(color=PALETTE["sky"], alpha=0.25, label="training runs at 2K-8K tokens"),
        ]
        fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8)
    return fig
