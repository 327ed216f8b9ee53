"""pipeline: the schedule simulator against hand-worked timelines and the bubble formula."""

import dataclasses
import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainscale.pipeline import (
    BACKWARD,
    FORWARD,
    Op,
    Timeline,
    bubble,
    micro_batches_for_bubble,
    simulate,
)

stages = st.integers(1, 8)
micro_batches = st.integers(1, 40)
times = st.floats(0.01, 100, allow_nan=False, allow_infinity=False)


def _pairs(timeline: Timeline, stage: int) -> list[tuple[str, int]]:
    return [(op.kind, op.micro_batch) for op in timeline.ops[stage]]


# --- hand-worked timelines -------------------------------------------------------------


def test_two_stage_gpipe_by_hand():
    # f = 1, b = 2. Stage 1 can start micro-batch 0 when stage 0 has finished it (t = 1);
    # the backwards start on the last stage as soon as its forwards are done (t = 3).
    timeline = simulate("gpipe", 2, 2)
    assert timeline.ops == (
        (
            Op(FORWARD, 0, 0, 1),
            Op(FORWARD, 1, 1, 2),
            Op(BACKWARD, 0, 5, 7),
            Op(BACKWARD, 1, 7, 9),
        ),
        (
            Op(FORWARD, 0, 1, 2),
            Op(FORWARD, 1, 2, 3),
            Op(BACKWARD, 0, 3, 5),
            Op(BACKWARD, 1, 5, 7),
        ),
    )
    assert timeline.makespan == 9 == (2 + 2 - 1) * 3
    assert timeline.busy == (6, 6) and timeline.idle == (3, 3)
    assert timeline.bubble == 6 / 18 == bubble(2, 2)
    assert timeline.peak_activations == (2, 2)


def test_two_stage_1f1b_by_hand():
    # The last stage runs backward 0 before forward 1, so it never holds two micro-batches.
    timeline = simulate("1f1b", 2, 2)
    assert timeline.ops[1] == (
        Op(FORWARD, 0, 1, 2),
        Op(BACKWARD, 0, 2, 4),
        Op(FORWARD, 1, 4, 5),
        Op(BACKWARD, 1, 5, 7),
    )
    assert timeline.ops[0] == (
        Op(FORWARD, 0, 0, 1),
        Op(FORWARD, 1, 1, 2),
        Op(BACKWARD, 0, 4, 6),
        Op(BACKWARD, 1, 7, 9),
    )
    assert timeline.makespan == 9
    assert timeline.peak_activations == (2, 1)


def test_book_numbers_four_stages():
    # 4 stages: 4 micro-batches leave 3/7 of the step idle, 12 leave 3/15 = 20 %.
    for m, share in [(4, 3 / 7), (12, 3 / 15)]:
        gpipe, one_f_one_b = simulate("gpipe", 4, m), simulate("1f1b", 4, m)
        assert gpipe.bubble == pytest.approx(share, abs=1e-12)
        assert one_f_one_b.bubble == pytest.approx(share, abs=1e-12)
        assert gpipe.makespan == (m + 3) * 3  # slots of forward + backward, f = 1, b = 2
        assert gpipe.peak_activations == (m, m, m, m)
        assert one_f_one_b.peak_activations == (4, 3, 2, 1)
    assert bubble(4, 12) == 0.2


def test_gpipe_first_stage_waits_for_the_last():
    # Stage 0's first backward waits for the forwards to reach the end and come back:
    # (K - 1 + M) forwards, then K - 1 backwards on the later stages.
    timeline = simulate("gpipe", 4, 4, 1, 2)
    first_backward = next(op for op in timeline.ops[0] if op.kind == BACKWARD)
    assert first_backward.start == (4 - 1 + 4) * 1 + (4 - 1) * 2


def test_backward_defaults_to_twice_forward():
    assert simulate("gpipe", 3, 5, 0.5) == simulate("gpipe", 3, 5, 0.5, 1.0)


