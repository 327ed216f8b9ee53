"""workers.exercise: the helpers behind the "write it yourself" checkers (the checkers
themselves are tested with their chapters' worker modules)."""

import pytest
import torch

from trainscale.distributed import RankError
from trainscale.workers import exercise


def test_a_report_passes_until_a_problem_is_found():
    report = exercise.ExerciseReport("your thing:")
    report.ok("first check")
    assert report.passed
    assert str(report) == "your thing:\n  ok: first check\npassed"
    report.fail("second check")
    assert not report.passed
    assert str(report).splitlines()[-2:] == [
        "  PROBLEM: second check",
        "not yet: see the problems above",
    ]


def test_a_nested_function_travels_as_dedented_source_and_comes_back():
    def double(x):
        # helper is not defined here: the namespace it is loaded into gives it
        return helper(x) * 2  # noqa: F821

    source, name = exercise.reader_source(double)
    assert name == "double"
    assert source.startswith("def double(x):")
    rebuilt = exercise.load_reader_function(source, name, {"helper": lambda x: x + 1})
    assert rebuilt(3) == 8  # (3 + 1) x 2, with the helper the namespace gave


def test_only_functions_are_accepted():
    with pytest.raises(ValueError, match="function must be a Python function"):
        exercise.reader_source(len)


def test_a_failure_is_told_in_one_line():
    raised = RankError("rank 2 failed (exit code 1):\nTraceback ...\nValueError: bad chunk\n")
    assert exercise.rank_failure(raised, 60, "hint") == "rank 2 failed: ValueError: bad chunk"
    hung = RankError("ranks [0, 1] did not finish within 60 s")
    assert exercise.rank_failure(hung, 60, "a hint") == (
        "the ranks did not finish within 60 s: a hint"
    )


def test_the_bytes_a_rank_puts_in_are_its_input_whatever_the_call_form():
    out, inp = torch.zeros(2), torch.zeros(8)
    # The *_single forms and reduce_scatter take (output, input); the others (tensor, ...).
    assert exercise._contribution("reduce_scatter_single", (out, inp), {}) is inp
    assert exercise._contribution("all_gather_single", (), {"input_tensor": inp}) is inp
    assert exercise._contribution("isend", (inp, 1), {}) is inp
    assert exercise._contribution("all_reduce", (), {"tensor": inp}) is inp
    assert exercise._contribution("all_gather", ([out, out], out), {}) is out
