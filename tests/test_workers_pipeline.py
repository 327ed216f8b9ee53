"""workers.pipeline, beyond what notebook 07 checks when it runs the worker on 4 real ranks
(loss and gradients equal one process, each stage runs the simulated order, the measured
bubble against the formula, the peak bytes each stage saved for backward): the stages, the
simulated compute, the saved-tensor meter, the timelines, the bad arguments, and one small
run of the torchrun entry on 2 real ranks."""

import contextlib
import io
import time

import pytest
import torch
from own_processes import own_children
from torch import nn

from trainscale.distributed import run_ranks
from trainscale.pipeline import BACKWARD, FORWARD, INPUT, WEIGHT, bubble, simulate
from trainscale.workers import pipeline as wp

# --- pieces, in this process ----------------------------------------------------------


def test_simulated_compute_is_an_identity_that_takes_its_time():
    layer = wp.SimulatedCompute(0.01, 0.02)
    x = torch.randn(3, 4, requires_grad=True)
    y = layer(x)
    assert torch.equal(y, x)
    grad = torch.randn(3, 4)
    y.backward(grad)
    assert torch.equal(x.grad, grad)
    (f_kind, f_start, f_end), (b_kind, b_start, b_end) = layer.events
    assert (f_kind, b_kind) == (FORWARD, BACKWARD)
    assert f_end - f_start >= 0.01 and b_end - b_start >= 0.02
    assert b_start >= f_end
    layer.clear()
    assert layer.events == []
    assert wp.SimulatedCompute().forward_s == 0.0


def test_simulated_compute_rejects_bad_times():
    with pytest.raises(ValueError, match="forward_s"):
        wp.SimulatedCompute(-1, 0)
    with pytest.raises(ValueError, match="backward_s"):
        wp.SimulatedCompute(0, float("nan"))


def test_stages_chained_are_the_whole_model():
    model = wp.reference_model(4)
    assert len(model) == 8
    stages = [wp.stage_module(model, s, 4, 0, 0) for s in range(4)]
    x, _ = wp.batch(3)
    out = x
    for stage in stages:
        out = stage(out)
    assert torch.equal(out, model(x))
    assert stages[1][0] is model[2]  # the stage shares the model's blocks, no copies


def test_stage_module_rejects_bad_arguments():
    model = wp.reference_model(2)
    with pytest.raises(ValueError, match="stage must be between 0 and 1"):
        wp.stage_module(model, 2, 2, 0, 0)
    with pytest.raises(ValueError, match="model must have 6 blocks"):
        wp.stage_module(model, 0, 3, 0, 0)
    with pytest.raises(ValueError, match="stages"):
        wp.reference_model(0)


def test_batch_and_reference_are_deterministic():
    x, y = wp.batch(4)
    assert x.shape == y.shape == (4 * wp.EXAMPLES_PER_MICRO_BATCH, wp.WIDTH)
    assert torch.equal(x, wp.batch(4)[0])
    model = wp.reference_model(2)
    threads = torch.get_num_threads()
    got = wp.reference(model, 4)
    assert torch.get_num_threads() == threads  # restored after its one-thread run
    assert got["loss"] == pytest.approx(nn.functional.mse_loss(model(x), y).item())
    assert got["grads"].keys() == dict(model.named_parameters()).keys()
    assert all(p.grad is None for p in model.parameters())  # the model is left untouched
    with pytest.raises(ValueError, match="micro_batches"):
        wp.batch(0)


def test_saved_bytes_per_micro_batch_by_hand():
    # 2 examples of width 32, float32: per block 2 x (32 + 128 + 128 + 32) x 4 = 2,560 bytes
    assert wp.saved_bytes_per_micro_batch(0, 4) == 2 * 2_560 == 5_120
    assert wp.saved_bytes_per_micro_batch(2, 4) == 5_120
    assert wp.saved_bytes_per_micro_batch(3, 4) == 5_120 + 2 * 2 * 32 * 4  # + loss input, target
    assert wp.saved_bytes_per_micro_batch(0, 1) == 5_632  # one stage is also the last
    with pytest.raises(ValueError, match="stage must be between 0 and 3"):
        wp.saved_bytes_per_micro_batch(4, 4)
    with pytest.raises(ValueError, match="stages"):
        wp.saved_bytes_per_micro_batch(0, 0)


