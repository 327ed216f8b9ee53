"""The dropless layer: padding, permutation traffic, and the layer against the per-token
reference (trainscale.experts.dropless)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainscale import experts as ex
from trainscale.experts import dropless as dl


def test_padded_rows_by_hand():
    # The chapter's skewed loads, tile 8: 24 + 32 + 0 + 24 + 8 + 56 + 8 + 0 = 152.
    assert dl.padded_rows([18, 30, 0, 19, 4, 54, 3, 0], 8) == 152
    # Tile 128 (MegaBlocks' blocks): 5 -> 128, 0 -> 0, 130 -> 256.
    assert dl.padded_rows([5, 0, 130], 128) == 384
    assert dl.padded_rows(torch.tensor([5, 0, 130]), 1) == 135


def test_padding_flops_by_hand():
    # 384 - 135 = 249 padding rows, each 3 passes x 2 FLOPs x 2 matrices x 2 x 3 = 72 FLOPs.
    assert dl.padding_flops([5, 0, 130], 128, hidden=2, ffn=3, matrices_per_expert=2) == 17_928
    assert dl.padding_flops([128, 256], 128, hidden=7168, ffn=2048) == 0


@given(st.lists(st.integers(0, 500), min_size=1, max_size=16), st.integers(1, 200))
def test_padding_is_less_than_a_tile_per_expert(counts, tile):
    padded = dl.padded_rows(counts, tile)
    assert padded % tile == 0
    assert sum(counts) <= padded <= sum(counts) + len(counts) * (tile - 1)
    assert dl.padded_rows(counts, 1) == sum(counts)


def test_permute_bytes_by_hand():
    # (3 k + 1) T d b = 7 x 10 x 4 x 2 = 560
    assert dl.permute_bytes(10, 4, 2, 2) == 560
    assert dl.permute_bytes(0, 4, 2) == 0


def test_permute_to_compute_by_hand():
    # (3 + 1) x 1 / (2 x 1 x 1 x 1 x 1) = 2
    assert dl.permute_to_compute(1, 1, 1.0, 1.0, 1.0, 1, 1) == pytest.approx(2)
    # DeepSeek-V3's experts on an H100: 25 x 2 x 989e12 x 0.4 / (2 x 3 x 2048 x 8 x 3.35e12)
    # = 1.978e16 / 3.2932e17 = 0.0601
    assert dl.permute_to_compute(8, 2048, 989e12, 0.4, 3.35e12) == pytest.approx(0.0601, abs=1e-4)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: dl.padded_rows([3, -1], 8), "counts"),
        (lambda: dl.padded_rows([], 8), "counts"),
        (lambda: dl.padded_rows([3], 0), "tile"),
        (lambda: dl.padding_flops([3], 8, 0, 4), "hidden"),
        (lambda: dl.permute_bytes(-1, 4, 2), "tokens"),
        (lambda: dl.permute_bytes(1, 4, 0), "top_k"),
        (lambda: dl.permute_to_compute(2, 16, 1e15, 1.5, 3e12), "mfu"),
        (lambda: dl.permute_to_compute(2, 16, 1e15, 0.4, 0), "memory_bandwidth"),
    ],
)
def test_bad_arguments_are_refused(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def _weights(hidden, ffn, n_experts, seed=0):
    layer = ex.MoELayer(hidden, ffn, n_experts, 1, None, seed=seed)
    return [p.detach().clone() for p in (layer.router, layer.w_up, layer.w_down)]


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 24), st.integers(2, 6), st.integers(1, 3), st.integers(0, 1000))
def test_dropless_equals_the_reference_and_drops_nothing(tokens, n_experts, top_k, seed):
    top_k = min(top_k, n_experts)
    weights = _weights(4, 8, n_experts, seed)
    x = ex.sample_tokens(tokens, 4, seed=seed, skew=3.0)  # skewed: some experts get nothing
    out, counts = dl.dropless_forward(x, *weights, top_k)
    reference = ex.per_token_reference(x, *weights, top_k, None)
    assert sum(counts) == tokens * top_k and reference.dropped == 0
    assert torch.allclose(out, reference.output, rtol=0, atol=1e-12)


def test_dropless_gradients_equal_the_reference_in_both_gate_conventions():
    for renormalise in (True, False):
        weights = [w.requires_grad_(True) for w in _weights(4, 8, 4)]
        x = ex.sample_tokens(12, 4, skew=2.0).requires_grad_(True)
        out, _ = dl.dropless_forward(x, *weights, 2, renormalise=renormalise)
        got = torch.autograd.grad(out.square().sum(), [x, *weights])
        ref = ex.per_token_reference(x, *weights, 2, None, renormalise=renormalise).output
        want = torch.autograd.grad(ref.square().sum(), [x, *weights])
        for a, b in zip(got, want, strict=True):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_expert_mlps_handles_empty_groups_on_both_paths():
    _, w_up, w_down = (w.float() for w in _weights(8, 16, 3))
    rows = torch.randn(5, 8, dtype=torch.float64).float()
    counts = [0, 5, 0]
    looped = dl.expert_mlps(rows, w_up, w_down, counts, grouped=False)
    grouped = dl.expert_mlps(rows, w_up, w_down, counts, grouped=True)
    assert torch.allclose(looped, grouped, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="counts"):
        dl.expert_mlps(rows, w_up, w_down, [1, 1, 1])


def test_grouped_mm_in_torch_takes_float32_but_not_float64_nor_unaligned_rows():
    # What can_group encodes, checked against torch itself.
    w = torch.randn(2, 8, 8, dtype=torch.float64)
    x = torch.randn(4, 8, dtype=torch.float64)
    ends = torch.tensor([1, 4], dtype=torch.int32)
    assert torch.nn.functional.grouped_mm(x.float(), w.float(), offs=ends).shape == (4, 8)
    with pytest.raises(RuntimeError):
        torch.nn.functional.grouped_mm(x, w, offs=ends)
    with pytest.raises(RuntimeError, match="16 bytes"):
        torch.nn.functional.grouped_mm(x[:, :6].float(), w[:, :6, :6].float(), offs=ends)
    assert dl.can_group(x.float(), w.float(), w.float())
    assert not dl.can_group(x, w, w)
    assert not dl.can_group(x[:, :6].float(), w[:, :6, :6].float(), w[:, :6, :6].float())
    with pytest.raises(ValueError, match="grouped"):
        dl.dropless_forward(x, x[:2], w, w, 1, grouped=True)


def test_dropless_forward_rejects_mismatched_shapes():
    router, w_up, w_down = _weights(4, 8, 4)
    with pytest.raises(ValueError, match="router"):
        dl.dropless_forward(torch.zeros(3, 5, dtype=torch.float64), router, w_up, w_down, 1)
