"""workers.data_parallel, beyond what notebook 03 checks when it runs the worker on 4 real
ranks (DDP's gradient, broadcast, training, no_sync, unequal slices, batch norm, memory and
buckets) and the exercise's reference solution on 2 and 4: the helpers the chapter and the
worker share, their bad arguments, the torchrun entry's report, and what the exercise's
checker says about wrong solutions."""

import itertools

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from trainscale.parallel import data_parallel_gradient, full_batch_gradient
from trainscale.workers import data_parallel as dp

# --- helpers (no processes) --------------------------------------------------------------


def test_slice_sizes_hand_worked():
    assert dp.slice_sizes(10, 4) == [3, 3, 2, 2]
    assert dp.slice_sizes(32, 4) == [8, 8, 8, 8]
    assert dp.slice_sizes(5, 1) == [5]
    assert dp.slice_sizes(8, 8) == [1] * 8


@given(st.integers(1, 200), st.integers(1, 16))
def test_slices_cover_the_batch_as_tensor_split_does(batch, replicas):
    if replicas > batch:
        with pytest.raises(ValueError, match="batch"):
            dp.slice_sizes(batch, replicas)
        return
    sizes = dp.slice_sizes(batch, replicas)
    assert sizes == [len(c) for c in torch.tensor_split(torch.arange(batch), replicas)]
    slices = [dp.rank_slice(batch, r, replicas) for r in range(replicas)]
    assert [s.stop - s.start for s in slices] == sizes
    assert slices[0].start == 0 and slices[-1].stop == batch
    assert all(a.stop == b.start for a, b in itertools.pairwise(slices))


def test_bad_slicing_arguments_are_named():
    with pytest.raises(ValueError, match="replicas"):
        dp.slice_sizes(8, 0)
    with pytest.raises(ValueError, match=r"batch must be a whole number >= 4"):
        dp.slice_sizes(3, 4)
    with pytest.raises(ValueError, match="rank must be between 0 and replicas - 1 = 3"):
        dp.rank_slice(8, 4, 4)


def test_largest_relative_difference_hand_worked():
    expected = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([1.0, 1.0])}
    got = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([1.0, 1.0])}
    assert dp.largest_relative_difference(got, expected) == pytest.approx(4 / 3)
    assert dp.largest_relative_difference(expected, expected) == 0.0
    zero = {"a": torch.zeros(2)}
    assert dp.largest_relative_difference({"a": torch.tensor([0.0, 0.5])}, zero) == 0.5
    with pytest.raises(ValueError, match="same parameters"):
        dp.largest_relative_difference({"a": torch.zeros(1)}, {"b": torch.zeros(1)})


def test_largest_relative_difference_leaves_its_inputs_alone():
    a, b = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.5, 2.0])}
    dp.largest_relative_difference(a, b)
    assert a["w"].tolist() == [1.0, 2.0] and b["w"].tolist() == [1.5, 2.0]