@pytest.mark.parametrize("stage", [0, 1])
def test_meter_counts_a_stage_saved_tensors_and_their_release(stage):
    model = wp.reference_model(2)
    module = wp.stage_module(model, stage, 2, 0, 0)
    x, y = wp.batch(1)
    x.requires_grad_(stage > 0)  # a later stage's input comes from the stage before
    meter = wp.SavedTensorMeter(exclude=module.parameters())
    with meter:
        out = module(x)
        loss = nn.functional.mse_loss(out, y) if stage == 1 else out.sum()
        held = meter.held
        loss.backward()
    assert held == meter.peak == wp.saved_bytes_per_micro_batch(stage, 2)
    assert meter.held == 0  # backward released everything it saved
    meter.reset()
    assert meter.peak == 0
    with torch.no_grad(), meter:
        module(x)
    assert meter.peak == 0  # nothing saved without a graph


def test_meter_leaves_out_the_excluded_weights_and_counts_them_otherwise():
    layer = nn.Linear(4, 3, bias=False)
    x = torch.randn(5, 4, requires_grad=True)
    with wp.SavedTensorMeter() as everything:
        layer(x).sum().backward()
    with wp.SavedTensorMeter(exclude=layer.parameters()) as activations:
        layer(x).sum().backward()
    assert activations.peak == 5 * 4 * 4  # the input, saved for the weight's gradient
    assert everything.peak == 5 * 4 * 4 + 3 * 4 * 4  # and the weight, for the input's


def test_timeline_from_rank_results():
    # two stages, one micro-batch, f = 1, b = 2, as the simulator plays it; then a
    # second step in which stage 0's backward was held up by something else
    steps = [
        [
            [("forward", 0, 0, 1), ("backward", 0, 4, 6)],
            [("forward", 0, 0, 1), ("backward", 0, 5, 7)],
        ],
        [
            [("forward", 0, 1, 2), ("backward", 0, 2, 4)],
            [("forward", 0, 1, 2), ("backward", 0, 2, 4)],
        ],
    ]
    per_rank = [{"schedule": "gpipe", "micro_batches": 1, "steps": s} for s in steps]
    first, second = wp.timelines(per_rank)
    assert first == simulate("gpipe", 2, 1)
    assert first.makespan == 6 and first.busy == (3, 3)
    assert first.bubble == 6 / 12 == bubble(2, 1)
    assert second.makespan == 7 and second.bubble == 8 / 14
    assert wp.timeline(per_rank) == first  # the least disturbed step
    with pytest.raises(ValueError, match="per_rank"):
        wp.timeline([])


# --- the torchrun entry on real processes: 2 ranks, one short configuration --------------
# (notebook 07 runs the worker on 4 ranks; the entry adds the gathering and the report)


@pytest.mark.slow  # two real gloo ranks
def test_torchrun_entry_gathers_the_stages_and_reports_on_rank_0():
    before = own_children()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results = run_ranks(wp.main, 2, ("gpipe",), (2,), 0.0, 0.0, 1, timeout=120)
    time.sleep(0.2)
    assert own_children() <= before, "processes left behind"
    (line,) = printed.getvalue().splitlines()
    # 2 stages, 2 micro-batches: (2 - 1) / (2 + 2 - 1) = 1/3 of the step idle
    head = "[rank 0] gpipe   2 micro-batches: loss equals one process True, bubble formula 0.333,"
    assert line.startswith(head + " bubble ") and line.endswith(" (measured)")
    (first,), (last,) = results  # each rank returns its own result of the one configuration
    assert [len(first["steps"]), len(last["steps"])] == [1, 1]
    assert not first["losses"] and len(last["losses"]) == 2  # the last stage computes the loss
    # GPipe holds both micro-batches on each stage: 2 x 5,120 bytes, 2 x 5,632 on the last
    assert (first["peak_saved_bytes"], last["peak_saved_bytes"]) == ([10_240], [11_264])
    assert first["left_saved_bytes"] == last["left_saved_bytes"] == [0]


# --- the zero-bubble pieces: split backward, V placement, timelines ------------------------


