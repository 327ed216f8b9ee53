"""Figures of chapter 1: the FLOPs of a layer and the timeline of a training step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from trainscale import _checks
from trainscale.compute import Phase
from trainscale.figures.style import PHASE_COLOURS, STYLE, new_figure


def step_timeline(phases: Sequence[Phase], gpus: int, title: str | None = None) -> Figure:
    """One data-parallel training step on ``gpus`` GPUs, drawn as one row.

    Every GPU runs the same ``phases`` (from :func:`trainscale.compute.step_timeline`),
    so one row stands for all of them. As in a profiler, the row has two lanes:
    compute on top and, below it, the communication that runs alongside, so overlap
    with backward is visible.
    """
    n = _checks.count("gpus", gpus, minimum=1)
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 1.85))
        for phase in phases:
            is_comm = phase.name == "all-reduce"
            ax.barh(
                0.2 if is_comm else -0.1,
                phase.end - phase.start,
                left=phase.start,
                height=0.22 if is_comm else 0.4,
                color=PHASE_COLOURS[phase.name],
                edgecolor="white",
                linewidth=0.5,
                label=phase.name,
            )
        end = max(p.end for p in phases)
        ax.set_yticks([0], ["the GPU" if n == 1 else f"each of\n{n} GPUs"])
        ax.set_ylim(0.5, -0.5)
        ax.set_xlim(0, end * 1.02)
        ax.set_xlabel("time within one step (s)")
        ax.set_title(title or f"One training step on {n} GPU{'s' * (n > 1)}: {end:.2f} s")
        fig.legend(loc="outside lower center", ncol=len(phases))
    return fig


def flop_bars(counts: Mapping[str, float], title: str) -> Figure:
    """Bars of counted FLOPs (in MFLOP), coloured by the phase that opens each label.

    ``counts`` maps a label such as ``"backward: weight gradient"`` to FLOPs;
    the word before the colon picks the colour, so the eye groups the phases.
    """
    with plt.rc_context({**STYLE, "axes.grid.axis": "y"}):
        fig, ax = new_figure((7.0, 3.2))
        labels = list(counts)
        colours = [PHASE_COLOURS[label.split(":")[0]] for label in labels]
        bars = ax.bar(range(len(labels)), [v / 1e6 for v in counts.values()], color=colours)
        ax.bar_label(bars, fmt="%.1f")
        ax.set_xticks(range(len(labels)), [label.replace(": ", ":\n") for label in labels])
        ax.set_ylabel("MFLOP (counted)")
        ax.set_title(title)
    return fig
