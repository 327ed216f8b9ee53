"""workers.sharding: the FSDP2 worker of chapter 7.

Notebook 05 runs it on 4 real ranks and checks, on every rank, the bytes held and
allocated against ``sharding.fsdp_state_bytes`` and ``fsdp_padded_numel``, the order of
the collectives against ``fsdp_collectives``, the gradient and the Adam update against
one process, the bf16 mixed-precision step, the bytes held at each moment against
``sharding.fsdp_memory_moments`` and the traffic of gradient accumulation against
``sharding.zero_traffic``. Here: what it refuses before starting
any communication.
"""

import pytest
import torch
import torch.distributed as dist

from trainscale.workers import sharding as workers


def test_worker_rejects_a_batch_that_does_not_split():
    with pytest.raises(ValueError, match="batch"):
        workers.worker(0, 3, batch=8)


def test_worker_rejects_micro_batches_that_do_not_split_the_slice():
    # 16 examples on 4 ranks: 4 each, which 3 micro-batches cannot split
    with pytest.raises(ValueError, match="micro_batches"):
        workers.worker(0, 4, batch=16, micro_batches=(1, 3))
    with pytest.raises(ValueError, match="micro_batches"):
        workers.worker(0, 4, batch=16, micro_batches=(0,))
    with pytest.raises(ValueError, match="micro_batches"):
        workers.accumulation_worker(0, 4, micro_batches="12")


# --- the "write it yourself" exercise: the reader's ZeRO-1 step on real ranks ------------


def test_adam_update_is_torch_adam_on_the_same_elements():
    # Three steps of torch.optim.Adam (lr 1e-2, its default betas and eps) on 5 weights.
    weights = torch.tensor([0.5, -1.0, 2.0, 0.0, 3.0], dtype=torch.float64)
    grads = [torch.full((5,), g, dtype=torch.float64) * torch.arange(5) for g in (1, -2, 0.5)]
    param = torch.nn.Parameter(weights.clone())
    optimizer = torch.optim.Adam([param], lr=workers.ZERO1_LR, foreach=False)
    state, ours = {}, weights.clone()
    for grad in grads:
        param.grad = grad
        optimizer.step()
        ours = workers.adam_update(ours, grad, state)
    assert torch.equal(ours, param.detach())
    assert state["step"] == 3 and state["exp_avg"].shape == (5,)
    with pytest.raises(ValueError, match="state holds moments of shape"):
        workers.adam_update(ours[:2], grads[0][:2], state)
    with pytest.raises(ValueError, match="grad has shape"):
        workers.adam_update(ours, grads[0][:2], {})


def _zero1(weights, grad, state):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = weights.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    grad_shard = torch.empty(size, dtype=grad.dtype)
    dist.reduce_scatter_single(grad_shard, grad)
    grad_shard /= n
    shard = adam(weights[mine], grad_shard, state)  # noqa: F821
    new = torch.empty_like(weights)
    dist.all_gather_single(new, shard)
    return new


def _ddp_step(weights, grad, state):
    # Right numbers, but every rank keeps Adam's moments for all the weights.
    grad = grad.clone()
    dist.all_reduce(grad)
    return adam(weights, grad / dist.get_world_size(), state)  # noqa: F821


def _no_all_gather(weights, grad, state):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = weights.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    grad_shard = torch.empty(size, dtype=grad.dtype)
    dist.reduce_scatter_single(grad_shard, grad)
    new = weights.clone()
    new[mine] = adam(weights[mine], grad_shard / n, state)  # noqa: F821
    return new


def _summed(weights, grad, state):
    rank, n = dist.get_rank(), dist.get_world_size()
    size = weights.numel() // n
    grad_shard = torch.empty(size, dtype=grad.dtype)
    dist.reduce_scatter_single(grad_shard, grad)
    shard = adam(weights[rank * size : (rank + 1) * size], grad_shard, state)  # noqa: F821
    new = torch.empty_like(weights)
    dist.all_gather_single(new, shard)
    return new


@pytest.mark.slow
def test_a_correct_zero1_step_passes_every_check():
    report = workers.check_zero1_exercise(_zero1)
    assert report.passed, str(report)
    text = str(report)
    # 1,024 weights on 4 ranks: a slice of 256, two moments of it = 512 values.
    assert "each rank's optimiser state holds 512 values" in text
    # float64: the gradient is 8,192 bytes, a slice 2,048.
    assert "gradient (8,192 bytes) into a reduce-scatter and its slice (2,048 bytes)" in text


@pytest.mark.slow
def test_a_ddp_step_has_the_right_weights_but_fails_on_state_and_traffic():
    text = str(workers.check_zero1_exercise(_ddp_step, steps=1))
    assert "ok: step 1: every rank's weights equal" in text
    assert "the ranks' optimiser states hold [2048, 2048, 2048, 2048] values" in text
    assert "you all-reduced" in text


@pytest.mark.slow
def test_a_step_without_the_all_gather_says_to_gather():
    report = workers.check_zero1_exercise(_no_all_gather, steps=1)
    assert not report.passed
    assert "own slice is right, the rest of its weights is not: all-gather" in str(report)


@pytest.mark.slow
def test_a_step_on_the_summed_gradient_is_caught_and_named():
    report = workers.check_zero1_exercise(_summed, steps=1)
    assert not report.passed
    assert "Adam on the *sum* of the ranks' gradients" in str(report)


def test_zero1_exercise_arguments_are_checked_before_any_process_starts():
    with pytest.raises(ValueError, match="length must be a multiple of ranks"):
        workers.check_zero1_exercise(_zero1, ranks=3, length=1024)
    with pytest.raises(ValueError, match="steps"):
        workers.check_zero1_exercise(_zero1, steps=0)
