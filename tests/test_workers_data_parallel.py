"""Chapter 03 on real processes: DDP equals one device on the whole batch, and the
cases that break it; plus the helpers the chapter and the worker share."""

import itertools
import time

import psutil
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from trainscale.distributed import run_ranks
from trainscale.memory import mlp_stack, model_state_bytes
from trainscale.parallel import data_parallel_gradient, full_batch_gradient
from trainscale.workers import data_parallel as dp


def _children() -> set[int]:
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and "resource_tracker" not in " ".join(p.cmdline())
    }


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


# --- real processes: one run of the chapter's worker, one of the torchrun entry ----------


@pytest.fixture(scope="module")
def four_ranks():
    before = _children()
    results = run_ranks(dp.worker, 4, timeout=300)
    time.sleep(0.2)
    assert _children() <= before, "processes left behind"
    return results


def _full(batch: int, norm=None):
    x, y = dp.regression_data(batch)
    return full_batch_gradient(
        dp.regression_model(norm="local" if norm else None), dp.loss_fn, x, y
    )


def test_ddp_gradient_is_the_full_batch_gradient_on_every_rank(four_ranks):
    full = _full(32)
    for result in four_ranks:
        assert dp.largest_relative_difference(result["ddp"], full) < 1e-6
        assert all(torch.equal(result["ddp"][k], four_ranks[0]["ddp"][k]) for k in full)


def test_ddp_broadcasts_rank_0_weights_at_construction(four_ranks):
    first = four_ranks[0]["broadcast"]
    assert first["before"] == first["after"]
    for result in four_ranks[1:]:
        assert result["broadcast"]["before"] != first["before"]
        assert result["broadcast"]["after"] == first["before"]


def test_replicas_stay_identical_and_train_like_one_process(four_ranks):
    model = dp.regression_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x, y = dp.regression_data(32, seed=step)
        dp.loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    one = {name: p.detach() for name, p in model.named_parameters()}
    for result in four_ranks:
        assert all(torch.equal(result["trained"][k], four_ranks[0]["trained"][k]) for k in one)
        assert dp.largest_relative_difference(result["trained"], one) < 1e-6


def test_no_sync_accumulates_the_same_gradient_with_one_all_reduce(four_ranks):
    full = _full(32)
    for result in four_ranks:
        skipped, every = result["accumulated"], result["accumulated, syncing every time"]
        assert skipped["all_reduces"] == 1 and every["all_reduces"] == 4
        assert dp.largest_relative_difference(skipped["gradient"], full) < 1e-6
        assert dp.largest_relative_difference(every["gradient"], full) < 1e-6


def test_unequal_slices_need_the_weighted_mean(four_ranks):
    full = _full(10)
    assert dp.largest_relative_difference(four_ranks[0]["unequal, plain"], full) > 0.05
    assert dp.largest_relative_difference(four_ranks[0]["unequal, weighted"], full) < 1e-6


def test_batch_norm_per_replica_breaks_and_global_statistics_fix_it(four_ranks):
    full = _full(32, norm=True)
    assert dp.largest_relative_difference(four_ranks[0]["batch norm, local"], full) > 0.1
    assert dp.largest_relative_difference(four_ranks[0]["batch norm, global"], full) < 1e-6


def test_every_rank_holds_the_whole_model_state(four_ranks):
    params = sum(p.numel() for p in mlp_stack().parameters())
    for result in four_ranks:
        memory = result["memory"]
        assert memory["parameters"] == params
        assert memory["bytes"] == dict.fromkeys(memory["bytes"], 4 * params)  # fp32 each
    assert model_state_bytes(params, gpus=4, zero_stage=0) == model_state_bytes(params)


def test_buckets_follow_backward_from_the_second_iteration(four_ranks):
    for result in four_ranks:
        first, second = result["buckets"]
        assert [b[1] for b in first["buckets"]] == [list(range(8))]  # one bucket at first
        blocks = [b[1] for b in second["buckets"]]
        assert blocks[0][-1] == 7 and blocks[-1][0] == 0  # last layers first
        assert sorted(block for bucket in blocks for block in bucket) == list(range(8))
        assert len(blocks) > 1
        assert second["buckets"][0][2] < second["backward_ms"]  # launched during backward


def test_torchrun_entry_reports_on_rank_0(capsys):
    run_ranks(dp.main, 2, timeout=300)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[rank 0] 2 ranks, batch 8: gradient vs one process on the whole batch"
    assert all(line.startswith("[rank 0]") for line in lines)
    assert len(lines) == 8
    assert "every rank holds all 4,204,544 parameters" in lines[-1]
