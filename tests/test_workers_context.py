"""workers.context, beyond what notebook 14 checks when it runs the worker on 4 real ranks
(causal ring, zig-zag and all-to-all attention against one process, forward and backward,
their bytes received and work, with as many key-value heads as heads and with one
key-value head for 8 query heads): the one-process reference, the inputs, the arguments
refused before any communication, a non-causal run on 2 ranks, and grouped-query attention
whose key-value heads split without copies (two per rank on 2 ranks)."""

import math

import pytest
import torch

from trainscale.distributed import run_ranks
from trainscale.workers import context as wc


def test_reference_attention_matches_pytorch_sdpa():
    q, k, v, _ = wc.sequence_inputs(batch=2, heads=3, seq=10, head_dim=4)
    for causal in (True, False):
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        assert torch.allclose(wc.reference_attention(q, k, v, causal), expected, atol=1e-12)


def test_reference_attention_with_grouped_heads_matches_pytorch_sdpa():
    # PyTorch's enable_gqa: query head i uses key-value head i // (heads / kv_heads), as ours.
    q, k, v, _ = wc.sequence_inputs(batch=2, heads=6, seq=10, head_dim=4, kv_heads=2)
    assert k.shape == v.shape == (2, 2, 10, 4)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True
    )
    assert torch.allclose(wc.reference_attention(q, k, v), expected, atol=1e-12)


def test_sequence_inputs_refuse_kv_heads_that_do_not_divide_heads():
    with pytest.raises(ValueError, match="kv_heads"):
        wc.sequence_inputs(heads=6, kv_heads=4)


def test_reference_attention_first_token_sees_only_itself():
    q, k, v, _ = wc.sequence_inputs(seq=5)
    out = wc.reference_attention(q, k, v)
    assert torch.equal(out[..., 0, :], v[..., 0, :])


def test_inputs_are_float64_and_reproducible():
    first, again = wc.sequence_inputs(seed=3), wc.sequence_inputs(seed=3)
    assert all(t.dtype == torch.float64 for t in first)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], wc.sequence_inputs(seed=4)[0])


def test_worker_refuses_bad_splits_before_communicating():
    with pytest.raises(ValueError, match="local_seq"):
        wc.worker(0, 4, heads=4, local_seq=15)
    with pytest.raises(ValueError, match="heads"):
        wc.worker(0, 4, heads=6)
    # Ulysses needs whole query heads per rank: 4 query heads cannot go 8 ways, whatever kv_heads.
    with pytest.raises(ValueError, match="heads must be divisible"):
        wc.worker(0, 8, heads=4, kv_heads=1)
    # 12 query heads on 4 ranks, but 3 key-value heads neither split 4 ways nor copy to 4.
    with pytest.raises(ValueError, match="kv_heads"):
        wc.worker(0, 4, heads=12, kv_heads=3)


@pytest.mark.slow
def test_non_causal_attention_on_two_ranks_equals_one_process():
    results = run_ranks(wc.worker, 2, 1, 2, 4, 4, 5, False, False, timeout=120)
    q, k, v, d_out = (t.requires_grad_(True) for t in wc.sequence_inputs(1, 2, 8, 4, 5))
    expected = wc.reference_attention(q, k, v, causal=False)
    expected.backward(d_out.detach())
    for name in ("ring", "ring zigzag", "ulysses"):
        for rank, got in enumerate(results):
            index = got[name]["positions"]
            assert torch.allclose(got[name]["output"], expected.detach()[..., index, :], atol=1e-12)
            assert torch.allclose(got[name]["dk"], k.grad[..., index, :], atol=1e-12), rank
    # Without a mask nothing is skipped: every rank computes N = 2 whole blocks, 4 x 4 pairs each.
    assert [r["ring zigzag"]["blocks"] for r in results] == [2.0, 2.0]
    assert [r["ring"]["pairs"] for r in results] == [32, 32]
    assert math.isclose(results[0]["ring"]["bytes sent"]["forward"], 2 * 1 * 4 * 8 * 8)


@pytest.mark.slow
def test_grouped_heads_split_without_copies_on_two_ranks():
    # 4 query heads and 2 key-value heads on 2 ranks: each rank gets 2 query heads and the one
    # key-value head they share, no copy; the ring passes only the 2 key-value heads.
    results = run_ranks(wc.worker, 2, 1, 4, 4, 4, 7, False, True, 2, timeout=120)
    q, k, v, d_out = (t.requires_grad_(True) for t in wc.sequence_inputs(1, 4, 8, 4, 7, 2))
    expected = wc.reference_attention(q, k, v)
    expected.backward(d_out.detach())
    wanted = {"output": expected.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    for name in ("ring", "ring zigzag", "ulysses"):
        for got in results:
            index = got[name]["positions"]
            for key, full in wanted.items():
                assert torch.allclose(got[name][key], full[..., index, :], atol=1e-12), (name, key)
    # Bytes that arrived, 8-byte values, L = 4 tokens, head size 4. The ring's forward brings
    # one block of K and of V (2 heads each): 2 * (4 * 2 * 4) * 8 = 512 B; backward 6 blocks of
    # 256 B (K and V once more, then dK and dV twice). Ulysses: half of each of Q (4 heads),
    # K, V (2 heads) and the output (4 heads) crosses: (64 + 32 + 32 + 64) * 8 / 2 = 768 B.
    for got in results:
        assert got["ring"]["bytes received"] == {"forward": 512, "backward": 1536}
        assert got["ulysses"]["bytes received"] == {"forward": 768, "backward": 768}
