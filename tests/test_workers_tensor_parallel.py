"""Chapter 06: tensor parallelism simulated (trainscale.parallel) and run for real (DTensor)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from trainscale import figures
from trainscale.collectives import ring_bytes_per_rank
from trainscale.distributed import run_ranks
from trainscale.parallel import (
    attention_by_heads,
    first_matrix_by_rows_mlp,
    multi_head_attention,
    tensor_parallel_shapes,
    tensor_parallel_traffic,
)
from trainscale.workers import tensor_parallel as workers


def _mlp_data(seed: int, batch: int = 5, d: int = 8, h: int = 32):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, d, generator=g),
        torch.randn(d, h, generator=g) / d**0.5,
        torch.randn(h, d, generator=g) / h**0.5,
    )


def _unsplit(x, w1, w2):
    return nn.functional.gelu(x @ w1) @ w2


# --- The wrong split -------------------------------------------------------------------


@given(st.integers(1, 8), st.integers(0, 1000))
def test_rows_first_is_right_only_with_a_sum_before_gelu(shards, seed):
    x, w1, w2 = _mlp_data(seed)
    copies = [t.clone() for t in (x, w1, w2)]
    expected = _unsplit(x, w1, w2)
    assert torch.allclose(first_matrix_by_rows_mlp(x, w1, w2, shards, True), expected, atol=1e-5)
    wrong = first_matrix_by_rows_mlp(x, w1, w2, shards, False)
    if shards == 1:
        assert torch.allclose(wrong, expected, atol=1e-6)
    else:
        assert (wrong - expected).abs().max() > 1e-2
    assert all(torch.equal(a, b) for a, b in zip((x, w1, w2), copies, strict=True))


def test_gelu_of_a_sum_is_not_the_sum_of_gelus():
    a, b = torch.tensor(1.0), torch.tensor(-1.0)
    gelu = nn.functional.gelu
    assert gelu(a + b) == 0
    # gelu(x) = x * Phi(x): gelu(1) + gelu(-1) = Phi(1) - Phi(-1) = erf(1 / sqrt(2))
    assert gelu(a) + gelu(b) == pytest.approx(math.erf(2**-0.5), abs=1e-6)


def test_wrong_split_names_bad_arguments():
    x, w1, w2 = _mlp_data(0)
    with pytest.raises(ValueError, match="sync_before_gelu"):
        first_matrix_by_rows_mlp(x, w1, w2, 2, 1)
    with pytest.raises(ValueError, match="shards"):
        first_matrix_by_rows_mlp(x, w1, w2, 0, True)
    with pytest.raises(ValueError, match="shapes"):
        first_matrix_by_rows_mlp(x, w1.T, w2, 2, True)


# --- Shapes and traffic ----------------------------------------------------------------


def test_shapes_of_a_four_way_split():
    shapes = tensor_parallel_shapes(4096, 4096, 16384, 4)
    assert len(shapes) == 4
    assert shapes[0] == {
        "input": (4096, 4096),
        "first matrix": (4096, 4096),
        "hidden slice": (4096, 4096),
        "second matrix": (4096, 4096),
        "partial output": (4096, 4096),
    }


@given(st.integers(1, 500), st.integers(1, 64))
def test_shapes_split_the_hidden_layer_like_the_simulation(ffn, shards):
    if shards > ffn:
        with pytest.raises(ValueError, match="shards"):
            tensor_parallel_shapes(3, 4, ffn, shards)
        return
    shapes = tensor_parallel_shapes(3, 4, ffn, shards)
    widths = [s["hidden slice"][1] for s in shapes]
    blocks = torch.tensor_split(torch.empty(4, ffn), shards, dim=1)
    assert widths == [b.shape[1] for b in blocks]
    assert sum(widths) == ffn


def test_traffic_per_layer_is_four_all_reduces_of_the_activations():
    traffic = tensor_parallel_traffic(4096, 4096, 8)
    assert len(traffic) == 4
    one = 2 * 7 / 8 * 4096 * 4096 * 2
    assert one == 58_720_256
    assert set(traffic.values()) == {one}
    assert set(tensor_parallel_traffic(4096, 4096, 1).values()) == {0}


@given(st.integers(1, 10**5), st.integers(1, 10**4), st.integers(1, 512))
def test_traffic_matches_the_ring(tokens, hidden, shards):
    traffic = tensor_parallel_traffic(tokens, hidden, shards, bytes_per_value=4)
    assert sum(traffic.values()) == pytest.approx(
        4 * ring_bytes_per_rank(4 * tokens * hidden, shards)
    )


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: tensor_parallel_traffic(0, 8, 2), "tokens"),
        (lambda: tensor_parallel_traffic(8, 8, 0), "shards"),
        (lambda: tensor_parallel_shapes(8, 0, 8, 2), "hidden"),
        (lambda: tensor_parallel_shapes(8, 8, 8, 9), "shards"),
    ],
)
def test_shape_and_traffic_functions_name_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# --- Attention by heads ----------------------------------------------------------------


def _attention_data(seed: int, d: int = 16, shape=(2, 5)):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, d, generator=g)
    return x, [torch.randn(d, d, generator=g) / d**0.5 for _ in range(4)]


def test_attention_matches_pytorch_multihead_attention():
    x, (wq, wk, wv, wo) = _attention_data(0)
    reference = nn.MultiheadAttention(16, 4, bias=False, batch_first=True)
    with torch.no_grad():
        reference.in_proj_weight.copy_(torch.cat([wq.T, wk.T, wv.T]))
        reference.out_proj.weight.copy_(wo.T)
    expected = reference(x, x, x, need_weights=False)[0]
    assert torch.allclose(multi_head_attention(x, wq, wk, wv, wo, 4), expected, atol=1e-6)


@given(st.sampled_from([1, 2, 4, 8, 16]), st.integers(1, 16), st.integers(0, 100))
def test_attention_split_by_heads_equals_unsplit(heads, shards, seed):
    x, weights = _attention_data(seed)
    copies = [w.clone() for w in weights]
    if shards > heads:
        with pytest.raises(ValueError, match="shards"):
            attention_by_heads(x, *weights, heads, shards)
        return
    expected = multi_head_attention(x, *weights, heads)
    assert torch.allclose(attention_by_heads(x, *weights, heads, shards), expected, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(weights, copies, strict=True))


def test_attention_names_bad_arguments():
    x, weights = _attention_data(0)
    with pytest.raises(ValueError, match="heads"):
        multi_head_attention(x, *weights, 3)
    with pytest.raises(ValueError, match="wo"):
        multi_head_attention(x, *weights[:3], torch.zeros(16, 8), 4)


# --- Figures ---------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, 2, 8])
def test_diagram_draws_one_lane_per_device(shards):
    fig = figures.tensor_parallel_mlp_diagram(
        tensor_parallel_shapes(16, 8, 32, shards), "test", note="n"
    )
    lanes = [t.get_text() for t in fig.axes[0].texts if t.get_text().startswith("device")]
    assert lanes == [f"device {i}" for i in range(shards)]


def test_time_bars_draw_and_reject_unknown_kinds():
    fig = figures.time_bars({"compute: a": 1.0, "communication: b": 2.0}, "t")
    assert len(fig.axes[0].patches) == 2
    with pytest.raises(KeyError):
        figures.time_bars({"sleep: c": 1.0}, "t")


# --- DTensor and plain all-reduce on real processes -----------------------------------


@pytest.fixture(scope="module")
def tp_run():
    return run_ranks(workers.worker, 4, timeout=180)


def test_dtensor_and_by_hand_equal_the_unsplit_mlp(tp_run):
    mlp, _ = workers.layers()
    x = workers.layer_input().requires_grad_(True)
    expected = mlp(x)
    expected.sum().backward()
    for result in tp_run:
        for version in ("DTensor", "by hand"):
            assert torch.allclose(result[version]["output"], expected, atol=1e-6)
            assert torch.allclose(result[version]["input gradient"], x.grad, atol=1e-6)
        grads = result["DTensor"]["weight gradients"]
        assert all(torch.allclose(grads[n], p.grad, atol=1e-6) for n, p in mlp.named_parameters())
        start, stop = result["by hand"]["my rows"]
        assert torch.allclose(
            result["by hand"]["my weight gradient"], mlp.up.weight.grad[start:stop], atol=1e-6
        )
    assert [r["by hand"]["my rows"] for r in tp_run] == [(0, 16), (16, 32), (32, 48), (48, 64)]


def test_dtensor_runs_one_all_reduce_each_way(tp_run):
    for result in tp_run:
        assert result["DTensor"]["forward collectives"] == {"all_reduce": 1}
        assert result["DTensor"]["backward collectives"] == {"all_reduce": 1}
        assert result["DTensor"]["local shapes"] == {
            "up.weight": (16, 16),
            "up.bias": (16,),
            "down.weight": (16, 16),
            "down.bias": (16,),
        }


def test_dtensor_attention_by_heads_equals_unsplit(tp_run):
    _, attention = workers.layers()
    x = workers.layer_input()
    weights = [getattr(attention, n).weight.T for n in "qkvo"]
    expected = multi_head_attention(x, *weights, 8).detach()
    assert torch.allclose(attention(x).detach(), expected, atol=1e-6)
    assert torch.allclose(attention_by_heads(x, *weights, 8, 4).detach(), expected, atol=1e-6)
    for result in tp_run:
        assert torch.allclose(result["attention"]["output"], expected, atol=1e-6)
        assert result["attention"]["heads here"] == 2
        assert result["attention"]["forward collectives"] == {"all_reduce": 1}


def test_worker_rejects_splits_dtensor_cannot_make():
    with pytest.raises(ValueError, match="heads"):
        workers.worker(0, 3, ffn=63, heads=8)
    with pytest.raises(ValueError, match="ffn"):
        workers.worker(0, 4, ffn=62)