def test_simulated_compute_with_a_weight_pass_keeps_its_output_and_splits_its_backward():
    layer = wp.SimulatedCompute(0.0, 0.002, 0.001)
    x = torch.randn(3, 4, requires_grad=True)
    y = layer(x)
    assert torch.equal(y, x)  # the clock's branch adds 0 x 0
    grad = torch.randn(3, 4)
    y.backward(grad)
    assert torch.equal(x.grad, grad)
    assert layer.clock.grad == 0
    kinds = [kind for kind, _, _ in layer.events]
    assert kinds == [FORWARD, INPUT, WEIGHT]  # a full backward runs both halves, input first
    (_, _, _), (_, i_start, i_end), (_, w_start, w_end) = layer.events
    assert i_end - i_start >= 0.001 and w_end - w_start >= 0.001  # 0.002 - 0.001, and 0.001
    assert "weight_s=0.001" in repr(layer)
    with pytest.raises(ValueError, match="weight_s"):
        wp.SimulatedCompute(0.0, 0.001, 0.002)


def test_simulated_compute_changes_its_times_and_keeps_its_shape():
    # a step of empty passes: the same split graph, every time zero
    layer = wp.SimulatedCompute(0.0, 0.002, 0.001)
    layer.set_times(0.0, 0.0, 0.0)
    x = torch.randn(2, 3, requires_grad=True)
    layer(x).sum().backward()
    assert [kind for kind, _, _ in layer.events] == [FORWARD, INPUT, WEIGHT]
    assert "weight_s=0" in repr(layer)
    split = wp.SimulatedCompute(split=True)  # split, though it starts with no time
    assert split.split and split.clock.shape == ()
    plain = wp.SimulatedCompute(0.01, 0.02)
    assert not plain.split and not hasattr(plain, "clock")
    plain.set_times(0.0, 0.0)
    assert (plain.forward_s, plain.backward_s, plain.weight_s) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="weight_s must be 0"):
        plain.set_times(0.0, 0.02, 0.01)
    with pytest.raises(ValueError, match="weight_s must be at most"):
        layer.set_times(0.0, 0.001, 0.002)
    with pytest.raises(ValueError, match="forward_s"):
        layer.set_times(-1.0, 0.0)
    with pytest.raises(ValueError, match="split"):
        wp.SimulatedCompute(split=1)


def test_pytorchs_split_backward_runs_each_half_in_its_own_pass():
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 4), wp.SimulatedCompute(0.0, 0.002, 0.001))
    x = torch.randn(2, 4, requires_grad=True)
    out, grad = module(x), torch.randn(2, 4)
    (dx,), groups = stage_backward_input([out], [grad], [x], module.parameters())
    assert [kind for kind, _, _ in module[-1].events] == [FORWARD, INPUT]
    assert module[0].weight.grad is None  # the weight gradients wait
    stage_backward_weight(module.parameters(), groups)
    assert [kind for kind, _, _ in module[-1].events] == [FORWARD, INPUT, WEIGHT]
    expected = torch.autograd.grad(module(x), [x, module[0].weight], grad)
    assert torch.allclose(dx, expected[0]) and torch.allclose(module[0].weight.grad, expected[1])


def test_pieces_chained_are_the_whole_model():
    model = wp.reference_model(4)
    pieces = [wp.piece_module(model, p, 8, 0, 0) for p in range(8)]
    x, _ = wp.batch(2)
    out = x
    for piece in pieces:
        out = piece(out)
    assert torch.equal(out, model(x))
    assert len(pieces[3]) == 2 and pieces[3][0] is model[3]  # one block, then the clock
    with pytest.raises(ValueError, match="piece must be between 0 and 7"):
        wp.piece_module(model, 8, 8, 0, 0)
    with pytest.raises(ValueError, match="pieces must divide"):
        wp.piece_module(model, 0, 3, 0, 0)


def test_pieces_of_rank_by_hand():
    # one piece per rank, or a V: rank r holds r and 2K - 1 - r of 2K
    assert wp.pieces_of_rank("zb-h1", 2, 4) == [2, 4]
    assert wp.pieces_of_rank("1f1b", 0, 4) == [0, 4]
    assert wp.pieces_of_rank("zb-v", 0, 4) == [0, 7, 8]
    assert wp.pieces_of_rank("dualpipev", 3, 4) == [3, 4, 8]
    with pytest.raises(ValueError, match="rank must be between 0 and 3"):
        wp.pieces_of_rank("zb-v", 4, 4)
    with pytest.raises(ValueError, match="schedule"):
        wp.pieces_of_rank("gpipe", 0, 4)


