"""Figures of chapter 6: the four collectives, the ring all-reduce step by step,
measured all-reduce bandwidth and its latency-bandwidth fit, and when the gradient
all-reduce hides under backward."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator

from trainscale.collectives import AlphaBeta, DataParallelStep, RingStep
from trainscale.figures.style import (
    INK,
    MUTED_INK,
    PALETTE,
    PARTIAL_GREY,
    PHASE_COLOURS,
    RANK_COLOURS,
    STYLE,
    BookFigure,
    new_figure,
)

SUM_COLOUR = INK
"""Data summed over every rank."""

PARTIAL_COLOUR = PARTIAL_GREY
"""Data summed over some ranks but not yet all."""


def _grid_style() -> dict:
    return {**STYLE, "axes.grid": False, "axes.spines.left": False, "axes.spines.bottom": False}


def _cell(
    ax: Axes, x: float, y: float, text: str, colour: str, bold_edge: bool = False, size: float = 10
) -> None:
    """A unit square at ``(x, y)`` (top-left, y growing downwards) with centred text."""
    ax.add_patch(
        Rectangle(
            (x, y),
            0.94,
            0.86,
            facecolor=colour,
            edgecolor=PALETTE["red"] if bold_edge else "white",
            linewidth=3 if bold_edge else 0.5,
        )
    )
    light = sum(to_rgb(colour)) > 2.0
    colour = "black" if light else "white"
    ax.text(x + 0.47, y + 0.43, text, ha="center", va="center", color=colour, fontsize=size)


def _output_colours(name: str, inputs: Sequence[Sequence[int]], rank: int, length: int) -> list:
    """Colour of each output element of collective ``name`` on ``rank``: where it came from."""
    if name == "broadcast":
        return [RANK_COLOURS[0]] * length
    if name == "all-gather":
        shard = max(1, len(inputs[0]))
        return [RANK_COLOURS[(k // shard) % len(RANK_COLOURS)] for k in range(length)]
    return [SUM_COLOUR] * length  # all-reduce and reduce-scatter: summed over every rank


def four_collectives(results: Sequence[Mapping[str, Mapping[str, Sequence[int]]]]) -> Figure:
    """Every rank's input and output of the four collectives, one panel each.

    ``results[rank][name]`` holds ``"input"`` and ``"output"`` lists, as
    :func:`trainscale.workers.collectives.four_collectives` returns them.
    An element is drawn in its rank's colour when it came from that rank alone,
    dark when it sums every rank.
    """
    names = list(results[0])
    ranks = len(results)
    gap = 1.2
    width_in = max(len(results[r][n]["input"]) for r in range(ranks) for n in names)
    width_out = max(len(results[r][n]["output"]) for r in range(ranks) for n in names)
    with plt.rc_context(_grid_style()):
        fig = BookFigure(figsize=(7.0, 1.4 + 0.85 * ranks), layout="constrained")
        axes = fig.subplots(2, (len(names) + 1) // 2).flatten()
        for ax, name in zip(axes, names, strict=False):
            inputs = [results[r][name]["input"] for r in range(ranks)]
            for r in range(ranks):
                for k, value in enumerate(inputs[r]):
                    _cell(ax, k, r, str(value), RANK_COLOURS[r % len(RANK_COLOURS)])
                output = results[r][name]["output"]
                colours = _output_colours(name, inputs, r, len(output))
                for k, value in enumerate(output):
                    _cell(ax, width_in + gap + k, r, str(value), colours[k])
            ax.annotate(
                "",
                (width_in + gap - 0.15, ranks / 2),
                (width_in + 0.1, ranks / 2),
                arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 1.5},
            )
            # The same scale in every panel, so a cell is the same size everywhere.
            ax.set_xlim(-0.1, width_in + gap + width_out + 0.1)
            ax.set_ylim(ranks, -0.1)
            ax.set_yticks([r + 0.43 for r in range(ranks)], [f"rank {r}" for r in range(ranks)])
            ax.tick_params(length=0)
            ax.set_xticks([width_in / 2, width_in + gap + width_out / 2], ["before", "after"])
            ax.xaxis.set_ticks_position("top")
            ax.set_title(name, pad=4)
            ax.set_aspect("equal")
        for ax in axes[len(names) :]:
            ax.set_visible(False)
        legend = [Patch(color=RANK_COLOURS[r], label=f"rank {r}") for r in range(ranks)]
        legend.append(Patch(color=SUM_COLOUR, label="sum of all ranks"))
        fig.legend(
            handles=legend,
            loc="outside lower center",
            ncol=len(legend),
            fontsize=9,
            title="where each value comes from",
            title_fontsize=9,
        )
    return fig


def _contributors(ranks: frozenset[int], n: int) -> str:
    """How a cell names the ranks whose data it sums: 'Σ' once it has them all."""
    if len(ranks) == n and n > 1:
        return "Σ"
    return "+".join(str(r) for r in sorted(ranks))


def _cell_colour(ranks: frozenset[int], n: int) -> str:
    if len(ranks) == n and n > 1:
        return SUM_COLOUR
    if len(ranks) > 1:
        return PARTIAL_COLOUR
    return RANK_COLOURS[next(iter(ranks)) % len(RANK_COLOURS)]


def _ring_grid(ax: Axes, state: RingStep, title: str, received: set[tuple[int, int]]) -> None:
    """One rank x chunk grid of a ring all-reduce state; ``received`` cells get a thick edge."""
    n = len(state.contributions)
    for r, row in enumerate(state.contributions):
        for k, ranks in enumerate(row):
            text, colour = _contributors(ranks, n), _cell_colour(ranks, n)
            size = 10 if len(text) <= 3 else 8 if len(text) <= 5 else 6.5
            _cell(ax, k, r, text, colour, bold_edge=(r, k) in received, size=size)
    ax.set_xlim(-0.05, n)
    ax.set_ylim(n, -0.05)
    ax.set_xticks([k + 0.47 for k in range(n)], [str(k) for k in range(n)])
    ax.xaxis.set_ticks_position("top")
    ax.xaxis.set_label_position("top")
    ax.set_xlabel("chunk", fontsize=9, labelpad=2)
    ax.set_yticks([r + 0.43 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.tick_params(length=0, labelsize=9 if n <= 4 else 8)
    ax.set_aspect("equal")
    ax.set_title(title, fontsize=11, pad=6)


def _received(state: RingStep) -> set[tuple[int, int]]:
    """The (rank, chunk) cells written in this step: each rank's right-hand neighbour's."""
    n = len(state.sent)
    return {((r + 1) % n, k) for r, k in enumerate(state.sent) if k is not None}


def _legend(fig: Figure, n: int, thick: bool, beside: bool = False) -> None:
    """The key of the ring grids: below them, or ``beside`` them in one column."""
    handles = [Patch(color=RANK_COLOURS[r], label=f"rank {r}") for r in range(n)]
    handles += [
        Patch(color=PARTIAL_COLOUR, label="partial sum"),
        Patch(color=SUM_COLOUR, label="Σ: sum of all"),
    ]
    if thick:
        handles.append(
            Patch(facecolor="white", edgecolor=PALETTE["red"], lw=2.5, label="just received")
        )
    placement = (
        {"loc": "center left", "bbox_to_anchor": (0.7, 0.45), "ncol": 1}
        if beside
        else {
            "loc": "outside lower center",
            "ncol": (len(handles) + 1) // 2 if len(handles) > 6 else len(handles),
        }
    )
    fig.legend(
        handles=handles,
        **placement,
        fontsize=9,
        title="whose chunk a cell holds",
        title_fontsize=9,
    )


def ring_stages(trace: Sequence[RingStep]) -> Figure:
    """Three rank x chunk grids of a ring all-reduce: at the start, after the
    reduce-scatter, and after the all-gather.

    ``trace`` is :func:`trainscale.collectives.ring_all_reduce_trace`. Each cell
    names the ranks whose chunk is summed in it; after the reduce-scatter each
    rank holds one complete sum, chunk ``(r + 1) % N``.
    """
    n = len(trace[0].contributions)
    stages = [
        (trace[0], "start"),
        (trace[n - 1], f"after reduce-scatter\n({n - 1} steps)"),
        (trace[-1], f"after all-gather\n({n - 1} more steps)"),
    ]
    with plt.rc_context(_grid_style()):
        fig = BookFigure(figsize=(7.0, 3.4), layout="constrained")
        for ax, (state, title) in zip(fig.subplots(1, 3), stages, strict=True):
            _ring_grid(ax, state, title, set())
        _legend(fig, n, thick=False)
    return fig


def ring_step(trace: Sequence[RingStep], index: int) -> Figure:
    """The state of a ring all-reduce after step ``index`` of ``trace`` (0 is the start).

    Cells written in that step have a thick red edge. An ``index`` past the last
    step shows the finished all-reduce, so sliders over several ring sizes can
    share one step axis.
    """
    n = len(trace[0].contributions)
    last = len(trace) - 1
    state = trace[min(index, last)]
    if index == 0:
        title = f"{n} ranks, start\neach rank holds only its own data"
    elif index > last:
        title = f"{n} ranks: finished after {last} steps\nevery rank holds the whole sum"
    else:
        title = f"{n} ranks, {state.phase} step {state.step} of {n - 1}"
        title += "\neach rank sent one chunk to the next rank"
    with plt.rc_context(_grid_style()):
        # A fixed layout (no layout engine): a slider draws dozens of these.
        fig = BookFigure(figsize=(6.4, 3.9))
        ax = fig.add_axes((0.1, 0.03, 0.58, 0.72))
        received = _received(state) if 0 < index <= last else set()
        _ring_grid(ax, state, "", received)
        ax.set_title(title, fontsize=11, pad=22, loc="left", x=-0.12)
        _legend(fig, n, thick=True, beside=True)
    return fig


def _size_label(size: float) -> str:
    """Bytes as the sweep names them: ``4 KiB``, ``16 MiB``."""
    return f"{size / 2**20:g} MiB" if size >= 2**20 else f"{size / 2**10:g} KiB"


def bandwidth_against_size(
    sizes: Sequence[int], algbw: Sequence[float], busbw: Sequence[float], ranks: int
) -> Figure:
    """Measured all-reduce bandwidth (GB/s) against message size (bytes), log scale.

    ``algbw`` is bytes per second of the tensor, ``busbw`` nccl-tests' bus
    bandwidth, ``algbw * 2(n-1)/n``, both in GB/s.
    """
    labels = [f"{s // 2**20} MiB" if s >= 2**20 else f"{s // 2**10} KiB" for s in sizes]
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig = BookFigure(figsize=(7.0, 3.4), layout="constrained")
        ax = fig.add_subplot()
        ax.plot(sizes, busbw, marker="o", color=PALETTE["blue"], label="busbw = algbw x 2(n-1)/n")
        ax.plot(sizes, algbw, marker="s", color=PALETTE["orange"], label="algbw = bytes / time")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(sizes), labels)
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel("all-reduce message size")
        ax.set_ylabel("GB/s (measured)")
        ax.set_title(f"All-reduce on {ranks} gloo processes: small messages waste the link")
        ax.legend(loc="upper left")
    return fig


def alpha_beta_fit(sizes: Sequence[float], seconds: Sequence[float], fit: AlphaBeta) -> Figure:
    """Measured all-reduce times against size, log-log, with the fitted alpha-beta model.

    ``sizes`` in bytes, ``seconds`` per all-reduce, ``fit`` from
    :func:`trainscale.collectives.fit_alpha_beta`. The model's two terms are drawn
    apart (latency ``2(n-1) alpha``, flat; bandwidth ``2(n-1)/n S/beta``, rising) and a
    vertical line marks where they cross, ``S* = n alpha beta``.
    """
    low, high = min(sizes) / 2, max(sizes) * 2
    grid = [low * (high / low) ** (k / 60) for k in range(61)]
    latency_term = fit.seconds(0)
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        fig, ax = new_figure((7.0, 3.6))
        ax.plot(sizes, [t * 1e3 for t in seconds], "o", color=PALETTE["blue"], label="measured")
        ax.plot(
            grid,
            [fit.seconds(s) * 1e3 for s in grid],
            color=INK,
            label=r"fit: $\tau_\text{coll}(S)$",
        )
        ax.plot(
            grid,
            [latency_term * 1e3] * len(grid),
            ls="--",
            color=PALETTE["orange"],
            label=r"latency term $2(n-1)\alpha$",
        )
        ax.plot(
            grid,
            [(fit.seconds(s) - latency_term) * 1e3 for s in grid],
            ls="--",
            color=PALETTE["green"],
            label=r"bandwidth term $\frac{2(n-1)}{n} \cdot S/\beta$",
        )
        ax.axvline(fit.crossover_bytes, color=MUTED_INK, lw=1, ls=":")
        ax.annotate(
            r"$S^* = n\alpha\beta$",
            (fit.crossover_bytes, latency_term * 1e3),
            xytext=(6, -14),
            textcoords="offset points",
            color=MUTED_INK,
            fontsize=9,
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(list(sizes), [_size_label(s) for s in sizes])
        ax.minorticks_off()
        # 1, 2 and 5 of every decade: a span of one decade still reads off several ticks.
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.set_xlim(low, high)
        ax.set_ylim(bottom=latency_term * 1e3 / 4)
        ax.set_xlabel("all-reduce message size")
        ax.set_ylabel("ms per all-reduce (measured)")
        ax.set_title(
            f"What this CPU shows: all-reduce on {fit.ranks} processes,\n"
            "a latency and a bandwidth term fitted"
        )
        ax.legend(loc="upper left", fontsize=9)
    return fig


DTYPE_COLOURS = {"bf16": PALETTE["green"], "fp32": PALETTE["purple"]}
"""The all-reduce line of each gradient dtype in :func:`exposed_communication`."""


def exposed_communication(
    tokens_per_gpu: Sequence[float],
    steps: Mapping[str, Sequence[DataParallelStep]],
    thresholds: Mapping[str, float],
    title: str,
    marked_tokens: float | None = None,
) -> Figure:
    """Backward time and gradient all-reduce times against tokens per GPU, log-log.

    ``steps[dtype][i]`` is :func:`trainscale.collectives.data_parallel_step` at
    ``tokens_per_gpu[i]`` with gradients of that dtype (a key of
    :data:`DTYPE_COLOURS`); backward is the same for every dtype. Backward grows
    with the tokens, an all-reduce does not; where the all-reduce is the longer,
    the difference is exposed (shaded). A vertical line marks each dtype's
    ``thresholds[dtype]`` (from :func:`trainscale.collectives.dp_hiding_threshold_tokens`),
    a dotted one the worked example's ``marked_tokens``.
    """
    first = next(iter(steps.values()))
    backward = [s.backward_seconds for s in first]
    with plt.rc_context({**STYLE, "axes.grid.axis": "both"}):
        # A fixed layout (no layout engine): a slider draws many of these.
        fig = BookFigure(figsize=(7.0, 3.6))
        ax = fig.add_axes((0.1, 0.14, 0.84, 0.76))
        ax.plot(tokens_per_gpu, backward, color=PHASE_COLOURS["backward"], label="backward")
        for dtype, dtype_steps in steps.items():
            comm = [s.all_reduce_seconds for s in dtype_steps]
            colour = DTYPE_COLOURS[dtype]
            ax.plot(tokens_per_gpu, comm, color=colour, label=f"all-reduce, {dtype} gradients")
            ax.fill_between(
                tokens_per_gpu,
                backward,
                comm,
                where=[c > b for c, b in zip(comm, backward, strict=True)],
                interpolate=True,
                color=colour,
                alpha=0.2,
                lw=0,
            )
            ax.axvline(thresholds[dtype], color=colour, lw=1.2)
            ax.annotate(
                f"{dtype} hides from {thresholds[dtype]:,.0f} tokens",
                (thresholds[dtype], min(backward)),
                xytext=(3, 3),
                textcoords="offset points",
                rotation=90,
                ha="left",
                va="bottom",
                fontsize=8.5,
                color=INK,
            )
        if marked_tokens is not None:
            ax.axvline(marked_tokens, color=MUTED_INK, lw=1, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = [t for t in tokens_per_gpu if t == 2 ** round(math.log2(t))][::2]
        ax.set_xticks(ticks, [f"{t:,.0f}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlim(min(tokens_per_gpu), max(tokens_per_gpu))
        ax.set_xlabel("tokens per GPU per step")
        ax.set_ylabel("seconds per step")
        ax.set_title(title + "; shaded: exposed, the GPUs wait", fontsize=11)
        ax.legend(loc="upper left", fontsize=9)
    return fig
