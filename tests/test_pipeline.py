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
    INPUT,
    WEIGHT,
    Op,
    Timeline,
    break_even_overhead,
    bubble,
    bubble_zb_h1,
    chain_length,
    check_1f1b,
    micro_batches_for_bubble,
    one_f_one_b_order,
    overhead_for_step,
    replay,
    simulate,
    torch_1f1b_orders,
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
        ({"schedule": "zb-v", "chunks": 3}, "chunks"),
        ({"schedule": "zb-h1", "chunks": 2}, "chunks"),
        ({"schedule": "zb-h1", "backward": 2, "weight": 2}, "weight"),
        ({"schedule": "zb-v", "weight": 0}, "weight"),
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


# --- zero-bubble schedules: the backward split into input (B) and weight (W) passes -------


def test_two_stage_zb_h1_by_hand():
    # F = B = W = 1 (forward 1, backward 2 of which weight 1). Stage 1 computes the loss:
    # F0 1-2, B0 2-3, F1 3-4, B1 4-5, then its delayed W0 5-6 and W1 6-7. Stage 0 starts
    # B0 when stage 1's B0 ends (3): B0 3-4, W0 4-5, B1 5-6, W1 6-7. Idle 1 per stage of 7.
    timeline = simulate("zb-h1", 2, 2)
    assert timeline.ops == (
        (
            Op(FORWARD, 0, 0, 1),
            Op(FORWARD, 1, 1, 2),
            Op(INPUT, 0, 3, 4),
            Op(WEIGHT, 0, 4, 5),
            Op(INPUT, 1, 5, 6),
            Op(WEIGHT, 1, 6, 7),
        ),
        (
            Op(FORWARD, 0, 1, 2),
            Op(INPUT, 0, 2, 3),
            Op(FORWARD, 1, 3, 4),
            Op(INPUT, 1, 4, 5),
            Op(WEIGHT, 0, 5, 6),
            Op(WEIGHT, 1, 6, 7),
        ),
    )
    assert timeline.makespan == 7 and timeline.idle == (1, 1)
    assert timeline.bubble == 2 / 14 == bubble_zb_h1(2, 2)
    assert timeline.peak_activations == (2, 2)  # held until the weight pass


def test_zb_h1_formula_by_hand():
    # (p - 1)(F + B - W) / (m (F + B + W) + (p - 1)(F + B - W))
    assert bubble_zb_h1(4, 8) == 3 / (8 * 3 + 3) == 1 / 9  # F = B = W = 1
    assert bubble_zb_h1(4, 8, 1, 3, 1) == 6 / (8 * 4 + 6) == 3 / 19  # B = 2
    assert bubble_zb_h1(1, 5) == 0.0
    # a third of 1F1B's idle time when the three passes are equal: 3 of 9 for 4 stages
    assert simulate("1f1b", 4, 8).idle[0] == 9 and simulate("zb-h1", 4, 8).idle[0] == 3


@given(st.integers(1, 8), st.integers(0, 24), times, times, st.floats(0.05, 1.0))
def test_zb_h1_bubble_is_the_formula_within_its_conditions(k, extra, f, b_input, share):
    m = k + extra  # at least as many micro-batches as stages
    w = share * min(f, b_input)  # the weight pass no longer than the forward or input pass
    timeline = simulate("zb-h1", k, m, f, b_input + w, weight=w)
    assert timeline.bubble == pytest.approx(bubble_zb_h1(k, m, f, b_input + w, w), abs=1e-9)
    idle = (k - 1) * (f + b_input - w)
    assert all(i == pytest.approx(idle, rel=1e-9, abs=1e-9) for i in timeline.idle)
    assert timeline.makespan <= simulate("1f1b", k, m, f, b_input + w).makespan * (1 + 1e-9)


def test_zb_v_by_the_simulator():
    # 4 devices, 8 micro-batches, F = B = W: chunks of half a stage, and device 3 (virtual
    # stages 3 and 4) waits for the first forward to cross 3 half-stages: 1.5 idle of 25.5.
    timeline = simulate("zb-v", 4, 8)
    assert timeline.chunks == 2
    assert timeline.makespan == 25.5 and timeline.idle == (1.5,) * 4
    assert timeline.bubble == pytest.approx(6 / 102)
    assert timeline.peak_activations == (4, 4, 4, 4)  # 1F1B's first stage, on every device
    assert timeline.bubble < simulate("zb-h1", 4, 8).bubble < simulate("1f1b", 4, 8).bubble
    first_device = {(op.chunk, op.kind) for op in timeline.ops[0]}
    assert (1, INPUT) in first_device  # device 0 holds the last virtual stage: the loss


