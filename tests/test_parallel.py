"""parallel: every simulated parallelism equals the single-device computation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from trainscale.collectives import ring_bytes_per_rank
from trainscale.memory import mlp_stack
from trainscale.parallel import (
    IGNORE_INDEX,
    accumulated_gradient,
    accumulated_token_gradient,
    attention_by_heads,
    checkpointed_gradient,
    data_parallel_gradient,
    first_matrix_by_rows_mlp,
    full_batch_gradient,
    layer_collective_bytes,
    layer_collectives,
    multi_head_attention,
    padded_micro_batches,
    tensor_parallel_mlp,
    tensor_parallel_shapes,
    tensor_parallel_traffic,
    token_count,
    token_mean_gradient,
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


# --- gradient accumulation of a token loss ------------------------------------------------


def _zero_classifier() -> nn.Linear:
    """One input feature, two classes, weights 0: every softmax is (1/2, 1/2), so a
    token with input x and label c adds (1/2 - [k == c]) * x to row k of the gradient."""
    layer = nn.Linear(1, 2, bias=False).double()
    nn.init.zeros_(layer.weight)
    return layer


def _hand_worked_batches():
    # Micro-batch A: one token (x = 1, label 0) and a padded position (x = 7, ignored).
    # Micro-batch B: three tokens (x = 1, label 1).
    a = (torch.tensor([[1.0], [7.0]], dtype=torch.float64), torch.tensor([0, IGNORE_INDEX]))
    b = (torch.ones(3, 1, dtype=torch.float64), torch.tensor([1, 1, 1]))
    return [a, b]


def test_token_gradients_hand_worked():
    # Per token, row 0 of the gradient: A's token -1/2, each of B's +1/2.
    # Full batch, mean over 4 tokens: (-1/2 + 3/2) / 4 = +1/4 (row 1: -1/4).
    # Mean per micro-batch, / 2: (-1/2 + 1/2) / 2 = 0: the one token of A weighs as much
    # as B's three together. Summed loss / 4 tokens: +1/4 again.
    model, batches = _zero_classifier(), _hand_worked_batches()
    full = token_mean_gradient(model, batches)["weight"]
    wrong = accumulated_token_gradient(model, batches, "micro-batch mean")["weight"]
    right = accumulated_token_gradient(model, batches, "global token count")["weight"]
    assert full.flatten().tolist() == pytest.approx([0.25, -0.25], abs=1e-15)
    assert wrong.flatten().tolist() == pytest.approx([0.0, 0.0], abs=1e-15)
    assert right.flatten().tolist() == pytest.approx([0.25, -0.25], abs=1e-15)


@settings(max_examples=20)  # each example runs up to 6 backward passes
@given(
    st.lists(st.integers(0, 6), min_size=1, max_size=5).filter(lambda t: sum(t) > 0),
    st.integers(0, 3),
)
def test_global_token_count_is_the_full_batch_mean_for_any_counts(tokens, seed):
    model = mlp_stack(width=4, blocks=1).double()
    batches = padded_micro_batches(tokens, 6, features=4, classes=4, seed=seed)
    assert _close(
        accumulated_token_gradient(model, batches, "global token count"),
        token_mean_gradient(model, batches),
        atol=1e-12,
    )


@given(st.integers(1, 6), st.integers(1, 5))
def test_micro_batch_mean_is_exact_when_every_micro_batch_has_as_many_tokens(tokens, k):
    model = mlp_stack(width=4, blocks=1).double()
    batches = padded_micro_batches([tokens] * k, 6, features=4, classes=4)
    assert _close(
        accumulated_token_gradient(model, batches, "micro-batch mean"),
        token_mean_gradient(model, batches),
        atol=1e-12,
    )


def test_padded_micro_batches_pad_after_the_real_tokens():
    batches = padded_micro_batches([3, 0, 5], 5, features=2, classes=3, seed=1)
    assert [tuple(x.shape) for x, _ in batches] == [(5, 2)] * 3
    assert [token_count(y) for _, y in batches] == [3, 0, 5]
    assert batches[0][1][3:].tolist() == [IGNORE_INDEX] * 2
    assert all(0 <= int(c) < 3 for c in batches[2][1])
    assert batches[0][0].dtype == torch.float64
    again = padded_micro_batches([3, 0, 5], 5, features=2, classes=3, seed=1)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    assert token_count(torch.tensor([3, IGNORE_INDEX, 0])) == 2


def test_token_functions_name_bad_arguments():
    model = _zero_classifier()
    with pytest.raises(ValueError, match="tokens must be a non-empty list"):
        padded_micro_batches([2, 9], 8, features=1, classes=2)
    with pytest.raises(ValueError, match="tokens must be a non-empty list"):
        padded_micro_batches([], 8, features=1, classes=2)
    with pytest.raises(ValueError, match="classes"):
        padded_micro_batches([2], 8, features=1, classes=1)
    with pytest.raises(ValueError, match="normalise"):
        accumulated_token_gradient(model, _hand_worked_batches(), "mean")
    padding_only = padded_micro_batches([0, 0], 2, features=1, classes=2)
    with pytest.raises(ValueError, match="at least one real"):
        token_mean_gradient(model, padding_only)
    with pytest.raises(ValueError, match="at least one real"):
        accumulated_token_gradient(model, [], "global token count")
    one_empty = padded_micro_batches([2, 0], 2, features=1, classes=2)
    with pytest.raises(ValueError, match="each hold a real token"):
        accumulated_token_gradient(model, one_empty, "micro-batch mean")


def test_layer_collectives_of_each_way_of_running_sequence_parallelism():
    assert layer_collectives() == {"forward": {"all-reduce": 2}, "backward": {"all-reduce": 2}}
    halves = {"all-gather": 2, "reduce-scatter": 2}
    assert layer_collectives("keep gathered") == {"forward": halves, "backward": halves}
    regather = layer_collectives("re-gather")
    assert regather["forward"] == halves
    assert regather["backward"] == {"all-gather": 4, "reduce-scatter": 2}  # + 2 re-gathers


def test_layer_collective_bytes_of_the_7b_layer_by_hand():
    # 4,096 x 4,096 bf16 = 32 MiB per collective; at t = 8 each half sends 7/8 of it,
    # 28 MiB: 8 halves = 224 MiB (TP alone, and DTensor's SP), 10 halves = 280 MiB.
    mib = 2**20
    assert layer_collective_bytes(4096, 4096, 8) == 224 * mib
    assert layer_collective_bytes(4096, 4096, 8, 2, "keep gathered") == 224 * mib
    assert layer_collective_bytes(4096, 4096, 8, 2, "re-gather") == 280 * mib
    assert layer_collective_bytes(4096, 4096, 8) == sum(
        tensor_parallel_traffic(4096, 4096, 8).values()
    )
    assert layer_collective_bytes(4096, 4096, 1, 2, "re-gather") == 0  # one device sends nothing


@given(st.integers(1, 4096), st.integers(1, 1024), st.integers(2, 64))
def test_re_gathering_sends_a_quarter_more(tokens, hidden, shards):
    plain = layer_collective_bytes(tokens, hidden, shards, 2, "keep gathered")
    assert math.isclose(
        layer_collective_bytes(tokens, hidden, shards, 2, "re-gather"), 1.25 * plain
    )


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: layer_collectives("megatron"), "style"),
        (lambda: layer_collective_bytes(8, 8, 2, 2, "dtensor"), "style"),
        (lambda: layer_collective_bytes(0, 8, 2), "tokens"),
        (lambda: layer_collective_bytes(8, 8, 0), "shards"),
        (lambda: layer_collective_bytes(8, 8, 2, 0), "bytes_per_value"),
    ],
)
def test_layer_collectives_name_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()
