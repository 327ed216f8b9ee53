"""figures.collectives: chapter 6's four collectives, ring all-reduce and bandwidth curves."""

import pytest
from matplotlib.patches import Rectangle

from trainscale import figures
from trainscale.collectives import ring_all_reduce_trace
from trainscale.figures.style import svg_text


def _four(ranks: int = 4) -> list[dict]:
    total = [sum(10 * r + k for r in range(ranks)) for k in range(ranks)]
    return [
        {
            "all-reduce": {"input": [10 * r + k for k in range(ranks)], "output": total},
            "reduce-scatter": {"input": [10 * r + k for k in range(ranks)], "output": [total[r]]},
            "all-gather": {"input": [total[r]], "output": total},
            "broadcast": {
                "input": [10 * r + k for k in range(ranks)],
                "output": list(range(ranks)),
            },
        }
        for r in range(ranks)
    ]


def _texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes for t in ax.texts]


def test_four_collectives_draws_every_value_once_per_cell():
    fig = figures.four_collectives(_four())
    assert [ax.get_title() for ax in fig.axes] == [
        "all-reduce",
        "reduce-scatter",
        "all-gather",
        "broadcast",
    ]
    cells = sum(isinstance(p, Rectangle) for ax in fig.axes for p in ax.patches)
    assert cells == 16 + 16 + 16 + 4 + 4 + 16 + 16 + 16
    assert _texts(fig).count("60") == 4 + 1 + 1 + 4  # all-reduce, reduce-scatter, all-gather


def test_ring_stages_show_one_complete_chunk_per_rank_after_reduce_scatter():
    fig = figures.ring_stages(ring_all_reduce_trace(4))
    start, middle, end = ([t.get_text() for t in ax.texts] for ax in fig.axes)
    assert start.count("Σ") == 0
    assert middle.count("Σ") == 4
    assert end.count("Σ") == 16


@pytest.mark.parametrize(
    ("index", "phrase"),
    [
        (0, "start"),
        (2, "reduce-scatter step 2 of 3"),
        (4, "all-gather step 1 of 3"),
        (8, "finished"),
    ],
)
def test_ring_step_titles(index, phrase):
    fig = figures.ring_step(ring_all_reduce_trace(4), index)
    assert phrase in fig.axes[0].get_title(loc="left")


def test_ring_step_marks_the_cells_just_received():
    fig = figures.ring_step(ring_all_reduce_trace(4), 1)
    thick = [p for p in fig.axes[0].patches if p.get_linewidth() > 1]
    assert len(thick) == 4  # every rank received one chunk


def test_ring_step_is_byte_identical_from_run_to_run():
    trace = ring_all_reduce_trace(3)
    assert svg_text(figures.ring_step(trace, 2)) == svg_text(figures.ring_step(trace, 2))


def test_bandwidth_figure_has_both_curves():
    fig = figures.bandwidth_against_size([4096, 2**20], [0.01, 0.5], [0.015, 0.75], 4)
    labels = [line.get_label() for line in fig.axes[0].get_lines()]
    assert labels == ["busbw = algbw x 2(n-1)/n", "algbw = bytes / time"]


def test_alpha_beta_figure_draws_the_points_the_fit_and_both_terms():
    from trainscale.collectives import AlphaBeta

    fit = AlphaBeta(latency=1e-3, bandwidth=1e9, ranks=4)  # S* = 4 MB
    sizes = [4096, 2**20, 16 * 2**20]
    fig = figures.alpha_beta_fit(sizes, [fit.seconds(s) for s in sizes], fit)
    ax = fig.axes[0]
    lines = ax.get_lines()
    measured, model, latency, bandwidth, crossover = lines
    assert list(measured.get_xdata()) == sizes
    assert list(measured.get_ydata()) == pytest.approx([fit.seconds(s) * 1e3 for s in sizes])
    assert list(latency.get_ydata()) == pytest.approx([6.0] * 61)  # 2 x 3 x 1 ms
    assert list(crossover.get_xdata()) == [pytest.approx(4e6)] * 2
    # The two terms add up to the model everywhere.
    total = [a + b for a, b in zip(latency.get_ydata(), bandwidth.get_ydata(), strict=True)]
    assert total == pytest.approx(list(model.get_ydata()))
    assert ax.get_yscale() == "log"


def test_alpha_beta_figure_labels_several_ticks_within_one_decade():
    # Issue #25: a log axis spanning less than a decade showed one tick label ("10^1").
    from trainscale.collectives import AlphaBeta

    fit = AlphaBeta(latency=1e-3, bandwidth=1e9, ranks=4)
    sizes = [4096, 65536, 2**20]  # 6.0 to 6.8 ms: well inside one decade
    fig = figures.alpha_beta_fit(sizes, [fit.seconds(s) for s in sizes], fit)
    ax = fig.axes[0]
    fig.canvas.draw()
    low, high = ax.get_ylim()
    shown = [t.get_text() for t in ax.get_yticklabels() if low <= t.get_position()[1] <= high]
    assert len([text for text in shown if text]) >= 3, shown
    assert "What this CPU shows" in ax.get_title()


def test_exposed_communication_shades_only_where_an_all_reduce_is_longer():
    from trainscale.collectives import data_parallel_step, dp_hiding_threshold_tokens

    tokens = [2.0**k for k in range(8, 17)]
    sizes = {"bf16": 2, "fp32": 4}
    steps = {
        d: [data_parallel_step(7e9, t, 8, b, 1e15, 0.4, 100e9) for t in tokens]
        for d, b in sizes.items()
    }
    thresholds = {d: dp_hiding_threshold_tokens(8, b, 1e15, 0.4, 100e9) for d, b in sizes.items()}
    fig = figures.exposed_communication(tokens, steps, thresholds, "100 GB/s", 16384)
    ax = fig.axes[0]
    backward, bf16, bf16_threshold, fp32, fp32_threshold, marked = ax.get_lines()
    assert backward.get_ydata()[0] == pytest.approx(4 * 7e9 * 256 / 4e14)  # 0.0448 s
    assert list(bf16.get_ydata()) == pytest.approx([0.245] * len(tokens))  # 7/4 x 14 GB / 100 GB/s
    assert list(fp32.get_ydata()) == pytest.approx([0.49] * len(tokens))
    assert list(bf16_threshold.get_xdata()) == [pytest.approx(3500)] * 2
    assert list(fp32_threshold.get_xdata()) == [pytest.approx(7000)] * 2
    assert list(marked.get_xdata()) == [16384] * 2
    labels = " ".join(t.get_text() for t in ax.texts)
    assert "bf16 hides from 3,500 tokens" in labels
    assert "fp32 hides from 7,000 tokens" in labels
    # Each exposed region ends where its all-reduce crosses backward.
    for shade, end in zip(ax.collections, (3500, 7000), strict=True):
        xs = shade.get_paths()[0].vertices[:, 0]
        assert xs.min() == pytest.approx(256)
        assert xs.max() == pytest.approx(end)
    again = figures.exposed_communication(tokens, steps, thresholds, "100 GB/s", 16384)
    assert svg_text(fig) == svg_text(again)