def test_regression_model_is_seeded_and_leaves_the_global_generator_alone():
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a, b = dp.regression_model(seed=1), dp.regression_model(seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    c = dp.regression_model(seed=2)
    assert not torch.equal(a[0].weight, c[0].weight)


def test_batch_norm_variants_share_names_and_weights():
    local, norm = dp.regression_model(norm="local"), dp.regression_model(norm="global")
    plain = dp.regression_model()
    assert [n for n, _ in local.named_parameters()] == [n for n, _ in norm.named_parameters()]
    assert local[0].bias is None and plain[0].bias is not None  # no bias before batch norm
    assert torch.equal(local[0].weight, plain[0].weight)
    assert isinstance(norm[1], dp.GlobalBatchNorm) and type(local[1]) is nn.BatchNorm1d
    with pytest.raises(ValueError, match="norm"):
        dp.regression_model(norm="sync")


def test_global_batch_norm_alone_is_plain_batch_norm():
    x, _ = dp.regression_data(16)
    local, norm = dp.regression_model(norm="local"), dp.regression_model(norm="global")
    assert torch.allclose(local(x), norm(x), atol=1e-6)


def test_regression_data_is_reproducible():
    x, y = dp.regression_data(6, seed=3)
    assert x.shape == (6, dp.FEATURES) and y.shape == (6, dp.OUTPUTS)
    assert torch.equal(x, dp.regression_data(6, seed=3)[0])
    with pytest.raises(ValueError, match="batch"):
        dp.regression_data(0)


def test_gradients_of_the_small_model_are_not_tiny():
    """The reason for the small model: relative comparisons need gradients well above rounding."""
    x, y = dp.regression_data(32)
    grads = full_batch_gradient(dp.regression_model(), dp.loss_fn, x, y)
    assert min(g.abs().max().item() for g in grads.values()) > 1e-3


def test_one_process_simulation_matches_and_batch_norm_breaks_it():
    x, y = dp.regression_data(32)
    model = dp.regression_model()
    full = full_batch_gradient(model, dp.loss_fn, x, y)
    assert (
        dp.largest_relative_difference(data_parallel_gradient(model, dp.loss_fn, x, y, 4), full)
        < 1e-6
    )
    norm = dp.regression_model(norm="local")
    full_norm = full_batch_gradient(norm, dp.loss_fn, x, y)
    split = data_parallel_gradient(norm, dp.loss_fn, x, y, 4)
    assert dp.largest_relative_difference(split, full_norm) > 0.1


def test_communication_hidden_under_backward_hand_worked():
    # Buckets run 10-30, 20-50 and 60-70 ms; backward computed its last gradient at 55 ms.
    # Their union before 55 ms is 10-50: 40 ms. The third ran entirely after: 0 ms.
    buckets = [(0, [6, 7], 10.0, 30.0), (1, [4, 5], 20.0, 50.0), (2, [2, 3], 60.0, 70.0)]
    assert dp.communication_hidden_ms(buckets, 55.0) == pytest.approx(40.0)
    assert dp.communication_hidden_ms(buckets, 25.0) == pytest.approx(15.0)  # 10-25
    assert dp.communication_hidden_ms(buckets, 100.0) == pytest.approx(50.0)  # 10-50, 60-70
    assert dp.communication_hidden_ms(buckets[:1], 5.0) == 0.0
    assert dp.communication_hidden_ms([], 5.0) == 0.0


def test_communication_hidden_names_bad_arguments():
    with pytest.raises(ValueError, match="compute_end_ms"):
        dp.communication_hidden_ms([], -1.0)
    with pytest.raises(ValueError, match="buckets must complete after their launch"):
        dp.communication_hidden_ms([(0, [0], 5.0, 4.0)], 10.0)


def test_storage_bytes_count_a_shared_buffer_once():
    flat = torch.zeros(10)
    views = [flat[:4], flat[4:]]
    alone = torch.zeros(3, dtype=torch.float64)
    assert dp._storage_bytes([*views, alone]) == 10 * 4 + 3 * 8


def test_ddp_checks_refuse_bad_arguments_before_any_communication():
    """No process group exists here: each check must fail on its argument first."""
    with pytest.raises(ValueError, match="gradient_as_bucket_view"):
        dp.check_memory(0, 1, gradient_as_bucket_view=1)
    with pytest.raises(ValueError, match="steps"):
        dp.check_memory(0, 1, steps=0)
    with pytest.raises(ValueError, match="iterations"):
        dp.check_buckets(0, 1, iterations=0)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        dp.check_buckets(0, 1, bucket_cap_mb=0)


# --- the torchrun entry's report (in this process; notebook 03 runs the worker itself) -----


def _simulated_worker(rank: int, world_size: int, batch: int, unequal_batch: int) -> dict:
    """What :func:`dp.worker` returns, from the one-process simulation of data parallelism:
    each replica's gradient on its slice, averaged as DDP's all-reduce does."""
    x, y = dp.regression_data(batch)
    u, v = dp.regression_data(unequal_batch)

    def ddp(data, norm=None, weighted=False):
        model = dp.regression_model(norm=norm)
        return data_parallel_gradient(model, dp.loss_fn, *data, world_size, weighted=weighted)

    return {
        "ddp": ddp((x, y)),
        "accumulated": {"gradient": ddp((x, y)), "all_reduces": 1},
        "unequal, plain": ddp((u, v)),
        "unequal, weighted": ddp((u, v), weighted=True),
        "batch norm, local": ddp((x, y), norm="local"),
        "batch norm, global": full_batch_gradient(
            dp.regression_model(norm="local"), dp.loss_fn, x, y
        ),
        "memory": {"parameters": 4_204_544},
    }


def test_torchrun_entry_reports_on_rank_0_only(monkeypatch, capsys):
    monkeypatch.setattr(dp, "worker", _simulated_worker)
    dp.main(1, 2)
    assert capsys.readouterr().out == ""
    dp.main(0, 2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "2 ranks, batch 8: gradient vs one process on the whole batch"
    assert lines[-1] == "  every rank holds all 4,204,544 parameters of the reference model"
    errors = {}
    for line in lines[1:-1]:
        key, error = line.split(" largest relative difference ")
        errors[key.strip()] = float(error)
    assert list(errors) == [
        *("ddp", "accumulated", "unequal, plain", "unequal, weighted"),
        *("batch norm, local", "batch norm, global"),
    ]
    wrong = {"unequal, plain", "batch norm, local"}  # 9 examples split 5 + 4; per-slice norms
    assert all((errors[k] > 0.05) == (k in wrong) for k in errors)
    assert all(errors[k] < 1e-6 for k in errors.keys() - wrong)


# --- the exercise: a reader's gradient averaging, checked --------------------------------


def _reports(batch: int, ranks: int, mistake: str) -> list[dict]:
    """What each rank of :func:`dp.exercise_worker` reports after a solution that makes
    ``mistake`` (``"none"``, ``"no division"``, ``"nothing"``, ``"biases left"``),
    computed in this process from each rank's own gradient."""
    x, y = dp.regression_data(batch)
    locals_ = []
    for rank in range(ranks):
        part = dp.rank_slice(batch, rank, ranks)
        locals_.append(full_batch_gradient(dp.regression_model(), dp.loss_fn, x[part], y[part]))
    total = {k: sum(g[k] for g in locals_) for k in locals_[0]}
    reports = []
    for own in locals_:
        grads = {
            "none": {k: v / ranks for k, v in total.items()},
            "no division": total,
            "nothing": own,
            "biases left": {
                k: own[k] if k.endswith("bias") else v / ranks for k, v in total.items()
            },
        }[mistake]
        reports.append({"gradients": grads})
    return reports


def test_the_exercise_finds_nothing_wrong_with_a_correct_average():
    assert dp.exercise_problems(_reports(24, 4, "none"), 24) == []


def test_the_exercise_names_each_typical_mistake():
    # 2 ranks: the sum of the two slices' mean gradients is 2 x the full-batch mean.
    assert dp.exercise_problems(_reports(24, 2, "no division"), 24) == [
        "every rank: every .grad holds the sum over the ranks, 2 times the full-batch "
        "gradient: divide by dist.get_world_size()"
    ]
    [nothing] = dp.exercise_problems(_reports(24, 4, "nothing"), 24)
    assert nothing.startswith("every rank: every .grad still holds this rank's own gradient")
    [biases] = dp.exercise_problems(_reports(24, 4, "biases left"), 24)
    assert biases.startswith("every rank: the .grad of 0.bias, 2.bias, 4.bias still hold")


def test_the_exercise_reports_errors_and_which_ranks_they_hit():
    reports = _reports(24, 2, "none")
    reports[1] = {"error": "NameError: name 'np' is not defined"}
    [problem] = dp.exercise_problems(reports, 24)
    assert problem.startswith("rank 1: raised NameError: name 'np' is not defined")
    assert "import anything else inside your function" in problem
    hung = [{"error": "RuntimeError: [pair.cc:553] Connection closed by peer"}, reports[0]]
    [problem] = dp.exercise_problems(hung, 24)
    assert problem.startswith("rank 0: waited in a collective that another rank never called")


def test_the_exercise_checker_refuses_bad_arguments_before_starting_ranks():
    def average(model):
        pass

    with pytest.raises(ValueError, match="world_sizes"):
        dp.check_average_gradients(average, world_sizes=(1,))
    with pytest.raises(ValueError, match="world_sizes"):
        dp.check_average_gradients(average, world_sizes=())
    with pytest.raises(ValueError, match="batch must be divisible"):
        dp.check_average_gradients(average, world_sizes=(4,), batch=10)
    with pytest.raises(ValueError, match="average_gradients must be a function"):
        dp.check_average_gradients(print)
    with pytest.raises(ValueError, match="defined with def"):
        dp.check_average_gradients(lambda model: None)


def forgot_to_divide(model: nn.Module) -> None:
    """A typical wrong solution: the sum over the ranks, not the mean."""
    for p in model.parameters():
        dist.all_reduce(p.grad)


def reduced_a_copy(model: nn.Module) -> None:
    """A typical wrong solution: the all-reduce lands in a copy, .grad keeps its value."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        total = p.grad.clone()
        dist.all_reduce(total)
        p.grad.clone().div_(world_size)


def averaged_with_avg(model: nn.Module) -> None:
    """A correct solution other than the chapter's: the all-reduce's own mean."""
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


@pytest.mark.slow
def test_the_exercise_on_real_ranks_fails_wrong_solutions_and_passes_a_right_one(capsys):
    """The chapter runs its reference solution; here two wrong ones and another right one."""
    assert not dp.check_average_gradients(forgot_to_divide, world_sizes=(2,))
    said = capsys.readouterr().out
    assert said.startswith("2 ranks, a batch of 24: not yet right\n- every rank: every .grad")
    assert "divide by dist.get_world_size()" in said
    assert not dp.check_average_gradients(reduced_a_copy, world_sizes=(2,))
    said = " ".join(capsys.readouterr().out.split())  # the message, unwrapped
    assert "every .grad still holds this rank's own gradient: nothing was all-reduced" in said
    assert dp.check_average_gradients(averaged_with_avg, world_sizes=(2,))
    assert capsys.readouterr().out.endswith(
        "passed: averaged_with_avg averages the gradients as DDP does\n"
    )
