"""transformer: the book's one GPT, its attention, its exact parameter count and the
FLOPs it really runs."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from trainscale import memory, transformer
from trainscale.compute import attention_training_flops, training_budget, training_flops
from trainscale.transformer import (
    GPT,
    GPTConfig,
    attend,
    causal_mask,
    gpt,
    matmul_weights,
    non_embedding_params,
    parameter_counts,
)

SMALL = GPTConfig(vocab=50, context=16, d_model=24, layers=2, heads=3)


def test_gpt2_small_has_124m_parameters():
    # GPT-2 small: 12 layers of width 768, 50,257 tokens, 1,024 positions, tied head.
    config = GPTConfig(vocab=50_257, context=1024, d_model=768, layers=12, heads=12)
    assert sum(parameter_counts(config).values()) == 124_439_808
    # Kaplan's approximation 12 * layers * d_model**2 leaves out biases and norms.
    assert 12 * 12 * 768**2 == 84_934_656
    assert non_embedding_params(config) == 85_056_000
    assert matmul_weights(config) == 84_934_656 + 768 * 50_257


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_counts_match_the_model(tied):
    config = GPTConfig(vocab=50, context=16, d_model=24, layers=3, heads=4, d_ff=40, tied=tied)
    model = gpt(config)
    counts = parameter_counts(config)
    assert sum(p.numel() for p in model.parameters()) == sum(counts.values())
    assert (counts["head"] == 0) is tied
    assert (model.head.weight is model.token_embedding.weight) is tied
    assert (
        non_embedding_params(config) == counts["attention"] + counts["mlp"] + counts["layer norms"]
    )


@given(
    st.integers(1, 40),
    st.integers(1, 20),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(0, 30),
    st.booleans(),
)
def test_parameter_counts_match_for_any_shape(vocab, context, head_width, heads, d_ff, tied):
    config = GPTConfig(
        vocab=vocab,
        context=context,
        d_model=head_width * heads,
        layers=1,
        heads=heads,
        d_ff=d_ff,
        tied=tied,
    )
    model = gpt(config)
    assert sum(p.numel() for p in model.parameters()) == sum(parameter_counts(config).values())


def test_the_capstones_untied_model_by_hand():
    # width 64, 2 blocks. Matrices per block: qkv 3 x 64^2 + proj 64^2 + MLP 4 x 64^2
    # + 4 x 64^2 = 49,152; head 64 x 64 = 4,096. Biases 3 x 64 + 64 + 256 + 64 = 576
    # and two LayerNorms 256 per block, final LayerNorm 128; tables (64 + 32) x 64 = 6,144.
    config = GPTConfig(vocab=64, context=32, d_model=64, layers=2, heads=4, tied=False)
    assert matmul_weights(config) == 2 * 49_152 + 4_096 == 102_400
    assert sum(parameter_counts(config).values()) == 102_400 + 2 * (576 + 256) + 128 + 6_144
    model = gpt(config)
    assert sum(p.numel() for p in model.parameters()) == 110_336
    tables = ("token_embedding.weight", "position_embedding.weight")
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and n not in tables]
    assert matmul_weights(config) == sum(p.numel() for p in matrices)


# --- attention ---------------------------------------------------------------------------


def test_causal_mask_by_hand():
    inf = float("inf")
    expected = torch.tensor([[0.0, -inf, -inf], [0.0, 0.0, -inf], [0.0, 0.0, 0.0]])
    assert torch.equal(causal_mask(3, torch.float32), expected)


@pytest.mark.parametrize("kind", ["naive", "sdpa"])
def test_equal_scores_average_the_values_a_token_may_see(kind):
    # q = 0 makes every score 0: token t weighs tokens 0..t equally (or all 4 without a mask).
    v = torch.arange(8.0).view(1, 1, 4, 2)  # rows (0, 1), (2, 3), (4, 5), (6, 7)
    q = k = torch.zeros(1, 1, 4, 2)
    causal = [[0.0, 1.0], [1.0, 2.0], [2.0, 3.0], [3.0, 4.0]]
    assert attend(q, k, v, kind=kind)[0, 0].tolist() == causal
    assert attend(q, k, v, kind=kind, causal=False)[0, 0].tolist() == [[3.0, 4.0]] * 4


@given(st.integers(0, 50), st.booleans())
def test_naive_and_fused_attention_agree(seed, causal):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=g) for _ in range(3))
    naive = attend(q, k, v, causal=causal, kind="naive")
    fused = attend(q, k, v, causal=causal, kind="sdpa")
    assert torch.allclose(naive, fused, atol=1e-6)


def test_dropout_acts_in_training_mode_only():
    model = gpt(GPTConfig(**(SMALL.__dict__ | {"dropout": 0.5})))
    tokens = torch.randint(SMALL.vocab, (2, SMALL.context))
    with torch.no_grad():
        model.eval()
        assert torch.equal(model(tokens), model(tokens))
        plain = gpt(SMALL)  # the same weights: the seed, not the dropout, draws them
        plain.eval()
        assert torch.equal(model(tokens), plain(tokens))
        model.train()
        assert not torch.equal(model(tokens), model(tokens))


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_full_recomputation_changes_nothing_but_memory(attention):
    tokens = torch.randint(SMALL.vocab, (4, SMALL.context))
    grads, saved = [], []
    for recompute in ("none", "full"):
        config = GPTConfig(**(SMALL.__dict__ | {"attention": attention, "recompute": recompute}))
        model = gpt(config)
        loss = model(tokens).logsumexp(-1).mean()
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
        saved.append(memory.saved_activation_bytes(model, tokens))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert saved[1] < saved[0]


def test_selective_recomputation_changes_nothing_but_memory():
    tokens = torch.randint(SMALL.vocab, (4, SMALL.context))
    grads, saved = [], []
    for recompute in ("none", "selective"):
        model = gpt(GPTConfig(**(SMALL.__dict__ | {"recompute": recompute})))
        loss = model(tokens).logsumexp(-1).mean()
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
        saved.append(memory.saved_activation_bytes(model, tokens))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    # Each layer no longer keeps its softmax output: heads x context^2 floats per sequence.
    assert saved[0] - saved[1] == SMALL.layers * 4 * SMALL.heads * SMALL.context**2 * 4


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_attention_is_causal(attention):
    model = gpt(GPTConfig(**(SMALL.__dict__ | {"attention": attention})), seed=1)
    tokens = torch.randint(SMALL.vocab, (2, SMALL.context))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % SMALL.vocab  # rewrite the future
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :10], after[:, :10])
    assert not torch.allclose(before[:, 10:], after[:, 10:])


def test_same_seed_same_model_and_global_random_state_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first, second = gpt(SMALL, seed=5), gpt(SMALL, seed=5)
    assert torch.equal(torch.rand(3), expected)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(
        gpt(SMALL, seed=6).blocks[0].mlp[0].weight, first.blocks[0].mlp[0].weight
    )


def test_float64_weights_are_drawn_in_float64():
    model = gpt(SMALL, seed=5, dtype=torch.float64)
    weights = list(model.parameters())
    assert all(p.dtype == torch.float64 for p in weights)
    assert model.head.weight is model.token_embedding.weight  # still tied
    assert not torch.equal(weights[0], weights[0].float().double())  # not fp32 values
    assert model.blocks[0].mlp[0].weight.std().item() == pytest.approx(0.02, rel=0.05)
    with pytest.raises(ValueError, match="dtype"):
        gpt(SMALL, dtype=torch.float16)


def test_initialisation_is_gpt2s():
    config = GPTConfig(vocab=512, context=64, d_model=256, layers=8, heads=4)
    model = gpt(config)
    assert model.blocks[0].mlp[0].weight.std().item() == pytest.approx(0.02, rel=0.02)
    residual = 0.02 / 4  # 0.02 / sqrt(2 * 8 layers)
    assert model.blocks[3].attention.proj.weight.std().item() == pytest.approx(residual, rel=0.02)
    assert model.blocks[3].mlp[2].weight.std().item() == pytest.approx(residual, rel=0.02)
    assert torch.equal(model.blocks[0].norm1.weight, torch.ones(256))
    assert torch.equal(model.blocks[0].attention.qkv.bias, torch.zeros(3 * 256))


def test_loss_of_a_fresh_model_is_close_to_log_vocab():
    model = gpt(SMALL)
    tokens = torch.randint(
        SMALL.vocab, (4, SMALL.context + 1), generator=torch.Generator().manual_seed(0)
    )
    loss = model.loss(tokens[:, :-1], tokens[:, 1:]).item()
    assert loss == pytest.approx(torch.log(torch.tensor(50.0)).item(), abs=0.05)


@pytest.mark.parametrize("tied", [True, False])
def test_counted_training_flops_are_6n_plus_the_attention_term(tied):
    """FlopCounterMode sees exactly 6 x matmul weights x tokens + 12 L T d x tokens."""
    config = GPTConfig(vocab=50, context=16, d_model=24, layers=2, heads=3, tied=tied)
    model = gpt(config)
    batch, seq = 3, 16
    tokens = torch.randint(config.vocab, (batch, seq + 1))
    with FlopCounterMode(display=False) as counter:
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    expected = training_flops(matmul_weights(config), batch * seq) + attention_training_flops(
        config.layers, seq, config.d_model, batch * seq
    )
    assert counter.get_total_flops() == expected


def test_sequences_shorter_than_the_context_work_and_longer_ones_do_not():
    model = gpt(SMALL)
    assert model(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, SMALL.vocab)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, SMALL.context + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="tokens must hold 1 to context"):
        model(torch.zeros(1, 0, dtype=torch.long))


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"vocab": 0}, "vocab"),
        ({"context": 0}, "context"),
        ({"d_model": 10, "heads": 3}, "heads"),
        ({"layers": -1}, "layers"),
        ({"d_ff": -4}, "d_ff"),
        ({"heads": 1.5}, "heads"),
        ({"tied": 1}, "tied"),
        ({"attention": "flash"}, "attention"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
        ({"fused_dropout": 0}, "fused_dropout"),
        ({"recompute": "some"}, "recompute"),
        ({"attention": "sdpa", "recompute": "selective"}, "recompute='selective'"),
    ],
)
def test_config_names_the_bad_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        GPTConfig(**({"vocab": 8, "context": 8, "d_model": 8, "layers": 1, "heads": 2} | kwargs))


def test_functions_reject_something_that_is_not_a_config():
    for function in (gpt, parameter_counts, non_embedding_params, matmul_weights, GPT):
        with pytest.raises(ValueError, match="config"):
            function({"d_model": 8})
    with pytest.raises(ValueError, match="kind"):
        attend(*torch.zeros(3, 1, 2, 2), kind="flash")


# --- chapter 14's additions to trainscale.compute ----------------------------------------


def test_attention_term_by_hand():
    # 1 layer, context 4, width 2, one token: 3 x (2 x 4 x 2 scores + 2 x 4 x 2 values).
    assert attention_training_flops(1, 4, 2, 1) == 3 * (2 * 4 * 2 + 2 * 4 * 2) == 96
    assert attention_training_flops(0, 4096, 4096, 10**9) == 0
    # Relative to 6N = 72 l h^2 per token, the term is s / 6h (Narayanan et al.).
    layers, seq, width = 32, 4096, 4096
    six_n = 72 * layers * width**2
    assert attention_training_flops(layers, seq, width, 1) / six_n == pytest.approx(
        seq / (6 * width)
    )


@given(st.integers(0, 200), st.integers(0, 10**6), st.integers(0, 10**5), st.integers(0, 10**13))
def test_attention_term_is_exact_for_huge_counts(layers, context, width, tokens):
    assert (
        attention_training_flops(layers, context, width, tokens)
        == 12 * layers * context * width * tokens
    )


def test_training_budget_worked_examples():
    one_b = training_budget(1e9, 100e9, gpus=8, peak_flops=1000e12, mfu=0.4, price_per_gpu_hour=2.0)
    assert one_b.flops == 6 * 10**20
    assert one_b.seconds == pytest.approx(187_500)
    assert one_b.days == pytest.approx(2.17, abs=0.005)
    assert one_b.gpu_hours == pytest.approx(187_500 * 8 / 3600)  # 416.7
    assert one_b.cost == pytest.approx(2 * 187_500 * 8 / 3600)
    exercise = training_budget(3e9, 300e9, 16, 1000e12, 0.4, 2.0)
    assert exercise.days == pytest.approx(9.77, abs=0.005)


@given(st.integers(1, 10**12), st.integers(1, 10**13), st.integers(1, 10**5))
def test_gpu_hours_do_not_depend_on_the_number_of_gpus(params, tokens, gpus):
    one = training_budget(params, tokens, 1, 1e15, 0.5, 1.0)
    many = training_budget(params, tokens, gpus, 1e15, 0.5, 1.0)
    assert many.gpu_hours == pytest.approx(one.gpu_hours, rel=1e-12)
    assert many.seconds * gpus == pytest.approx(one.seconds, rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"price_per_gpu_hour": 0}, "price_per_gpu_hour"),
        ({"gpus": 0}, "gpus"),
        ({"mfu": 2}, "mfu"),
        ({"params": -1}, "params"),
    ],
)
def test_training_budget_names_the_bad_argument(kwargs, name):
    args = {
        "params": 1e9,
        "tokens": 1e9,
        "gpus": 8,
        "peak_flops": 1e15,
        "mfu": 0.4,
        "price_per_gpu_hour": 2.0,
    } | kwargs
    with pytest.raises(ValueError, match=name):
        training_budget(**args)


def test_attention_term_names_the_bad_argument():
    for kwargs, name in (
        ({"layers": -1}, "layers"),
        ({"context": 1.5}, "context"),
        ({"d_attn": -2}, "d_attn"),
        ({"tokens": -1}, "tokens"),
    ):
        args = {"layers": 1, "context": 1, "d_attn": 1, "tokens": 1} | kwargs
        with pytest.raises(ValueError, match=name):
            attention_training_flops(**args)


# --- QK-layernorm (chapter 13) ---------------------------------------------------------------


def test_qk_norm_adds_two_norms_per_block_and_keeps_the_other_weights():
    plain = GPTConfig(vocab=16, context=8, d_model=12, layers=2, heads=3)
    normed = GPTConfig(vocab=16, context=8, d_model=12, layers=2, heads=3, qk_norm=True)
    # Per block: two norms over a head's 12 / 3 = 4 features, weight and bias: 2 * 2 * 4 = 16.
    assert parameter_counts(normed)["layer norms"] == parameter_counts(plain)["layer norms"] + 32
    with_norms, without = gpt(normed, seed=3), gpt(plain, seed=3)
    assert sum(p.numel() for p in with_norms.parameters()) == sum(parameter_counts(normed).values())
    kept = dict(without.named_parameters())
    for name, p in with_norms.named_parameters():
        if "q_norm" in name or "k_norm" in name:
            assert torch.equal(p, torch.ones(4) if name.endswith("weight") else torch.zeros(4))
        else:
            assert torch.equal(p, kept[name])  # the same draws: only the norms are new


def test_qk_norm_bounds_the_attention_scores():
    # After a layer norm (weight 1, bias 0) each head's query and key have length sqrt(4) = 2,
    # so |q . k| / sqrt(4) <= 2, however large the projections' weights grow.
    config = GPTConfig(vocab=16, context=8, d_model=12, layers=1, heads=3, qk_norm=True)
    model = gpt(config, seed=0, dtype=torch.float64)
    attention = model.blocks[0].attention
    with torch.no_grad():
        attention.qkv.weight.mul_(1e4)
    seen = {}
    for name in ("q_norm", "k_norm"):
        getattr(attention, name).register_forward_hook(
            lambda _module, _args, out, name=name: seen.update({name: out})
        )
    tokens = torch.randint(16, (2, 8), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(model(tokens)).all()
    q, k = seen["q_norm"], seen["k_norm"]  # what the forward pass really used
    assert q.shape == k.shape == (2, 3, 8, 4)
    scores = q @ k.transpose(-2, -1) / 2
    assert 1.0 < float(scores.detach().abs().max()) <= 2 + 1e-9


def test_qk_norm_must_be_a_boolean():
    with pytest.raises(ValueError, match="qk_norm"):
        GPTConfig(qk_norm=1)


def test_the_head_by_head_order_by_hand():
    # width 4, 2 heads of 2: blocked rows are q0 q0 q1 q1 | k0 k0 k1 k1 | v0 v0 v1 v1
    # (0-3, 4-7, 8-11); head by head: q0 q0 k0 k0 v0 v0 | q1 q1 k1 k1 v1 v1.
    order = transformer.qkv_by_head_order(4, 2)
    assert order.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]


@pytest.mark.parametrize("qk_norm", [False, True])
def test_both_qkv_layouts_compute_the_same_function(qk_norm):
    shape = {"vocab": 16, "context": 8, "d_model": 12, "layers": 2, "heads": 3}
    blocked = gpt(GPTConfig(**shape, qk_norm=qk_norm), seed=5)
    by_head = gpt(GPTConfig(**shape, qk_norm=qk_norm, qkv_layout="by_head"), seed=5)
    order = transformer.qkv_by_head_order(12, 3)
    stored = by_head.blocks[1].attention.qkv.weight
    assert torch.equal(stored, blocked.blocks[1].attention.qkv.weight[order])
    tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(0))
    # the same products of the same numbers, in other rows: equal to the last bit here,
    # and within float32 rounding on any CPU
    torch.testing.assert_close(by_head(tokens), blocked(tokens), rtol=1e-6, atol=1e-7)


def test_one_share_of_a_head_by_head_qkv_computes_whole_heads():
    # The rows of heads 1-2 of 4 (as a tensor-parallel rank holds them) give exactly
    # heads 1-2 of the whole attention: the number of heads is read from the width.
    config = GPTConfig(vocab=16, context=8, d_model=16, layers=1, heads=4, qkv_layout="by_head")
    attention = gpt(config, seed=2).blocks[0].attention
    x = torch.randn(2, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    attention = attention.double()
    whole = attention.qkv(x).view(2, 8, 4, 3, 4)  # (batch, seq, head, q/k/v, feature)
    rows = slice(1 * 12, 3 * 12)  # heads 1 and 2: 3 x 4 rows each
    part = torch.nn.functional.linear(x, attention.qkv.weight[rows], attention.qkv.bias[rows])
    assert torch.equal(part.view(2, 8, 2, 3, 4), whole[:, :, 1:3])


def test_the_qkv_layout_is_checked():
    with pytest.raises(ValueError, match=r"^qkv_layout must"):
        GPTConfig(qkv_layout="interleaved")


def test_an_attention_function_set_on_a_block_replaces_attend():
    # Chapter 17 sets ring attention here; any function of (q, k, v) is called instead.
    config = GPTConfig(vocab=16, context=8, d_model=12, layers=2, heads=3, attention="sdpa")
    model = gpt(config, seed=3)
    tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(0))
    before = model(tokens)
    calls = []

    def naive(q, k, v):
        calls.append(q.shape)
        return attend(q, k, v, kind="naive")

    for block in model.blocks:
        block.attention.attend_fn = naive
    torch.testing.assert_close(model(tokens), before, rtol=1e-5, atol=1e-6)
    assert calls == [(2, 3, 8, 4)] * 2  # once per block: (batch, heads, seq, head width)


# --- the Llama switches ---------------------------------------------------------------------

LLAMA_TINY = GPTConfig(
    vocab=50, context=16, d_model=32, layers=2, heads=4, kv_heads=2, d_ff=40, tied=False,
    rope_theta=500_000.0, **transformer.LLAMA_SHAPE,
)  # fmt: skip


def test_a_tiny_llama_by_hand():
    # d = 32, 4 heads of 8, 2 kv heads, SwiGLU of 40, RMSNorm, rotary, no biases, untied:
    # qkv 32 x (4 + 2 x 2) x 8 = 2,048, proj 1,024, mlp 3 x 32 x 40 = 3,840, per layer;
    # norms (2 x 2 + 1) x 32 = 160; embedding and head 2 x 50 x 32 = 3,200.
    counts = parameter_counts(LLAMA_TINY)
    assert counts == {
        "token embedding": 1_600,
        "position embedding": 0,
        "attention": 2 * (2_048 + 1_024),
        "mlp": 2 * 3_840,
        "layer norms": 160,
        "head": 1_600,
    }
    model = gpt(LLAMA_TINY)
    assert sum(p.numel() for p in model.parameters()) == sum(counts.values()) == 17_184
    assert model.position_embedding is None
    assert isinstance(model.final_norm, torch.nn.RMSNorm)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    assert matmul_weights(LLAMA_TINY) == 2 * (2_048 + 1_024 + 3_840) + 32 * 50


@given(
    heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 4]),
    mlp=st.sampled_from(transformer.MLPS),
    norm=st.sampled_from(transformer.NORMS),
    position=st.sampled_from(transformer.POSITIONS),
    bias=st.booleans(),
    tied=st.booleans(),
    qk_norm=st.booleans(),
)
def test_parameter_counts_match_for_any_switches(
    heads, group, mlp, norm, position, bias, tied, qk_norm
):
    kv_heads = max(1, heads // group)
    config = GPTConfig(
        vocab=11, context=6, d_model=4 * heads, layers=2, heads=heads, kv_heads=kv_heads,
        d_ff=12, mlp=mlp, norm=norm, position=position, bias=bias, tied=tied, qk_norm=qk_norm,
    )  # fmt: skip
    model = gpt(config)
    assert sum(p.numel() for p in model.parameters()) == sum(parameter_counts(config).values())
    assert model(torch.zeros(1, 6, dtype=torch.long)).shape == (1, 6, 11)


def test_grouped_query_attention_is_multi_head_attention_with_shared_keys_and_values():
    # Copying each kv head's rows into the query heads it serves gives a model with as
    # many kv heads as heads that computes the same function.
    grouped = gpt(LLAMA_TINY, seed=2)
    full_config = GPTConfig(**{**LLAMA_TINY.__dict__, "kv_heads": 0})
    full = gpt(full_config, seed=0)
    full.load_state_dict(
        {k: v for k, v in grouped.state_dict().items() if "qkv" not in k}, strict=False
    )
    with torch.no_grad():
        for a, b in zip(grouped.blocks, full.blocks, strict=True):
            q, k, v = a.attention.qkv.weight.split((32, 16, 16))
            expand = [t.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32) for t in (k, v)]
            b.attention.qkv.weight.copy_(torch.cat([q, *expand]))
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(grouped(tokens), full(tokens), atol=1e-6)


@pytest.mark.parametrize("attention", transformer.ATTENTION)
def test_grouped_qkv_layouts_compute_the_same_function(attention):
    blocked = GPTConfig(**{**LLAMA_TINY.__dict__, "attention": attention})
    by_head = GPTConfig(**{**blocked.__dict__, "qkv_layout": "by_head"})
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(gpt(blocked, seed=4)(tokens), gpt(by_head, seed=4)(tokens), atol=1e-6)


def test_the_grouped_head_by_head_order_by_hand():
    # d = 8, 4 heads of 2, 2 kv heads: blocked rows q 0-7, k 8-11, v 12-15; group 0 is
    # q heads 0 and 1 (rows 0-3), k head 0 (8, 9), v head 0 (12, 13).
    order = transformer.qkv_by_head_order(8, 4, kv_heads=2).tolist()
    assert order == [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 14, 15]
    assert transformer.qkv_by_head_order(8, 4, 4).tolist() == (
        transformer.qkv_by_head_order(8, 4).tolist()
    )


def test_rotary_scores_depend_on_the_distance_only():
    # q at position m and k at n: (R_m q) . (R_n k) depends on m - n alone; at 0, nothing turns.
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 8, generator=g, dtype=torch.float64)
    turned = [
        transformer.rotate(t, torch.tensor([p]), 10_000.0) for t, p in ((q, 5), (k, 2), (q, 13))
    ]
    far = transformer.rotate(k, torch.tensor([10]), 10_000.0)
    assert (turned[0] * turned[1]).sum() == pytest.approx((turned[2] * far).sum().item())
    assert torch.equal(transformer.rotate(q, torch.tensor([0]), 10_000.0), q)
    # one pair by hand: (1, 0) at position 1 and frequency 1 turns by one radian
    x = torch.tensor([[1.0, 0.0]])
    turned_once = transformer.rotate(x, torch.tensor([1]), 10_000.0)[0].tolist()
    assert turned_once == pytest.approx([math.cos(1.0), math.sin(1.0)])


def test_rotary_positions_can_be_given_to_a_block():
    # A context-parallel rank holds tokens that do not start at 0: its attention takes
    # their positions and turns its queries and keys as the whole sequence does there.
    attention = gpt(LLAMA_TINY, seed=1).blocks[0].attention
    x = torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(2))
    seen = []

    def keep(q, k, v):
        seen.append((q, k))
        return attend(q, k, v)

    attention.attend_fn = keep
    attention(x)
    attention.positions = torch.arange(8, 16)
    attention(x[:, 8:])
    (q, k), (q_late, k_late) = seen
    assert torch.allclose(q_late, q[:, :, 8:], atol=1e-6)
    assert torch.allclose(k_late, k[:, :, 8:], atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"kv_heads": 3}, "kv_heads"),
        ({"kv_heads": -1}, "kv_heads"),
        ({"mlp": "relu"}, "mlp"),
        ({"norm": "batchnorm"}, "norm"),
        ({"position": "alibi"}, "position"),
        ({"rope_theta": 0.0}, "rope_theta"),
        ({"position": "rope", "d_model": 12, "heads": 4}, "position"),
        ({"bias": 1}, "bias"),
    ],
)
def test_the_llama_switches_name_a_bad_argument(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must|^position='rope' needs"):
        GPTConfig(**{"d_model": 16, "heads": 4, **kwargs})


def test_fused_grouped_attention_equals_keys_and_values_copied_per_head():
    # With SDPA the kernel reads each key-value head for its group (enable_gqa): autograd
    # keeps kv_heads heads of keys and values, not heads; the function is the same as
    # the written-out attention over copied keys and values.
    fused = GPTConfig(**{**LLAMA_TINY.__dict__, "attention": "sdpa"})
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(3))
    assert torch.allclose(gpt(fused, seed=5)(tokens), gpt(LLAMA_TINY, seed=5)(tokens), atol=1e-5)


def test_sdpa_turns_onednn_off_only_where_cpu_flash_attention_would_fail():
    # torch 2.13 on an AMX CPU under ATEN_CPU_CAPABILITY=default: bf16 flash attention
    # packs for AMX and then refuses; attend() turns oneDNN off for that call only
    from trainscale.transformer import _packs_beyond_capability, attend

    full = torch.randn(1, 2, 8, 4)
    assert not _packs_beyond_capability(full)  # fp32 never packs
    below_avx512 = not torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    assert _packs_beyond_capability(full.bfloat16()) == below_avx512
    before = torch._C._get_mkldnn_enabled()
    out = attend(full.bfloat16(), full.bfloat16(), full.bfloat16(), kind="sdpa")
    assert out.shape == full.shape
    assert torch._C._get_mkldnn_enabled() == before
