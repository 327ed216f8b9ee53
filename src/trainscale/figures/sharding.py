"""Figures of chapter 7: model state per GPU at each ZeRO stage, one FSDP step, the
bytes a rank holds at each moment of it, and traffic under gradient accumulation."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from trainscale.figures.memory import state_bars
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
from trainscale.sharding import FsdpMemory, FsdpMoment

MIB = 2**20
"""Bytes in a MiB: the book measures memory in binary units."""


def zero_stage_bars(
    parts_gib: Mapping[str, Mapping[str, float]], capacity_gib: float, title: str
) -> Figure:
    """One stacked bar per ZeRO stage: the model state one GPU holds, in GiB.

    ``parts_gib`` maps a stage's label (``"DDP"``, ``"ZeRO-1"``, ...) to its parts
    (keys of ``MEMORY_COLOURS``: weights, gradients, optimiser state) in GiB. A red
    line marks the GPU's capacity; each bar is labelled with its total
    (:func:`trainscale.figures.memory.state_bars`).
    """
    return state_bars(parts_gib, title, capacity=capacity_gib)


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


_HELD = {  # what an FSDP rank holds, bottom to top, and its colour
    "sharded weights": MEMORY_COLOURS["weights"],
    "optimiser state": MEMORY_COLOURS["optimiser state"],
    "gradient shards": MEMORY_COLOURS["gradients"],
    "whole weights": PALETTE["sky"],
    "whole gradients": PALETTE["yellow"],
}


def _held_parts(moment: FsdpMemory) -> dict[str, int]:
    return {
        "sharded weights": moment.sharded_weights,
        "optimiser state": moment.optimizer_state,
        "gradient shards": moment.gradient_shards,
        "whole weights": moment.whole_weights,
        "whole gradients": moment.whole_gradients,
    }


def fsdp_memory_timeline(
    panels: Mapping[str, tuple[Sequence[FsdpMemory], Sequence[int]]],
    layer_names: Sequence[str],
    title: str,
) -> Figure:
    """The bytes one rank holds at each moment of an FSDP step, one panel per setup.

    ``panels`` maps a panel's title to the model's moments
    (:func:`trainscale.sharding.fsdp_memory_moments`) and the totals measured at the
    same moments. Each moment is a stacked bar of the model's parts, in MiB (2**20
    bytes): the sharded state below, the whole units above; a black dot marks what
    was measured, and a line the model's peak. A long ``title`` is wrapped, so that
    it is not clipped at the figure's edges.
    """
    if not panels:
        raise ValueError("panels must hold at least one setup")
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig = new_figure((7.0, 2.0 + 1.9 * len(panels)))[0]
        fig.clear()
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        top = max(m.total for moments, _ in panels.values() for m in moments) / MIB
        for ax, (name, (moments, measured)) in zip(axes, panels.items(), strict=True):
            if len(measured) != len(moments):
                raise ValueError(
                    f"measured must have one total per moment ({len(moments)}), got {len(measured)}"
                )
            for col, moment in enumerate(moments):
                bottom = 0.0
                for part, size in _held_parts(moment).items():
                    ax.bar(col, size / MIB, bottom=bottom, width=0.7, color=_HELD[part])
                    bottom += size / MIB
            ax.plot(range(len(moments)), [b / MIB for b in measured], "o", color=INK, ms=4)
            peak = max(m.total for m in moments) / MIB
            ax.axhline(peak, color=PALETTE["red"], lw=1, ls="--")
            ax.annotate(
                f"peak {peak:.2f} MiB",
                (len(moments) - 0.5, peak),
                xytext=(0, 3),
                textcoords="offset points",
                ha="right",
                va="bottom",
                color=PALETTE["red"],
                fontsize=8,
            )
            ax.set_ylim(0, top * 1.2)
            ax.set_ylabel("MiB held")
            ax.set_title(name, fontsize=10, loc="left")
        labels = [
            "step" if m.phase == "optimiser" else f"{m.phase[0].upper()} {layer_names[m.unit]}"
            for m in next(iter(panels.values()))[0]
        ]
        axes[-1].set_xticks(range(len(labels)), labels, rotation=45, ha="right")
        fig.suptitle(textwrap.fill(title, 60), fontweight="bold")
        handles = [Rectangle((0, 0), 1, 1, facecolor=c, label=part) for part, c in _HELD.items()]
        handles.append(plt.Line2D([], [], marker="o", color=INK, ls="none", ms=4, label="measured"))
        fig.legend(handles=handles, loc="outside lower center", ncol=3, fontsize=8)
    return fig


def zero_accumulation_traffic(
    micro_batches: Sequence[int],
    formula: Mapping[str, Sequence[float]],
    measured: Mapping[str, Sequence[float]],
    title: str,
) -> Figure:
    """Bytes sent per GPU per step against the number of micro-batches, one line per setup.

    ``formula`` maps a setup's name to the formula's bytes at each of
    ``micro_batches``, ``measured`` to the bytes counted on real collectives (drawn as
    markers; a setup may be missing). Both are drawn in multiples of the first setup's
    formula at one micro-batch (DDP, if it comes first).
    """
    ks = list(micro_batches)
    if not formula or not ks:
        raise ValueError("formula and micro_batches must not be empty")
    unit = next(iter(formula.values()))[0]
    if unit <= 0:
        raise ValueError(f"the first setup must send bytes at one micro-batch, got {unit}")
    colours = [PALETTE[c] for c in ("green", "blue", "orange", "purple", "red", "grey")]
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((7.0, 3.6))
        for colour, (name, values) in zip(colours, formula.items(), strict=False):
            ax.plot(ks, [v / unit for v in values], color=colour, lw=1.6, label=name)
            if name in measured:
                ax.plot(ks, [v / unit for v in measured[name]], "o", color=colour, ms=6)
        ax.plot([], [], "o", color=INK, label="measured on gloo")
        ax.set_xticks(ks)
        ax.set_xlabel("micro-batches per step (m)")
        ax.set_ylabel("bytes per step / DDP's")
        ax.set_ylim(0, None)
        ax.set_title(title)
        fig.legend(loc="outside right center", fontsize=8)
    return fig