def test_quiz_answer_eight_stages_under_twenty_percent():
    assert micro_batches_for_bubble(8, 0.2) == 29
    assert bubble(8, 29) < 0.2 <= bubble(8, 28)
    assert micro_batches_for_bubble(4, 0.2) == 13
    assert micro_batches_for_bubble(1, 0.01) == 1
    assert micro_batches_for_bubble(5, 1.0) == 1


def test_gpipe_rule_of_four_micro_batches_per_stage():
    # M = 4K gives (K - 1) / (5K - 1): 3/19 for 4 stages, approaching 1/5 for deep pipelines.
    assert bubble(4, 16) == pytest.approx(3 / 19)
    assert all(bubble(k, 4 * k) < 0.2 for k in range(1, 200))


# --- the formula, for any stages, micro-batches and times -------------------------------


@given(stages, micro_batches, times, times)
def test_gpipe_and_1f1b_bubble_is_the_formula_for_any_times(k, m, f, b):
    gpipe, one_f_one_b = simulate("gpipe", k, m, f, b), simulate("1f1b", k, m, f, b)
    formula = bubble(k, m)
    assert gpipe.bubble == pytest.approx(formula, abs=1e-9)
    assert one_f_one_b.bubble == pytest.approx(formula, abs=1e-9)
    assert gpipe.makespan == pytest.approx((m + k - 1) * (f + b), rel=1e-9)
    assert one_f_one_b.makespan == pytest.approx(gpipe.makespan, rel=1e-9)
    assert all(busy == pytest.approx(m * (f + b), rel=1e-9) for busy in gpipe.busy)


@given(stages, micro_batches)
def test_1f1b_holds_fewer_activations(k, m):
    gpipe, one_f_one_b = simulate("gpipe", k, m), simulate("1f1b", k, m)
    assert gpipe.peak_activations == (m,) * k
    assert one_f_one_b.peak_activations == tuple(min(m, k - s) for s in range(k))
    assert all(
        a <= b for a, b in zip(one_f_one_b.peak_activations, gpipe.peak_activations, strict=True)
    )


@given(st.sampled_from(["gpipe", "1f1b"]), stages, micro_batches, times, times, st.floats(0, 5))
def test_dependencies_are_respected(schedule, k, m, f, b, send):
    timeline = simulate(schedule, k, m, f, b, send=send)
    ends = {(op.kind, s, op.micro_batch): op for s, ops in enumerate(timeline.ops) for op in ops}
    assert len(ends) == 2 * k * m  # every pass of every micro-batch on every stage, once
    tolerance = 1e-9 * timeline.makespan
    for s, ops in enumerate(timeline.ops):
        expected = [(kind, i) for kind in (BACKWARD, FORWARD) for i in range(m)]
        assert sorted(_pairs(timeline, s)) == expected
        for before, after in itertools.pairwise(ops):  # one pass at a time, in order
            assert after.start >= before.end - tolerance
        for op in ops:
            assert op.end - op.start == pytest.approx(f if op.kind == FORWARD else b)
            if op.kind == FORWARD and s > 0:
                assert op.start >= ends[(FORWARD, s - 1, op.micro_batch)].end + send - tolerance
            if op.kind == BACKWARD:
                if s < k - 1:
                    previous = ends[(BACKWARD, s + 1, op.micro_batch)].end + send
                else:
                    previous = ends[(FORWARD, s, op.micro_batch)].end
                assert op.start >= previous - tolerance


@given(stages, micro_batches, times, st.floats(0.001, 10))
def test_sends_add_two_trips_through_the_pipeline_to_gpipe(k, m, f, send):
    gpipe = simulate("gpipe", k, m, f, send=send)
    assert gpipe.makespan == pytest.approx((m + k - 1) * 3 * f + 2 * (k - 1) * send, rel=1e-9)
    # 1F1B crosses between stages more often on its critical path
    assert simulate("1f1b", k, m, f, send=send).makespan >= gpipe.makespan * (1 - 1e-9)


