"""figures.precision: chapter 12's format ranges, gradient histogram, loss-scale trace,
accumulation and fp8 cast histogram."""

import math

import matplotlib.pyplot as plt
import pytest
import torch
from matplotlib.patches import StepPatch

from trainscale import figures
from trainscale.figures.precision import power_label
from trainscale.figures.style import svg_text
from trainscale.loss_scaling import StepRecord
from trainscale.precision import ScaledCast, float_format


@pytest.fixture
def no_pyplot_figures():
    """Book figures live outside pyplot's registry: drawing one leaves no figure open."""
    plt.close("all")
    yield
    assert plt.get_fignums() == []


def test_power_labels():
    assert power_label(1024.0) == "2^10 = 1,024"
    assert power_label(2.0**30) == "2^30"  # too long to spell out
    assert power_label(2.0**-20) == "2^-20"
    assert power_label(0.3) == "0.3"


def test_format_ranges_draw_subnormal_and_normal_bars(no_pyplot_figures):
    fig = figures.format_ranges([float_format(torch.float16), float_format(torch.bfloat16)])
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "float16\n5 exp + 10 mantissa bits",
        "bfloat16\n8 exp + 7 mantissa bits",
    ]
    subnormal, normal = ax.patches[:2]  # fp16: 2^-24 to 2^-14, then 2^-14 to 65504
    assert subnormal.get_x() == pytest.approx(-24 * math.log10(2))
    assert normal.get_x() == pytest.approx(-14 * math.log10(2))
    assert normal.get_x() + normal.get_width() == pytest.approx(math.log10(65504))
    assert len(ax.patches) == 4
    assert ax.get_title() == "The range of each format: fp16's is narrow"
    titled = figures.format_ranges([float_format(torch.float8_e4m3fn)], title="fp8")
    assert titled.axes[0].get_title() == "fp8"
    svg_text(fig)


def test_gradient_histogram_counts_every_gradient_once(no_pyplot_figures):
    magnitudes = torch.tensor([1e-9, 1e-6, 1e-3, 1e3], dtype=torch.float64)
    fig = figures.gradient_histogram(magnitudes, 1024.0, 0.25, 0.0)
    ax = fig.axes[0]
    assert ax.get_title() == "Scale 2^10 = 1,024: 25.0% round to 0, 0.00% overflow"
    stairs = {p.get_label(): p for p in ax.patches if isinstance(p, StepPatch)}
    assert list(stairs) == ["unscaled", "x 2^10 = 1,024"]
    assert all(sum(p.get_data().values) == pytest.approx(100.0) for p in stairs.values())
    assert ax.get_ylabel() == "% of gradients"
    alone = figures.gradient_histogram(magnitudes, 1.0, 0.25, 0.0)
    assert sum(isinstance(p, StepPatch) for p in alone.axes[0].patches) == 1  # no outline
    svg_text(fig)


def test_loss_scale_trace_marks_the_skipped_steps(no_pyplot_figures):
    ours = [
        StepRecord(2.0**16, False, 1.0, 0.1),
        StepRecord(2.0**17, True, 1.0, 0.0),
        StepRecord(2.0**16, False, 0.9, 0.2),
    ]
    fig = figures.loss_scale_trace(ours, ours, "GradScaler")
    top, bottom = fig.axes
    skipped = next(line for line in top.lines if line.get_label().startswith("step skipped"))
    assert list(skipped.get_xdata()) == [1] and list(skipped.get_ydata()) == [17.0]
    assert [line.get_label() for line in top.lines[:2]] == ["DynamicLossScaler", "GradScaler"]
    assert list(bottom.lines[0].get_ydata()) == pytest.approx([10.0, 0.0, 20.0])
    assert top.get_ylabel() == "log2(loss scale)" and bottom.get_xlabel() == "training step"
    svg_text(fig)


def test_accumulation_draws_one_line_per_format(no_pyplot_figures):
    fig = figures.accumulation({"bf16": [1.0, 1.0, 1.0], "fp32": [1.0, 1.001, 1.002]}, 0.001)
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines] == ["bf16", "fp32"]
    assert list(ax.lines[1].get_ydata()) == [1.0, 1.001, 1.002]
    assert ax.get_xlabel() == "updates of 0.001 added"
    svg_text(fig)


def test_scaled_cast_histogram_draws_the_fp8_bands(no_pyplot_figures):
    e4m3 = float_format(torch.float8_e4m3fn)
    values = torch.tensor([1e-5, -1.0, 100.0, 0.0], dtype=torch.float64)  # the 0 is left out
    fig = figures.scaled_cast_histogram(values, 4.0, e4m3, ScaledCast(0.25, 0.0, 0.0123))
    ax = fig.axes[0]
    assert ax.get_title() == "Scale 2^2 = 4: 25.0% round to 0, 0.00% saturate, error 1.2%"
    (bars,) = (p for p in ax.patches if isinstance(p, StepPatch))
    assert sum(bars.get_data().values) == pytest.approx(100.0)
    zero, subnormal, saturates = ax.patches[:3]  # bands: below 2^-10, to 2^-6, above 448
    assert zero.get_x() + zero.get_width() == pytest.approx(-10 * math.log10(2))
    assert subnormal.get_x() + subnormal.get_width() == pytest.approx(-6 * math.log10(2))
    assert saturates.get_x() == pytest.approx(math.log10(448))
    assert ax.get_xlabel() == "|value| x scale (as stored in float8_e4m3fn)"
    svg_text(fig)
