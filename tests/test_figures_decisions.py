"""figures.decisions: chapter 16's "which parallelism?" flowchart and failure intervals."""

import json
import re
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainscale import figures, reliability
from trainscale.figures import BookFigure, svg_text
from trainscale.figures.decisions import WHICH_PARALLELISM, Leaf, Question, walk

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "a test"


@pytest.fixture
def no_pyplot_figures():
    """Book figures live outside pyplot's registry: drawing one leaves no figure open."""
    plt.close("all")
    yield
    assert plt.get_fignums() == []


def _leaves(tree: Question) -> list[Leaf]:
    return [node for node in walk(tree) if isinstance(node, Leaf)]


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text"))]


# --- the tree --------------------------------------------------------------------------------


def test_every_chapter_the_flowchart_names_exists():
    chapters = {c for leaf in _leaves(WHICH_PARALLELISM) for c in leaf.chapters}
    assert chapters == {3, 5, 6, 7, 8, 9, 10, 11, 15, 16}
    for chapter in chapters:
        assert list((ROOT / "notebooks").glob(f"{chapter:02d}_*.ipynb")), chapter


def test_every_leaf_is_reachable_and_each_question_adds_something():
    # Collected by hand from the module, independently of walk(): every Leaf object it defines.
    import trainscale.figures.decisions as decisions

    defined = {id(v) for v in vars(decisions).values() if isinstance(v, Leaf)}
    defined |= {
        id(leaf)
        for v in vars(decisions).values()
        if isinstance(v, Question)
        for leaf in (v.yes, v.no, v.then)
        if isinstance(leaf, Leaf)
    }
    reached = {id(leaf) for leaf in _leaves(WHICH_PARALLELISM)}
    assert defined <= reached
    assert len(reached) == 7  # DDP, FSDP, TP, PP, CP, EP, and the end
    questions = [n for n in walk(WHICH_PARALLELISM) if isinstance(n, Question)]
    assert len(questions) == 5
    assert all(q.yes is not None or q.no is not None for q in questions)


def _decision_table() -> dict[str, set[int]]:
    """The cheat sheet's "Which parallelism, in order" table: each row's chapters."""
    cells = json.loads((ROOT / "book" / "cheat_sheet.ipynb").read_text())["cells"]
    text = next(
        "".join(c["source"]) for c in cells if "## Which parallelism" in "".join(c["source"])
    )
    rows = {}
    for line in text.splitlines():
        match = re.match(r"\| (\w+ parallelism)", line)
        if match:
            chapters = line.rsplit("|", 2)[-2]
            rows[match.group(1)] = {int(n) for n in re.findall(r"\{doc\}`(\d+) <", chapters)}
    return rows


def test_the_leaves_follow_the_decision_tables_rows_and_chapters():
    table = _decision_table()
    assert set(table) == {
        "data parallelism",
        "tensor parallelism",
        "pipeline parallelism",
        "context parallelism",
        "expert parallelism",
    }
    by_row: dict[str, set[int]] = {}
    for leaf in _leaves(WHICH_PARALLELISM):
        if leaf.row is not None:
            by_row.setdefault(leaf.row, set()).update(leaf.chapters)
    assert by_row == table


# --- the flowchart ---------------------------------------------------------------------------


def test_the_flowchart_draws_every_question_and_leaf_and_is_deterministic(no_pyplot_figures):
    fig = figures.parallelism_flowchart(source=SOURCE)
    assert isinstance(fig, BookFigure)
    text = " ".join(t.replace("\n", " ") for t in _texts(fig))
    for node in walk(WHICH_PARALLELISM):
        words = node.text if isinstance(node, Question) else node.title
        assert words in text
    assert "chapters 7, 3" in text and "chapter 11" in text
    assert sum(t == "yes" for t in _texts(fig)) == 5 and sum(t == "no" for t in _texts(fig)) == 1
    again = figures.parallelism_flowchart(source=SOURCE)
    assert svg_text(fig) == svg_text(again)


def test_the_flowchart_refuses_a_bad_tree_or_source(no_pyplot_figures):
    end = Leaf("end", "", (1,), None)
    with pytest.raises(ValueError, match="source"):
        figures.parallelism_flowchart(source=" ")
    with pytest.raises(ValueError, match="tree"):
        figures.parallelism_flowchart(end, source=SOURCE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tree"):
        figures.parallelism_flowchart(Question("idle?", None, None, end), source=SOURCE)


# --- failure intervals -----------------------------------------------------------------------

GPUS = [8 * 2**k for k in range(12)]  # 8 to 16,384


def test_the_failure_figures_points_are_the_reliability_functions(no_pyplot_figures):
    gpu_mtbf = reliability.gpu_mtbf_seconds(419, 54, 16_384)
    mtbf = [reliability.job_mtbf_seconds(gpu_mtbf, n) for n in GPUS]
    young = [reliability.young_interval(60, m) for m in mtbf]
    fig = figures.failure_intervals(GPUS, mtbf, young, save_seconds=60, title="t", source=SOURCE)
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.lines}
    assert list(lines["job MTBF"].get_xdata()) == GPUS
    assert list(lines["job MTBF"].get_ydata()) == pytest.approx([m / 3600 for m in mtbf])
    drawn = lines["checkpoint interval $\\sqrt{2CM}$, C = 60 s"].get_ydata()
    assert list(drawn) == pytest.approx([t / 3600 for t in young])
    # By hand: 54 days x 86,400 s x 16,384 GPUs / 419 = 182,440,400 s per GPU; on 16,384 GPUs
    # that is 11,135 s = 3.09 h, and sqrt(2 x 60 x 11,135) = 1,156 s = 0.321 h.
    assert lines["job MTBF"].get_ydata()[-1] == pytest.approx(3.093, abs=1e-3)
    assert drawn[-1] == pytest.approx(0.321, abs=1e-3)
    assert (ax.get_xscale(), ax.get_yscale()) == ("log", "log")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "64", "512", "4,096", "16,384"]
    assert fig._supxlabel.get_text() == SOURCE
    assert svg_text(fig) == svg_text(
        figures.failure_intervals(GPUS, mtbf, young, save_seconds=60, title="t", source=SOURCE)
    )


@given(st.integers(min_value=2, max_value=14), st.floats(min_value=1.0, max_value=3_600.0))
def test_any_range_of_sizes_draws_both_lines_falling(doublings, save):
    gpus = [2**k for k in range(doublings + 1)]
    mtbf = [reliability.job_mtbf_seconds(1e8, n) for n in gpus]
    young = [reliability.young_interval(save, m) for m in mtbf]
    fig = figures.failure_intervals(gpus, mtbf, young, save_seconds=save, title="", source="s")
    for line in fig.axes[0].lines:
        ys = list(line.get_ydata())
        assert ys == sorted(ys, reverse=True)
    plt.close("all")


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (([8], [1.0], [1.0]), "gpus"),
        (([8, 16], [1.0], [1.0, 1.0]), "job_mtbf"),
        (([8, 16], [1.0, 1.0], [1.0, 0.0]), "checkpoint_interval"),
        (([0, 16], [1.0, 1.0], [1.0, 1.0]), "gpus"),
    ],
)
def test_the_failure_figure_refuses_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        figures.failure_intervals(*args, save_seconds=60, title="", source="s")
    with pytest.raises(ValueError, match="source"):
        figures.failure_intervals([8, 16], [1, 1], [1, 1], save_seconds=60, title="", source="")
