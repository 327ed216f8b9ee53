"""workers.context_mesh, beyond what notebook 14 checks when it runs both workers on 4 real
ranks (the gradients of a dp 2 x cp 2 mesh over the flattened group, over dp alone and under
FSDP2, against one process; Ulysses 2 x ring 2 with 8 query heads and 1 key-value head,
forward and backward, and its bytes received against the formula): the one-process
reference against PyTorch's attention, the token layout, the inputs, the arguments refused
before any communication, and a hybrid whose key-value heads split without copies."""

import pytest
import torch
from torch.nn import functional as F

from trainscale import context
from trainscale.distributed import run_ranks
from trainscale.workers import context as wc
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


@pytest.mark.parametrize(("ulysses", "ring"), [(1, 4), (2, 2), (4, 1), (2, 3)])
def test_hybrid_positions_hold_every_token_once(ulysses, ring):
    seq = 2 * ulysses * ring * 3
    held = [p for r in range(ulysses * ring) for p in wm.hybrid_positions(seq, ulysses, ring, r)]
    assert sorted(held) == list(range(seq))
    # A ring rank's Ulysses ranks hold, together and in order, its two zig-zag chunks.
    group = [p for r in range(ulysses) for p in wm.hybrid_positions(seq, ulysses, ring, r)]
    assert group == context.token_positions(seq, ring, 0, "zigzag")


def test_block_inputs_shapes_and_refusals():
    drawn = wm.block_inputs(3, 10, 6, 2, 4)
    assert drawn["wq"].shape == drawn["wo"].shape == (24, 24)
    assert drawn["wk"].shape == drawn["wv"].shape == (8, 24)
    assert drawn["x"].shape == drawn["y"].shape == (3, 10, 24)
    assert all(t.dtype == torch.float64 for t in drawn.values())
    with pytest.raises(ValueError, match="kv_heads"):
        wm.block_inputs(1, 4, 6, 4, 2)


def test_workers_refuse_bad_meshes_before_communicating():
    with pytest.raises(ValueError, match="dp"):
        wm.gradients_worker(0, 4, dp=3)
    with pytest.raises(ValueError, match="ulysses"):
        wm.hybrid_worker(0, 4, ulysses=3)


@pytest.mark.slow
def test_hybrid_with_key_value_heads_split_not_copied():
    # 4 query heads and 2 key-value heads: Ulysses over 2 gives each rank one of each.
    got = run_ranks(wm.hybrid_worker, 4, 2, 4, 2, 6, 4, 1, timeout=120)
    *qkv, d_out = wc.sequence_inputs(1, 4, 24, 4, 1, 2)
    q, k, v = (t.clone().requires_grad_(True) for t in qkv)
    full = wc.reference_attention(q, k, v)
    full.backward(d_out)
    wanted = {"output": full.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for rank in got:
        for name, tensor in wanted.items():
            assert torch.allclose(rank[name], tensor[..., rank["positions"], :], atol=1e-12)
        for backward in (False, True):
            formula = context.hybrid_bytes_per_rank(
                6, 2, 2, 16, 8, 8, kv_heads=2, backward=backward
            )
            phase = "backward" if backward else "forward"
            assert {part: rank["bytes received"][part][phase] for part in formula} == formula


@pytest.mark.slow
def test_context_parallel_alone_reduces_over_its_four_ranks():
    # DP 1 x CP 4: one sequence in zig-zag quarters; the flattened group is the CP group.
    got = run_ranks(wm.gradients_worker, 4, 1, 4, 1, 4, 2, 3, timeout=120)
    expected = wm.one_process_gradients(1, 16, 4, 1, 2, seed=3)
    for rank in got:
        for name in wm.NAMES:
            assert torch.allclose(rank["over dp x cp"][name], expected[name], atol=1e-12)
            assert torch.allclose(rank["fsdp"][name], expected[name], atol=1e-12)
        assert not torch.allclose(rank["over dp"]["wq"], expected["wq"], atol=1e-6)
    assert sum(rank["held"] for rank in got) == got[0]["whole"]  # each weight held once
