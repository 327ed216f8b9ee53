"""figures.batch_size: the noise scale during a run, and the learning rates it predicts."""

import pytest

from trainscale import figures
from trainscale.batch_size import optimal_lr_share
from trainscale.figures.style import svg_text


def _figure():
    return figures.noise_scale_growth(
        [0, 50, 150], [3.5, 2.2, 1.7], [4.0, 30.0, 200.0], 16, "noise", "source: a test"
    )


def test_noise_scale_growth_draws_the_points_and_their_predictions():
    fig = _figure()
    growth, rates = fig.axes
    line = growth.lines[0]
    assert list(line.get_xdata()) == [0, 50, 150]
    assert list(line.get_ydata()) == [4.0, 30.0, 200.0]
    assert growth.get_yscale() == rates.get_yscale() == "log"
    labels = [t.get_text() for t in growth.texts]
    assert labels == ["loss 3.50", "loss 2.20", "loss 1.70", "the run's batch: 16"]
    assert growth.get_ylim()[0] < 4.0 and growth.get_ylim()[1] > 200.0  # every point inside
    curves = [line for line in rates.lines if line.get_label().startswith("step")]
    assert [c.get_label() for c in curves] == ["step 0", "step 50", "step 150"]
    batches, shares = curves[1].get_xdata(), curves[1].get_ydata()
    assert shares[4] == pytest.approx(optimal_lr_share(batches[4], 30.0))
    drawn = svg_text(_figure())
    assert "source: a test" in drawn
    assert drawn == svg_text(_figure())  # byte for byte, as nbval compares it


def test_noise_scale_growth_needs_matching_lists():
    with pytest.raises(ValueError, match="equally long"):
        figures.noise_scale_growth([0, 1], [3.0], [1.0, 2.0], 16, "t", "s")


def _scaling():
    return figures.batch_scaling(
        [0.001, 0.01, 0.1], [0.004, 0.04, 0.33], [1, 4, 16], [0.12, 0.24, 0.44], "scaling"
    )


def test_batch_scaling_draws_both_limits_with_their_reference_lines():
    sgd, adam = _scaling().axes
    assert sgd.get_xscale() == sgd.get_yscale() == adam.get_yscale() == "log"
    measured, proportional = sgd.lines
    assert list(measured.get_ydata()) == [0.004, 0.04, 0.33]
    # through the first point, proportional to the rate: 0.004 x 10 and x 100
    assert list(proportional.get_ydata()) == pytest.approx([0.004, 0.04, 0.4])
    adamw, root, ceiling = adam.lines
    assert list(adamw.get_xdata()) == [1, 4, 16]
    # through the first point, proportional to sqrt(batch): 0.12 x 2 and x 4
    assert list(root.get_ydata()) == pytest.approx([0.12, 0.24, 0.48])
    assert list(ceiling.get_ydata()) == [1.0, 1.0]  # one learning rate per step
    assert svg_text(_scaling()) == svg_text(_scaling())  # byte for byte


def test_batch_scaling_needs_matching_lists():
    with pytest.raises(ValueError, match="equally long"):
        figures.batch_scaling([0.1, 0.2], [0.3], [1, 2], [0.1, 0.2], "t")
    with pytest.raises(ValueError, match="equally long"):
        figures.batch_scaling([0.1, 0.2], [0.3, 0.4], [1], [0.1], "t")
