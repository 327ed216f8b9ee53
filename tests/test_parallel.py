"""parallel: every simulated parallelism equals the single-device computation."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from trainscale.memory import mlp_stack
from trainscale.parallel import (
    accumulated_gradient,
    checkpointed_gradient,
    data_parallel_gradient,
    full_batch_gradient,
    pipeline_bubble,
    tensor_parallel_mlp,
)

loss = nn.functional.mse_loss


def _data(batch: int, width: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def _close(a: dict, b: dict, atol: float = 1e-6) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol) for k in a)


def test_four_replicas_on_quarter_batches_equal_the_full_batch():
    model = mlp_stack(width=16, blocks=2)
    x, y = _data(64)
    assert _close(
        data_parallel_gradient(model, loss, x, y, 4), full_batch_gradient(model, loss, x, y)
    )


@given(st.integers(1, 12), st.integers(1, 12))
def test_weighted_mean_is_exact_for_any_slicing(batch, replicas):
    model = mlp_stack(width=4, blocks=1)
    x, y = _data(batch, width=4)
    if replicas > batch:
        with pytest.raises(ValueError, match="replicas"):
            data_parallel_gradient(model, loss, x, y, replicas)
        return
    full = full_batch_gradient(model, loss, x, y)
    assert _close(data_parallel_gradient(model, loss, x, y, replicas), full)
    assert _close(accumulated_gradient(model, loss, x, y, replicas), full)


def test_plain_mean_is_wrong_for_unequal_slices():
    model = mlp_stack(width=8, blocks=1)
    x, y = _data(10, width=8)
    full = full_batch_gradient(model, loss, x, y)
    assert not _close(data_parallel_gradient(model, loss, x, y, 4, weighted=False), full)
    assert _close(data_parallel_gradient(model, loss, x, y, 5, weighted=False), full)


def test_gradients_leave_the_model_untouched():
    model = mlp_stack(width=8, blocks=1)
    x, y = _data(8, width=8)
    accumulated_gradient(model, loss, x, y, 2)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("segment", [1, 3, 8])
def test_checkpointed_gradient_equals_plain(segment):
    model = mlp_stack(width=16, blocks=8)
    x, y = _data(32)
    assert _close(
        checkpointed_gradient(model, loss, x, y, segment), full_batch_gradient(model, loss, x, y)
    )


@given(st.integers(1, 40))
def test_tensor_parallel_mlp_equals_unsplit(shards):
    g = torch.Generator().manual_seed(shards)
    x, w1, w2 = (
        torch.randn(5, 8, generator=g),
        torch.randn(8, 32, generator=g),
        torch.randn(32, 8, generator=g),
    )
    expected = nn.functional.gelu(x @ w1) @ w2
    assert torch.allclose(tensor_parallel_mlp(x, w1, w2, shards), expected, atol=1e-5)


def test_tensor_parallel_rejects_shapes_that_do_not_chain():
    with pytest.raises(ValueError, match="shapes"):
        tensor_parallel_mlp(torch.zeros(2, 3), torch.zeros(4, 5), torch.zeros(5, 3), 2)


def test_gpipe_bubbles():
    assert pipeline_bubble(4, 4) == pytest.approx(3 / 7)
    assert pipeline_bubble(4, 12) == pytest.approx(0.2)
    assert pipeline_bubble(1, 1) == 0.0
    assert pipeline_bubble(8, 29) < 0.2 <= pipeline_bubble(8, 28)


@given(st.integers(1, 10**6), st.integers(1, 10**6))
def test_bubble_is_a_share_and_shrinks_with_micro_batches(stages, micro):
    bubble = pipeline_bubble(stages, micro)
    assert 0.0 <= bubble < 1.0
    assert pipeline_bubble(stages, micro + 1) <= bubble


@pytest.mark.parametrize(("args", "name"), [((0, 4), "stages"), ((4, 0), "micro_batches")])
def test_bubble_names_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        pipeline_bubble(*args)