def test_chunk_ops_number_each_piece_and_kind_in_turn():
    first = wp.piece_module(wp.reference_model(1), 0, 2, 0, 0)
    second = wp.piece_module(wp.reference_model(1), 1, 2, 0, 0)
    first[-1].events[:] = [(FORWARD, 1.0, 2.0), (FORWARD, 3.0, 4.0), (INPUT, 6.0, 7.0)]
    second[-1].events[:] = [(FORWARD, 2.0, 3.0), (INPUT, 4.0, 5.0), (WEIGHT, 5.0, 6.0)]
    assert wp._chunk_ops([first, second], 1.0) == [
        (FORWARD, 0, 0.0, 1.0, 0),
        (FORWARD, 0, 1.0, 2.0, 1),
        (FORWARD, 1, 2.0, 3.0, 0),
        (INPUT, 0, 3.0, 4.0, 1),
        (WEIGHT, 0, 4.0, 5.0, 1),
        (INPUT, 0, 5.0, 6.0, 0),
    ]


def test_zero_bubble_timelines_from_rank_results():
    # ZB-H1 on 2 stages, 1 micro-batch, F = B = W = 1, as the simulator plays it
    steps = [
        [("forward", 0, 0, 1, 0), ("input", 0, 3, 4, 0), ("weight", 0, 4, 5, 0)],
        [("forward", 0, 1, 2, 0), ("input", 0, 2, 3, 0), ("weight", 0, 3, 4, 0)],
    ]
    per_rank = [{"schedule": "zb-h1", "micro_batches": 1, "chunks": 1, "steps": [s]} for s in steps]
    (only,) = wp.timelines(per_rank)
    assert only == simulate("zb-h1", 2, 1)
    # a step of empty passes: the same passes, of no length, 0.5 apart on each rank
    for result, ops in zip(per_rank, steps, strict=True):
        empty = [(kind, mb, 0.5 * i, 0.5 * i, c) for i, (kind, mb, _, _, c) in enumerate(ops)]
        result["empty_steps"] = [empty]
    (idle,) = wp.timelines(per_rank, "empty_steps")
    assert idle.makespan == 1.0 and idle.busy == (0, 0)
    with pytest.raises(ValueError, match="per_rank"):
        wp.timelines([])
    with pytest.raises(ValueError, match="key"):
        wp.timelines(per_rank, "cpu")


def test_hop_latency_refuses_before_any_communication():
    with pytest.raises(ValueError, match="world_size"):
        wp.hop_latency(0, 1)
    with pytest.raises(ValueError, match="hops"):
        wp.hop_latency(0, 2, 0)


@pytest.mark.slow  # two real gloo ranks
def test_zero_bubble_worker_reports_a_schedule_pytorch_refuses():
    # notebook 07 runs every schedule on 4 ranks; here, the refusal path: DualPipeV wants
    # at least as many micro-batches as its 2K = 4 stages, and gets 2
    before = own_children()
    results = run_ranks(
        wp.zero_bubble_worker, 2, ("dualpipev", "zb-h1"), 2, 0.0, 0.0, 0.0, 1, timeout=120
    )
    time.sleep(0.2)
    assert own_children() <= before, "processes left behind"
    (refused, ran), (refused_1, ran_1) = results
    assert (
        refused
        == refused_1
        == {
            "schedule": "dualpipev",
            "micro_batches": 2,
            "error": "ValueError: DualPipeV requires at least as many microbatches as stages,"
            " but got 2 microbatches and 4 stages.",
        }
    )
    assert not ran["losses"] and len(ran_1["losses"]) == 2  # rank 1 holds the last piece
    assert len(ran["grads"]) == len(ran_1["grads"]) == 8  # 2 blocks x 2 linears x 2 tensors
    # ZB-H1 on 2 stages with 2 micro-batches holds both on each stage until their W pass:
    # 2 x 5,120 bytes x 2 (float64) = 20,480; the last stage also keeps one micro-batch's
    # loss (2 x 2 x 32 values x 8 bytes = 1,024) until its B
    assert (ran["peak_saved_bytes"], ran_1["peak_saved_bytes"]) == ([20_480], [21_504])
    # beside the timed step, one step of empty passes: the same passes, and its CPU time
    for result in (ran, ran_1):
        (step,), (empty,) = result["steps"], result["empty_steps"]
        assert [op[:2] for op in empty] == [op[:2] for op in step]
        assert len(result["cpu_s"]) == 1 and result["cpu_s"][0] > 0


@pytest.mark.slow  # two real gloo ranks
def test_hop_latency_on_two_ranks():
    before = own_children()
    first, second = run_ranks(wp.hop_latency, 2, 5, timeout=120)
    time.sleep(0.2)
    assert own_children() <= before, "processes left behind"
    assert first > 0 and second > 0