@given(st.sampled_from(["zb-h1", "zb-v"]), stages, micro_batches, times, times, st.floats(0, 5))
def test_zero_bubble_dependencies_are_respected(schedule, k, m, f, b, send):
    w = b / 3
    timeline = simulate(schedule, k, m, f, b, weight=w, send=send)
    v = timeline.chunks
    last = v * k - 1
    passes = {}  # (kind, virtual stage, micro-batch) -> (device, op)
    for device, ops in enumerate(timeline.ops):
        for op in ops:
            virtual = 2 * k - 1 - device if op.chunk else device  # ZB-V's V placement
            passes[(op.kind, virtual, op.micro_batch)] = (device, op)
    assert len(passes) == 3 * v * k * m  # F, B and W of every micro-batch on every piece
    tolerance = 1e-9 * max(1.0, timeline.makespan)
    for (kind, virtual, mb), (device, op) in passes.items():
        duration = {FORWARD: f, INPUT: b - w, WEIGHT: w}[kind] / v
        assert op.end - op.start == pytest.approx(duration)
        if kind == FORWARD and virtual > 0:
            other, before = passes[(FORWARD, virtual - 1, mb)]
            assert op.start >= before.end + (send if other != device else 0) - tolerance
        if kind == INPUT:
            key = (INPUT, virtual + 1, mb) if virtual < last else (FORWARD, virtual, mb)
            other, before = passes[key]
            assert op.start >= before.end + (send if other != device else 0) - tolerance
        if kind == WEIGHT:
            assert op.start >= passes[(INPUT, virtual, mb)][1].end - tolerance
    for ops in timeline.ops:
        for before, after in itertools.pairwise(ops):
            assert after.start >= before.end - tolerance


def test_zb_h1_formula_refuses_arguments_outside_its_conditions():
    with pytest.raises(ValueError, match="micro_batches must be at least stages"):
        bubble_zb_h1(4, 3)
    with pytest.raises(ValueError, match="weight"):
        bubble_zb_h1(4, 8, forward=1, backward=3, weight=1.5)  # W > F
    with pytest.raises(ValueError, match="weight"):
        bubble_zb_h1(4, 8, forward=2, backward=1.5, weight=1)  # W > B = 0.5
    for kwargs, name in (({"stages": 0}, "stages"), ({"forward": 0}, "forward")):
        with pytest.raises(ValueError, match=name):
            bubble_zb_h1(**{"stages": 4, "micro_batches": 8, **kwargs})


def _torch_orders(schedule: str, stages: int, micro_batches: int) -> list:
    """What PyTorch's zero-bubble schedule runs on each rank, as (kind, chunk, micro-batch).

    The schedule is built without processes: a stage that knows only its place.
    """
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import _PipelineStageBase

    class Placed(_PipelineStageBase):
        def __init__(self, index: int, count: int) -> None:
            self.stage_index, self.num_stages = index, count
            self.group_size, self.group_rank = stages, 0
            self.submod, self.has_backward, self.dw_builder = None, True, None
            self.stage_index_to_group_rank = {}

        def _create_grad_recv_info(self, *args, **kwargs): ...
        def _prepare_backward_infra(self, *args, **kwargs): ...
        def _prepare_forward_infra(self, *args, **kwargs): ...

    if schedule == "zb-h1":
        placed = [Placed(0, stages)]
        built = schedules.ScheduleInterleavedZeroBubble(placed, micro_batches)
    else:
        placed = [Placed(0, 2 * stages), Placed(2 * stages - 1, 2 * stages)]
        built = schedules.ScheduleZBVZeroBubble(placed, micro_batches)
    kinds = {"F": FORWARD, "I": INPUT, "W": WEIGHT}
    return [
        [
            (
                kinds[str(a)[len(str(a.stage_index))]],
                int(a.stage_index >= stages),
                a.microbatch_index,
            )
            for a in built.pipeline_order[rank]
            if a is not None
        ]
        for rank in range(stages)
    ]


@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
@pytest.mark.parametrize(("k", "m"), [(2, 2), (3, 5), (3, 3), (4, 4), (4, 8), (4, 12), (5, 7)])
def test_zero_bubble_orders_are_pytorchs(schedule, k, m):
    timeline = simulate(schedule, k, m)
    ours = [[(op.kind, op.chunk, op.micro_batch) for op in ops] for ops in timeline.ops]
    assert ours == _torch_orders(schedule, k, m)


