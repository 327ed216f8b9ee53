"""figures.collectives: chapter 04's four collectives, ring all-reduce and bandwidth curves."""

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
    assert labels == ["busbw = algbw x 2(N-1)/N", "algbw = bytes / time"]
