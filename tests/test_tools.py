"""The scripts under tools/ that ``make`` runs: nbval's notebook order and bench's warnings."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench
import longest_first


def _notebook(path: Path, cell_times: list[tuple[str, str]]) -> Path:
    """A notebook whose code cells ran from each start to each end (ISO times)."""
    cells = [
        {
            "cell_type": "code",
            "metadata": {"execution": {"iopub.execute_input": s, "shell.execute_reply": e}},
        }
        for s, e in cell_times
    ]
    cells.append({"cell_type": "markdown", "metadata": {}})
    path.write_text(json.dumps({"cells": cells}))
    return path


def test_stored_seconds_add_up_the_cells(tmp_path):
    # 1.5 s + 0.25 s = 1.75 s; the gap between the cells is not counted.
    path = _notebook(
        tmp_path / "a.ipynb",
        [
            ("2026-12-01T10:00:00.000000Z", "2026-12-01T10:00:01.500000Z"),
            ("2026-12-01T10:00:05.000000Z", "2026-12-01T10:00:05.250000Z"),
        ],
    )
    assert longest_first.stored_seconds(path) == pytest.approx(1.75)


def test_longest_first_puts_unknown_times_last_and_keeps_name_order_for_ties(tmp_path):
    short = _notebook(tmp_path / "b.ipynb", [("2026-12-01T10:00:00Z", "2026-12-01T10:00:02Z")])
    long = _notebook(tmp_path / "c.ipynb", [("2026-12-01T10:00:00Z", "2026-12-01T10:00:09Z")])
    tie = _notebook(tmp_path / "a.ipynb", [("2026-12-01T10:00:00Z", "2026-12-01T10:00:02Z")])
    unknown = tmp_path / "d.ipynb"
    unknown.write_text(json.dumps({"cells": [{"cell_type": "code", "metadata": {}}]}))
    ordered = longest_first.longest_first([unknown, short, tie, long])
    assert ordered == [long, tie, short, unknown]


def test_the_committed_notebooks_all_have_stored_times():
    notebooks = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
    assert notebooks
    assert all(longest_first.stored_seconds(path) > 0 for path in notebooks)


def test_bench_warns_past_each_mark_and_only_there():
    rows = [
        ("notebook 10_batch_size", bench.NOTEBOOK_WARNING + 0.1),
        ("notebook 01_one_step", bench.NOTEBOOK_WARNING),
        ("notebooks, all in turn", 400.0),  # a sum, not one notebook
        (bench.MAKE_TEST, bench.TEST_WARNING + 1),
    ]
    warned = bench.warnings(rows)
    assert len(warned) == 2
    assert "10_batch_size" in warned[0]
    assert bench.MAKE_TEST in warned[1]
    assert bench.warnings([(bench.MAKE_TEST, bench.TEST_WARNING)]) == []