# --- replaying an order (how the chapter simulates DualPipeV from PyTorch's order) ---------


def test_replay_plays_an_order_again_with_other_times():
    zb_h1 = simulate("zb-h1", 4, 8)
    assert replay(zb_h1) == zb_h1
    slower = replay(zb_h1, 1, 3, weight=1)  # B = 2: the same order, longer input passes
    assert slower == simulate("zb-h1", 4, 8, 1, 3, weight=1)
    assert replay(simulate("1f1b", 3, 5), send=0.5) == simulate("1f1b", 3, 5, send=0.5)
    # DualPipeV is placed in a V, like ZB-V: the same order plays the same way
    zb_v = simulate("zb-v", 2, 4)
    as_dualpipev = dataclasses.replace(zb_v, schedule="dualpipev")
    assert replay(as_dualpipev, send=0.25).ops == simulate("zb-v", 2, 4, send=0.25).ops


def test_replay_refuses_an_order_that_deadlocks_and_bad_times():
    # stage 1 runs its backward before its forward: it waits for itself
    stuck = Timeline(
        "1f1b", 2, 1, ((Op(FORWARD, 0, 0, 1), Op(BACKWARD, 0, 3, 5)), (Op(BACKWARD, 0, 1, 3),))
    )
    with pytest.raises(ValueError, match="deadlocks"):
        replay(stuck)
    with pytest.raises(ValueError, match="weight"):
        replay(simulate("zb-h1", 2, 2), 1, 2, weight=2)
    with pytest.raises(ValueError, match="forward"):
        replay(simulate("zb-h1", 2, 2), 0)


# --- an overhead per pass: what the chapter measures beyond the compute --------------------


def test_two_stage_1f1b_with_an_overhead_by_hand():
    # f = 1, b = 2, o = 0.5: every pass starts 0.5 after it could. Stage 0: F0 0.5-1.5,
    # F1 2-3; stage 1: F0 2-3, B0 3.5-5.5, F1 6-7, B1 7.5-9.5; stage 0: B0 6-8, B1 10-12.
    # (M + K - 1)(f + b + 2o) = 3 x 4 = 12.
    timeline = simulate("1f1b", 2, 2, overhead=0.5)
    assert timeline.ops == (
        (
            Op(FORWARD, 0, 0.5, 1.5),
            Op(FORWARD, 1, 2, 3),
            Op(BACKWARD, 0, 6, 8),
            Op(BACKWARD, 1, 10, 12),
        ),
        (
            Op(FORWARD, 0, 2, 3),
            Op(BACKWARD, 0, 3.5, 5.5),
            Op(FORWARD, 1, 6, 7),
            Op(BACKWARD, 1, 7.5, 9.5),
        ),
    )
    assert timeline.busy == (6, 6)  # the overhead is idle time, as in a measured timeline


def test_the_chapters_steps_with_an_overhead_by_hand():
    # K = 4, M = 8, F = B = W = 1: 1F1B (M + K - 1)(F + B + W + 2o) = 33 + 22 o;
    # ZB-H1 M(F + B + W) + (K - 1)(F + B - W) = 27 with 27 passes on its longest chain,
    # 27 + 27 o; ZB-V 25.5 + 51 o (48 half-length passes per device and the 3 of the skew)
    for o in (0.25, 0.5, 2):
        assert simulate("1f1b", 4, 8, overhead=o).makespan == pytest.approx(33 + 22 * o)
        assert simulate("zb-h1", 4, 8, overhead=o).makespan == pytest.approx(27 + 27 * o)
        assert simulate("zb-v", 4, 8, overhead=o).makespan == pytest.approx(25.5 + 51 * o)
    chains = [chain_length(simulate(name, 4, 8)) for name in ("1f1b", "zb-h1", "zb-v")]
    assert chains == [22, 27, 51]
    one_f_one_b = simulate("1f1b", 4, 8)
    # 33 + 22 o = 27 + 27 o at o = 6/5; 33 + 22 o = 25.5 + 51 o at o = 7.5/29
    assert break_even_overhead(simulate("zb-h1", 4, 8), one_f_one_b) == pytest.approx(1.2)
    assert break_even_overhead(simulate("zb-v", 4, 8), one_f_one_b) == pytest.approx(7.5 / 29)
    # in seconds, with F = 40 ms: 48 ms; the answer scales with the pass times
    limit = break_even_overhead(simulate("zb-h1", 4, 8), one_f_one_b, 0.04)
    assert limit == pytest.approx(0.048)


