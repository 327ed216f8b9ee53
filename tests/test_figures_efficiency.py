"""figures.efficiency: chapter 15's matmul rates, step times, MFU and loader timeline."""

from trainscale import figures
from trainscale.efficiency import loader_timeline
from trainscale.figures import BookFigure, svg_text


def test_figures_draw_and_the_model_timeline_is_stable():
    spans = loader_timeline(1.0, [0.4, 0.4, 0.4, 2.8] * 3, depth=1)
    drawn = [
        figures.matmul_throughput({64: 1e9, 128: 3e9, 256: 4e9}),
        figures.step_durations([0.3, 0.2, 0.1, 0.1], warmup=1),
        figures.mfu_against_batch([1, 4, 16], [0.01, 0.05, 0.2]),
        figures.step_breakdown({"synthetic": (100.0, 0.0), "slow": (100.0, 75.0)}),
        figures.loader_timeline(spans, "depth 1"),
    ]
    assert all(isinstance(fig, BookFigure) for fig in drawn)
    assert svg_text(figures.loader_timeline(spans, "depth 1")) == svg_text(drawn[-1])


def test_restated_utilisation_draws_one_row_per_run_and_refuses_ragged_input():
    import pytest

    fig = figures.restated_utilisation(
        ["a", "b"], [0.43, 0.38], [0.40, 0.16], (0.27, 0.40), "restated"
    )
    assert isinstance(fig, BookFigure)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["a", "b"]
    assert "16.0%" in svg_text(fig)
    with pytest.raises(ValueError, match="labels"):
        figures.restated_utilisation(["a"], [0.4, 0.3], [0.3], (0.2, 0.4), "ragged")
