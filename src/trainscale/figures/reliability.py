"""Figures of chapter 16's failures section: what each checkpoint interval costs, and a
simulated run that checks the formula."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

from trainscale.figures.style import INK, PALETTE, STYLE, new_figure, source_note
from trainscale.reliability import LOST_TIME_PARTS

LOST_COLOURS = dict(
    zip(LOST_TIME_PARTS, (PALETTE["blue"], PALETTE["orange"], PALETTE["grey"]), strict=True)
)
"""One colour per cause of lost time (:data:`trainscale.reliability.LOST_TIME_PARTS`)."""


def _minutes(seconds: Sequence[float]) -> list[float]:
    return [s / 60 for s in seconds]


def _percent(shares: Sequence[float]) -> list[float]:
    return [100 * s for s in shares]


def _check_lengths(intervals: Sequence[float], **series: Sequence[float]) -> None:
    if len(intervals) < 2:
        raise ValueError(f"intervals must hold at least 2 values, got {len(intervals)}")
    for name, values in series.items():
        if len(values) != len(intervals):
            raise ValueError(
                f"{name} must have one value per interval ({len(intervals)}), got {len(values)}"
            )


NICE_TICKS = tuple(m * 10**e for e in range(-2, 5) for m in (1, 2, 5))
"""Tick values on the log axes: 1, 2 and 5 times a power of ten."""


def _log_ticks(axis, low: float, high: float) -> None:
    """Plain-number ticks at :data:`NICE_TICKS` between ``low`` and ``high``, no minor labels."""
    axis.set_major_locator(FixedLocator([t for t in NICE_TICKS if low <= t <= high]))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _axes_style(ax: Axes, title: str, minutes: Sequence[float], percent: tuple[float, float]):
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.grid(True, which="major", axis="both")
    ax.set_xlabel("training between checkpoints (minutes)")
    ax.set_ylabel("wall-clock time lost (%)")
    _log_ticks(ax.xaxis, min(minutes) / 1.01, max(minutes) * 1.01)
    _log_ticks(ax.yaxis, *percent)
    ax.set_title(title, loc="left")


def checkpoint_tradeoff(
    intervals: Sequence[float],
    shares: Mapping[str, Sequence[float]],
    exact: Sequence[float],
    best: tuple[float, float],
    *,
    title: str,
    source: str,
    top_percent: float = 100.0,
) -> Figure:
    """Wall-clock time lost against the checkpoint interval, on log-log axes.

    ``intervals`` in seconds; ``shares`` maps each cause of
    :data:`~trainscale.reliability.LOST_TIME_PARTS` to its first-order share of
    wall-clock time at each interval (:func:`trainscale.reliability.lost_shares`),
    drawn dashed; ``exact`` is the exact lost share
    (:func:`trainscale.reliability.lost_fraction`), drawn solid; ``best`` is the
    ``(interval, lost share)`` of the exact optimum, marked and labelled. The
    y-axis runs up to ``top_percent``.
    """
    _check_lengths(intervals, exact=exact, **{name: v for name, v in shares.items()})
    unknown = set(shares) - set(LOST_TIME_PARTS)
    if unknown:
        raise ValueError(f"shares must be keyed by {LOST_TIME_PARTS}, got {sorted(unknown)}")
    minutes = _minutes(intervals)
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 3.9))
        for name in LOST_TIME_PARTS:
            values = shares.get(name)
            if values is None or not any(v > 0 for v in values):
                continue
            ax.plot(
                minutes,
                _percent(values),
                color=LOST_COLOURS[name],
                linestyle="--",
                linewidth=1.6,
                label=f"{name} (first order)",
            )
        ax.plot(minutes, _percent(exact), color=INK, linewidth=2.2, label="total, exact")
        interval, lost = best
        ax.plot([interval / 60], [100 * lost], "o", color=PALETTE["red"], markersize=7, zorder=5)
        ax.annotate(
            f"best: every {interval / 60:,.0f} min,\n{100 * lost:.2g} % lost",
            (interval / 60, 100 * lost),
            xytext=(0, -14),
            textcoords="offset points",
            ha="center",
            va="top",
            fontsize=9,
            color=PALETTE["red"],
            bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1},
            zorder=6,
        )
        floor = min(100 * lost / 4, 0.1)
        _axes_style(ax, title, minutes, (floor, top_percent))
        ax.set_ylim(floor, top_percent)
        fig.legend(loc="outside upper center", fontsize=8, ncols=3)
        source_note(fig, source, left=True)
    return fig


def simulated_intervals(
    intervals: Sequence[float],
    simulated: Sequence[float],
    exact: Sequence[float],
    young: float,
    *,
    title: str,
    source: str,
) -> Figure:
    """Lost share of a simulated run at each interval (dots) against the exact expectation
    (line), with Young's interval ``sqrt(2 C M)`` (seconds) as a vertical line."""
    _check_lengths(intervals, simulated=simulated, exact=exact)
    if young <= 0:
        raise ValueError(f"young must be an interval in seconds > 0, got {young!r}")
    minutes = _minutes(intervals)
    with plt.rc_context(STYLE):
        fig, ax = new_figure((7.0, 3.6))
        ax.plot(minutes, _percent(exact), color=INK, linewidth=2, label="expected (exact formula)")
        ax.plot(
            minutes,
            _percent(simulated),
            "o",
            color=PALETTE["orange"],
            markersize=6,
            label="simulated run (seeded random failures)",
        )
        ax.axvline(
            young / 60,
            color=PALETTE["blue"],
            linestyle="--",
            linewidth=1.5,
            label=f"$\\sqrt{{2CM}}$ = {young / 60:,.1f} min",
        )
        shown = _percent([*simulated, *exact])
        _axes_style(ax, title, minutes, (min(shown) / 1.01, max(shown) * 1.01))
        fig.legend(loc="outside upper center", fontsize=8, ncols=3)
        source_note(fig, source, left=True)
    return fig
