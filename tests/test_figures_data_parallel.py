"""figures.data_parallel: chapter 03's batch split, the same bytes every run."""

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