def test_edges():
    assert simulate("gpipe", 1, 7).bubble == 0  # one stage never waits
    assert simulate("1f1b", 1, 7).peak_activations == (1,)
    assert simulate("gpipe", 6, 1).bubble == pytest.approx(5 / 6)  # one micro-batch: serial
    big = simulate("1f1b", 4, 1000)
    assert big.bubble == pytest.approx(3 / 1003)
    assert big.peak_activations == (4, 3, 2, 1)
    empty = Timeline("gpipe", 2, 0, ((), ()))
    assert empty.makespan == 0 and empty.bubble == 0 and empty.peak_activations == (0, 0)


# --- interleaved 1F1B -----------------------------------------------------------------


@given(st.integers(1, 6), st.integers(1, 5), st.integers(2, 4))
def test_interleaved_bubble_is_divided_by_the_chunks(k, groups, v):
    m = k * groups
    timeline = simulate("interleaved", k, m, 1.0, 2.0, chunks=v)
    assert timeline.bubble == pytest.approx(bubble(k, m, v), abs=1e-9)
    assert timeline.bubble <= bubble(k, m) + 1e-12
    assert {op.chunk for ops in timeline.ops for op in ops} == set(range(v))
    assert all(len(ops) == 2 * m * v for ops in timeline.ops)
    if m >= 2 * k:  # Megatron's warm-up: the first device holds K + (K - 1) / v micro-batches
        assert timeline.peak_activations[0] == pytest.approx(k + (k - 1) / v)


def test_bubble_formula_by_hand():
    # (p - 1) / (v m + p - 1): GPipe and 1F1B with v = 1, Megatron's interleaving with v > 1.
    assert bubble(4, 4) == 3 / 7
    assert bubble(4, 12) == 3 / 15 == 0.2
    assert bubble(1, 1) == 0.0
    assert bubble(4, 8, 1) == 3 / 11
    assert bubble(4, 8, virtual_stages=2) == 3 / 19
    assert bubble(8, 64, 4) == 7 / 263


@given(st.integers(1, 10**6), st.integers(1, 10**6), st.integers(1, 8))
def test_bubble_is_a_share_and_shrinks_with_micro_batches_and_chunks(p, m, v):
    share = bubble(p, m, v)
    assert 0.0 <= share < 1.0
    assert bubble(p, m + 1, v) <= share and bubble(p, m, v + 1) <= share


# --- bad arguments ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"schedule": "pipedream"}, "schedule"),
        ({"stages": 0}, "stages"),
        ({"stages": 2.5}, "stages"),
        ({"micro_batches": 0}, "micro_batches"),
        ({"forward": 0}, "forward"),
        ({"forward": math.nan}, "forward"),
        ({"backward": -1}, "backward"),
        ({"chunks": 2}, "chunks"),
        ({"schedule": "interleaved", "chunks": 1}, "chunks"),
        ({"schedule": "interleaved", "chunks": 2, "micro_batches": 6}, "micro_batches"),
        ({"send": -0.1}, "send"),
        ({"send": math.inf}, "send"),
        ({"send": True}, "send"),
        ({"send": "0"}, "send"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, name):
    arguments = {"schedule": "gpipe", "stages": 4, "micro_batches": 8, **kwargs}
    with pytest.raises(ValueError, match=name):
        simulate(**arguments)


def test_bad_arguments_of_the_formulas():
    with pytest.raises(ValueError, match="bubble"):
        micro_batches_for_bubble(4, 0)
    with pytest.raises(ValueError, match="bubble"):
        micro_batches_for_bubble(4, 1.5)
    with pytest.raises(ValueError, match="stages"):
        micro_batches_for_bubble(0, 0.2)
    for args, name in (((0, 4), "stages"), ((4, 0), "micro_batches"), ((4, 8, 0), "virtual")):
        with pytest.raises(ValueError, match=name):
            bubble(*args)


@given(st.integers(1, 64), st.floats(1e-4, 1.0))
def test_fewest_micro_batches_is_the_fewest(k, target):
    m = micro_batches_for_bubble(k, target)
    assert bubble(k, m) < target
    assert m == 1 or bubble(k, m - 1) >= target


def test_timelines_are_immutable():
    timeline = simulate("gpipe", 2, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        timeline.stages = 3
    assert isinstance(timeline.ops, tuple) and isinstance(timeline.ops[0], tuple)
