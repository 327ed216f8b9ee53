"""figures.data_parallel: chapter 5's batch split (the same bytes every run) and the
bucket timeline of a measured backward pass."""

import pytest

from trainscale import figures
from trainscale.figures.style import svg_text


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_batch_split_labels_weights_and_errors():
    fig = figures.batch_split([3, 3, 2, 2], 0.41, 2e-7)
    texts = _texts(fig) + [t.get_text() for t in fig.texts]
    assert "3 examples, weight 3/10 = 0.300" in texts
    assert any("off by 41 %" in t and "matches (within 1e-6)" in t for t in texts)
    assert "unequal slices" in fig.axes[0].get_title()


def test_batch_split_is_byte_identical_from_run_to_run():
    assert svg_text(figures.batch_split([3, 3, 2, 2], 0.4, 1e-8)) == svg_text(
        figures.batch_split([3, 3, 2, 2], 0.4, 1e-8)
    )


def test_bucket_timeline_draws_a_lane_per_bucket_under_backward():
    fig = figures.bucket_timeline(
        ["blocks 6-7", "blocks 0-5"], [10.0, 30.0], [25.0, 45.0], 50.0, "one backward pass"
    )
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["backward", "blocks 6-7", "blocks 0-5"]
    widths = sorted(round(p.get_width(), 9) for p in ax.patches)
    # computing 0-30 (until the last launch), waiting 30-50, all-reduces 10-25 and 30-45
    assert widths == [15.0, 15.0, 20.0, 30.0]
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == ["computing gradients", "waiting for all-reduces", "bucket's all-reduce"]
    assert ax.get_title() == "one backward pass"


def test_bucket_timeline_refuses_lists_of_different_lengths():
    with pytest.raises(ValueError, match="equally long"):
        figures.bucket_timeline(["a"], [1.0, 2.0], [3.0], 4.0, "t")
    with pytest.raises(ValueError, match="equally long"):
        figures.bucket_timeline([], [], [], 4.0, "t")
