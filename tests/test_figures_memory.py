"""figures.memory: chapter 2's memory stack against a GPU and activations against the batch."""

import matplotlib.pyplot as plt
import pytest

from trainscale import figures
from trainscale.figures.style import MEMORY_COLOURS, svg_text


@pytest.fixture
def no_pyplot_figures():
    """Book figures live outside pyplot's registry: drawing one leaves no figure open."""
    plt.close("all")
    yield
    assert plt.get_fignums() == []


def test_memory_stack_that_fits_shows_the_free_rest(no_pyplot_figures):
    parts = {"weights": 2.0, "gradients": 2.0, "optimiser state": 4.0}
    fig = figures.memory_stack(parts, 10.0, "small model")
    ax = fig.axes[0]
    assert ax.get_title() == "small model: 8.0 GiB, fits"
    assert [p.get_width() for p in ax.patches] == [2.0, 2.0, 4.0, 2.0]  # the last is free
    assert [p.get_x() for p in ax.patches] == [0.0, 2.0, 4.0, 8.0]
    assert ax.patches[2].get_facecolor() == plt.matplotlib.colors.to_rgba(
        MEMORY_COLOURS["optimiser state"]
    )
    assert [t.get_text() for t in ax.texts] == ["GPU holds 10.0 GiB"]
    assert ax.get_xlabel() == "GiB on one GPU"
    svg_text(fig)


def test_memory_stack_over_capacity_says_by_how_much(no_pyplot_figures):
    fig = figures.memory_stack({"weights": 6.0, "activations": 6.0}, 10.0, "big")
    ax = fig.axes[0]
    assert ax.get_title() == "big: 12.0 GiB, over by 2.0 GiB"
    assert len(ax.patches) == 2  # no free part
    assert ax.get_xlim() == pytest.approx((0.0, 12.0 * 1.05))


def test_activations_against_batch_draws_one_line_per_series(no_pyplot_figures):
    fig = figures.activations_against_batch(
        [1, 2, 4], {"measured": [1.0, 2.0, 4.0], "model": [1, 2, 4]}
    )
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines] == ["measured", "model"]
    assert list(ax.lines[0].get_ydata()) == [1.0, 2.0, 4.0]
    assert list(ax.get_xticks()) == [1, 2, 4]
    assert ax.get_xlabel() == "batch size (examples)"
    svg_text(fig)


def test_state_bars_stack_each_label_and_say_its_total(no_pyplot_figures):
    # bytes per parameter of two recipes: 2 + 2 + 12 = 16 and 2 + 4 + 12 = 18
    parts = {
        "16-bit": {"weights": 2, "gradients": 2, "optimiser state": 12},
        "fp32 gradients": {"weights": 2, "gradients": 4, "optimiser state": 12},
    }
    fig = figures.state_bars(parts, "recipes", unit="bytes per parameter")
    ax = fig.axes[0]
    assert [p.get_height() for p in ax.patches] == [2, 2, 12, 2, 4, 12]
    assert [t.get_text() for t in ax.texts] == ["16", "18"]
    assert ax.get_ylabel() == "bytes per parameter"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16-bit", "fp32 gradients"]
    # against a GPU's capacity each bar says whether it fits, as the ZeRO stages' bars do
    gpu = figures.state_bars({"a": {"weights": 50.0}, "b": {"weights": 90.0}}, "t", capacity=80.0)
    texts = [t.get_text() for t in gpu.axes[0].texts]
    assert texts[:2] == ["50.0 GiB\nfits", "90.0 GiB\ntoo big"] and "80.0" in texts[2]
    with pytest.raises(ValueError, match="parts"):
        figures.state_bars({}, "none")
    svg_text(fig)
