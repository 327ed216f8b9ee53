"""workers.context, beyond what notebook 14 checks when it runs the worker on 4 real ranks
(causal ring, zig-zag and all-to-all attention against one process, forward and backward,
their bytes and work): the one-process reference, the inputs, the arguments refused before
any communication, and a non-causal run on 2 ranks."""

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
