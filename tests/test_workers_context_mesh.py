"""workers.context_mesh, beyond what notebook 14 checks when it runs the worker on 4 real
ranks (the gradients of a dp 2 x cp 2 mesh over the flattened group, over dp alone and under
FSDP2, against one process): the one-process reference against PyTorch's attention, the
inputs, and the arguments refused before any communication."""

import pytest
import torch
from torch.nn import functional as F

from trainscale.workers import context_mesh as wm


def test_one_process_gradients_match_pytorch_attention():
    # The same loss written with PyTorch's own grouped-query attention and autograd.
    drawn = wm.block_inputs(2, 12, 4, 2, 3, seed=5)
    w = {name: drawn[name].clone().requires_grad_(True) for name in wm.NAMES}
    x = drawn["x"]
    q = (x @ w["wq"].T).unflatten(-1, (4, 3)).transpose(1, 2)
    k = (x @ w["wk"].T).unflatten(-1, (2, 3)).transpose(1, 2)
    v = (x @ w["wv"].T).unflatten(-1, (2, 3)).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    loss = F.mse_loss(out.transpose(1, 2).flatten(-2) @ w["wo"].T, drawn["y"])
    loss.backward()
    got = wm.one_process_gradients(2, 12, 4, 2, 3, seed=5)
    assert torch.allclose(got["loss"], loss.detach(), rtol=0, atol=1e-12)
    for name in wm.NAMES:
        assert torch.allclose(got[name], w[name].grad, rtol=0, atol=1e-12)


def test_block_inputs_shapes_and_refusals():
    drawn = wm.block_inputs(3, 10, 6, 2, 4)
    assert drawn["wq"].shape == drawn["wo"].shape == (24, 24)
    assert drawn["wk"].shape == drawn["wv"].shape == (8, 24)
    assert drawn["x"].shape == drawn["y"].shape == (3, 10, 24)
    assert all(t.dtype == torch.float64 for t in drawn.values())
    with pytest.raises(ValueError, match="kv_heads"):
        wm.block_inputs(1, 4, 6, 4, 2)


def test_worker_refuses_a_bad_mesh_before_communicating():
    with pytest.raises(ValueError, match="dp"):
        wm.gradients_worker(0, 4, dp=3)