@given(st.sampled_from(["gpipe", "1f1b"]), stages, micro_batches, times, times, times)
def test_gpipe_and_1f1b_pay_the_overhead_twice_per_slot(schedule, k, m, f, b, o):
    # the longest chain: M + K - 1 slots of one forward and one backward
    timeline = simulate(schedule, k, m, f, b, overhead=o)
    assert timeline.makespan == pytest.approx((m + k - 1) * (f + b + 2 * o))
    assert chain_length(simulate(schedule, k, m)) == 2 * (m + k - 1)


@given(
    st.sampled_from(["1f1b", "zb-h1", "zb-v", "interleaved"]),
    st.integers(2, 4),
    st.integers(1, 3),
    st.floats(0, 5),
)
def test_the_overhead_fitted_to_a_step_is_the_one_that_made_it(schedule, k, groups, o):
    chunks = 2 if schedule == "interleaved" else 1
    timeline = simulate(schedule, k, k * groups, 1, 2, chunks=chunks)
    step = replay(timeline, 1, 2, overhead=o).makespan
    assert overhead_for_step(timeline, step, 1, 2) == pytest.approx(o, abs=1e-6)
    # the replayed step grows by at least the chain's count of passes times the overhead
    assert step >= replay(timeline).makespan + o - 1e-9
    assert step <= replay(timeline).makespan + chain_length(timeline) * o + 1e-9


@given(st.sampled_from(["zb-h1", "zb-v"]), st.integers(2, 6), st.integers(1, 3))
def test_at_the_break_even_overhead_both_steps_are_equal(schedule, k, groups):
    m = k * groups
    baseline, timeline = simulate("1f1b", k, m), simulate(schedule, k, m)
    limit = break_even_overhead(timeline, baseline)
    at = [replay(t, overhead=limit).makespan for t in (timeline, baseline)]
    assert at[0] == pytest.approx(at[1], rel=1e-6)
    below = [replay(t, overhead=0.99 * limit).makespan for t in (timeline, baseline)]
    assert below[0] < below[1]


def test_the_overhead_functions_refuse_what_has_no_answer():
    one_f_one_b = simulate("1f1b", 4, 8)
    # fewer micro-batches: faster, and a shorter chain, so no overhead makes it slower
    assert break_even_overhead(simulate("1f1b", 4, 4), one_f_one_b) == math.inf
    with pytest.raises(ValueError, match="faster"):
        break_even_overhead(one_f_one_b, simulate("zb-h1", 4, 8))
    with pytest.raises(ValueError, match="step"):
        overhead_for_step(one_f_one_b, 32, 1)  # shorter than 33, the step with none
    with pytest.raises(ValueError, match="overhead"):
        simulate("1f1b", 4, 8, overhead=-1)
    with pytest.raises(ValueError, match="overhead"):
        replay(one_f_one_b, overhead=float("nan"))
    with pytest.raises(ValueError, match="weight"):
        break_even_overhead(simulate("zb-h1", 4, 8), one_f_one_b, 1, 2, weight=2)


# --- the exercise: a reader's 1F1B order, checked --------------------------------------------


def _reader_1f1b(p: int, m: int, r: int) -> list[tuple[str, int]]:
    """A right answer written another way: one pass over the step's slots."""
    order, forwards, backwards = [], 0, 0
    while backwards < m:
        in_flight = forwards - backwards
        if forwards < m and in_flight < p - r:
            order.append(("F", forwards))
            forwards += 1
        else:
            order.append(("B", backwards))
            backwards += 1
    return order


def test_the_1f1b_order_of_one_stage_by_hand():
    # 4 stages, 6 micro-batches, stage 1: 3 forwards fill the pipeline, then B/F pairs,
    # then the remaining backwards.
    f, b = "F", "B"
    assert one_f_one_b_order(4, 6, 1) == [
        (f, 0), (f, 1), (f, 2), (b, 0), (f, 3), (b, 1),
        (f, 4), (b, 2), (f, 5), (b, 3), (b, 4), (b, 5),
    ]  # fmt: skip
    assert one_f_one_b_order(4, 6, 3) == [(f, 0), (b, 0), (f, 1), (b, 1)] + [
        (k, i) for i in range(2, 6) for k in (f, b)
    ]


