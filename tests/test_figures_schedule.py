"""figures.schedule: chapter 13's learning-rate schedule, training curves and weight-decay bars."""

import math

from trainscale import figures
from trainscale.figures.style import svg_text
from trainscale.schedule import learning_rate


def test_lr_schedule_draws_the_rates_and_the_checked_points():
    steps = list(range(0, 101, 10))
    rates = [learning_rate(s, 1.0, 20, 80) for s in steps]
    fig = figures.lr_schedule(steps, rates, 20, 80, "schedule", checked={0: rates[0], 50: rates[5]})
    ax = fig.axes[0]
    line, dots = ax.lines[0], ax.lines[1]
    assert list(line.get_xdata()) == steps and list(line.get_ydata()) == rates
    assert list(dots.get_xdata()) == [0, 50]
    assert [t.get_text() for t in ax.texts] == ["end of warmup", "end of decay"]
    assert svg_text(fig) == svg_text(
        figures.lr_schedule(steps, rates, 20, 80, "schedule", checked={0: rates[0], 50: rates[5]})
    )


def test_training_curves_mark_diverged_runs_on_the_top_edge():
    runs = {
        "fine": ((3.0, 2.0, 1.8), (1.0, 0.8, 0.5)),
        "blew up": ((3.0, 50.0, math.nan), (1.0, 80.0, math.nan)),
    }
    fig = figures.training_curves(runs, 1.5, "runs", alarms={"norm alarm": 1})
    loss_ax, norm_ax = fig.axes
    crosses = [line for line in loss_ax.lines if line.get_marker() == "x"]
    assert len(crosses) == 1 and list(crosses[0].get_ydata()) == [20.0]  # top of loss_range
    assert [t.get_text() for t in norm_ax.texts] == ["norm alarm"]
    assert loss_ax.get_yscale() == norm_ax.get_yscale() == "log"
    assert runs["blew up"][0][2] != runs["blew up"][0][2]  # inputs untouched (still NaN)


def test_a_run_stopped_above_the_top_is_marked_at_its_last_step():
    runs = {"stopped": ((3.0, 40.0, 264.0), (1.0, 5.0, 9.0)), "fine": ((3.0, 2.0), (1.0, 0.5))}
    fig = figures.training_curves(runs, 1.5, "runs", loss_range=(1.2, 20), norm_range=(0.1, 100))
    loss_ax, norm_ax = fig.axes
    crosses = [line for line in loss_ax.lines if line.get_marker() == "x"]
    assert len(crosses) == 1 and list(crosses[0].get_xydata()[0]) == [2.0, 20.0]
    assert not [line for line in norm_ax.lines if line.get_marker() == "x"]  # 9 < 100: no cross


def test_decay_bars_one_bar_per_weight_and_optimiser():
    shares = {"Adam + L2": [0.99, 0.26], "AdamW": [0.9, 0.9]}
    fig = figures.decay_bars(shares, ["large", "small"], "decay")
    heights = [round(p.get_height(), 2) for p in fig.axes[0].patches]
    assert heights == [0.99, 0.9, 0.26, 0.9]  # bars are grouped by weight, one per optimiser
