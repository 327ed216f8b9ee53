"""workers.pipeline: the stages, the simulated compute, and one real 4-rank pipeline run."""

import contextlib
import io
import time

import psutil
import pytest
import torch
from torch import nn

from trainscale.distributed import run_ranks
from trainscale.parallel import pipeline_bubble
from trainscale.pipeline import BACKWARD, FORWARD, simulate
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
    assert first.bubble == 6 / 12 == pipeline_bubble(2, 1)
    assert second.makespan == 7 and second.bubble == 8 / 14
    assert wp.timeline(per_rank) == first  # the least disturbed step
    with pytest.raises(ValueError, match="per_rank"):
        wp.timeline([])


# --- real processes: one 4-rank run of the torchrun entry (it runs the worker) ----------

COUNTS = (4, 12)


def _children() -> set[int]:
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and "resource_tracker" not in " ".join(p.cmdline())
    }


@pytest.fixture(scope="module")
def four_stages():
    """One run of the torchrun entry on 4 ranks: each rank's results and what was printed."""
    before = _children()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        results = run_ranks(wp.main, 4, ("gpipe", "1f1b"), COUNTS, 0.02, 0.04, 2, timeout=300)
    time.sleep(0.2)
    assert _children() <= before, "processes left behind"
    return results, printed.getvalue().splitlines()


def _configs(results):
    for index, config in enumerate(results[0]):
        yield config["schedule"], config["micro_batches"], [ranks[index] for ranks in results]


def test_loss_and_gradients_equal_one_process(four_stages):
    results, _ = four_stages
    model = wp.reference_model(4)
    for _, m, per_rank in _configs(results):
        expected = wp.reference(model, m)
        losses = per_rank[-1]["losses"]
        assert len(losses) == m and all(not r["losses"] for r in per_rank[:-1])
        assert sum(losses) / m == pytest.approx(expected["loss"], rel=1e-6)
        grads = {name: g for r in per_rank for name, g in r["grads"].items()}
        assert grads.keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            assert torch.allclose(grads[name], grad, atol=1e-6), name


def test_each_rank_runs_the_simulated_order(four_stages):
    results, _ = four_stages
    for schedule, m, per_rank in _configs(results):
        simulated = simulate(schedule, 4, m)
        steps = wp.timelines(per_rank)
        assert len(steps) == 2
        for measured in steps:
            for stage in range(4):
                got = [(op.kind, op.micro_batch) for op in measured.ops[stage]]
                assert got == [(op.kind, op.micro_batch) for op in simulated.ops[stage]]
            held = (m,) * 4 if schedule == "gpipe" else (4, 3, 2, 1)
            assert measured.peak_activations == held


def test_measured_bubble_follows_the_formula(four_stages):
    results, _ = four_stages
    bubbles = {}
    for schedule, m, per_rank in _configs(results):
        measured = wp.timeline(per_rank)
        assert all(op.end - op.start >= 0.02 for ops in measured.ops for op in ops)
        # sends and scheduling only ever add idle time to what the formula counts
        assert measured.bubble > pipeline_bubble(4, m) - 0.02
        bubbles[schedule, m] = measured.bubble
    for schedule in ("gpipe", "1f1b"):
        assert bubbles[schedule, 12] < bubbles[schedule, 4]


def test_rank_0_reports_each_configuration(four_stages):
    _, lines = four_stages
    assert len(lines) == 2 * len(COUNTS)
    assert all(line.startswith("[rank 0] ") and line.endswith(" (measured)") for line in lines)
    assert all("loss equals one process True" in line for line in lines)
    first = "[rank 0] gpipe   4 micro-batches: loss equals one process True, bubble formula 0.429,"
    assert lines[0].startswith(first)