def test_a_right_answer_passes_and_is_compared_with_pytorch():
    verdict = check_1f1b(_reader_1f1b)
    assert verdict.passed
    assert str(verdict).startswith("Right: _reader_1f1b gives 1F1B's order on all 31 stages")
    # torch 2.13 lists the last stage's forwards as micro-batches 1..m (its _get_pipeline_order
    # starts that stage's steady state at forward_mb + 1): the checker names, not hides, it
    assert "same order on 24 of them" in str(verdict)
    assert "the other 7, each pipeline's last stage" in str(verdict)


def test_gpipe_order_fails_on_its_warm_up():
    def gpipe(p, m, r):
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]

    verdict = check_1f1b(gpipe)
    assert not verdict.passed
    assert str(verdict) == (
        "Not yet. stage 1 of p = 2, m = 2: runs 2 forwards before its first backward;"
        " 1F1B runs p - r = 1, just enough to keep the stages after it busy"
    )


def test_a_forward_before_each_backward_holds_one_micro_batch_too_many():
    def forward_first(p, m, r):
        w = min(p - r, m)
        order = [("F", i) for i in range(w)]
        for i in range(m - w):
            order += [("F", w + i), ("B", i)]
        return order + [("B", i) for i in range(m - w, m)]

    assert "runs 2 forwards before its first backward" in str(check_1f1b(forward_first))


def test_a_valid_order_that_is_not_1f1b_names_its_first_difference():
    def last_in_first_out(p, m, r):  # the cool-down's backwards in reverse
        w = min(p - r, m)
        order = [("F", i) for i in range(w)]
        for i in range(m - w):
            order += [("B", i), ("F", w + i)]
        return order + [("B", i) for i in reversed(range(m - w, m))]

    assert str(check_1f1b(last_in_first_out, sizes=((4, 8),))) == (
        "Not yet. stage 0 of p = 4, m = 8: action 12 is ('B', 7), 1F1B runs ('B', 4) there"
    )


def test_an_order_that_deadlocks_says_who_waits_for_whom():
    def reversed_warm_up(p, m, r):  # r + 1 forwards instead of p - r
        w = min(r + 1, m)
        order = [("F", i) for i in range(w)]
        for i in range(m - w):
            order += [("B", i), ("F", w + i)]
        return order + [("B", i) for i in range(m - w, m)]

    assert str(check_1f1b(reversed_warm_up)) == (
        "Not yet. p = 2, m = 2: the stages wait on one another for ever: stage 0 waits to run"
        " backward 0, which needs stage 1's backward of micro-batch 0; stage 1 waits to run"
        " forward 1, which needs stage 0's forward of micro-batch 1"
    )


def test_malformed_orders_and_errors_are_reported_not_raised():
    def no_min(p, m, r):  # p - r forwards even when fewer micro-batches exist
        return [("F", i) for i in range(p - r)] + [("B", i) for i in range(p - r)]

    assert "the F actions name micro-batches [0, 1, 2, 3], not each of 0..1 once" in str(
        check_1f1b(no_min, sizes=((4, 2),))
    )
    backward_first = check_1f1b(lambda p, m, r: [("B", 0), ("F", 0)], sizes=((1, 1),))
    assert str(backward_first) == (
        "Not yet. stage 0 of p = 1, m = 1: the backward of micro-batch 0 comes before its forward"
    )
    assert "raised ZeroDivisionError" in str(check_1f1b(lambda p, m, r: 1 // 0))
    assert "return a list of ('F', i) and ('B', i) pairs" in str(check_1f1b(lambda p, m, r: "F0"))


def test_the_exercise_refuses_bad_arguments():
    with pytest.raises(ValueError, match="order_fn"):
        check_1f1b("not a function")
    with pytest.raises(ValueError, match="stage must be below stages"):
        one_f_one_b_order(4, 8, 4)
    with pytest.raises(ValueError, match="micro_batches"):
        torch_1f1b_orders(4, 0)


@pytest.mark.parametrize(("p", "m"), [(2, 2), (3, 7), (4, 8)])
def test_pytorchs_listed_order_is_ours_but_on_the_last_stage(p, m):
    ours = [one_f_one_b_order(p, m, r) for r in range(p)]
    listed = torch_1f1b_orders(p, m)
    assert listed[:-1] == ours[:-1]
    assert [i for k, i in listed[-1] if k == "F"] == list(range(1, m + 1))  # torch 2.13
