"""checkpointing: the segment model against measured bytes, counted FLOPs, and one
transformer layer against Korthikanti et al.'s formula, to the byte."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from trainscale import memory, transformer
from trainscale.checkpointing import (
    ACTIVATION_PARTS,
    RECOMPUTE,
    TransformerLayer,
    best_segment,
    korthikanti_bytes,
    korthikanti_terms,
    layer_activation_bytes,
    memory_timeline,
    saved_by_op,
    segment_memory,
    selective_recompute_flops,
    step_flops,
    step_operator_calls,
)

# --- the segment model -------------------------------------------------------------------


def test_timeline_by_hand_for_eight_blocks_in_segments_of_two():
    a_in, a_block = 1, 10
    points = memory_timeline(8, 2, a_in, a_block)
    assert points[0] == (0.0, 0) and points[-1][1] == 0
    assert max(b for _, b in points) == 4 * a_in + 2 * a_block - a_in == 23
    assert points[-1][0] == 4 * 8  # forward 8, recompute 8, backward 16
    plain = memory_timeline(8, None, a_in, a_block)
    assert max(b for _, b in plain) == 80 and plain[-1] == (24.0, 0)


@given(st.integers(1, 40), st.integers(1, 12), st.integers(0, 50), st.integers(0, 200))
def test_peak_formula_when_segments_divide_the_stack(segments, k, a_in, extra):
    n, a_block = segments * k, a_in + extra
    m = segment_memory(n, k, a_in, a_block)
    assert m.peak == (n // k) * a_in + k * a_block - a_in
    assert m.stored == (n // k) * a_in and m.recomputed == k * a_block - a_in
    assert m.extra_forward == 1.0


@given(st.integers(1, 30), st.integers(1, 40), st.integers(0, 50), st.integers(0, 200))
def test_timeline_never_goes_negative_and_checkpointing_never_costs_memory(n, k, a_in, extra):
    a_block = a_in + extra
    points = memory_timeline(n, k, a_in, a_block)
    assert min(b for _, b in points) == 0 and points[-1][1] == 0
    assert segment_memory(n, k, a_in, a_block).peak <= segment_memory(n, None, a_in, a_block).peak
    if k >= n:  # one segment: stores one input, recomputes everything
        assert segment_memory(n, k, a_in, a_block).peak == n * a_block


@given(st.integers(1, 30), st.integers(1, 40), st.integers(0, 50), st.integers(0, 200))
def test_closed_form_peak_is_the_timelines_peak(n, k, a_in, extra):
    a_block = a_in + extra
    for segment in (k, None):
        timeline = memory_timeline(n, segment, a_in, a_block)
        assert segment_memory(n, segment, a_in, a_block).peak == max(b for _, b in timeline)


def test_uneven_segments_peak_at_the_largest_recomputation():
    # 5 blocks in segments of 2, 2, 1; a_in = 1, a_block = 10
    m = segment_memory(5, 2, 1, 10)
    assert m.stored == 3
    assert m.peak == max(1 + 20 - 1, 2 + 20 - 1, 3 + 10 - 1) == 21


def test_best_segment_is_about_sqrt_n_for_a_uniform_chain_and_one_for_heavy_blocks():
    for n in (4, 9, 16, 36, 100, 400):
        best = best_segment(n, 1, 1)
        assert abs(best - math.sqrt(n)) <= math.sqrt(n) / 2
        peaks = [segment_memory(n, k, 1, 1).peak for k in range(1, n + 1)]
        assert segment_memory(n, best, 1, 1).peak == min(peaks)
    assert best_segment(8, 256, 2560) == 1


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((0, 1, 1, 1), "blocks"),
        ((4, 0, 1, 1), "segment"),
        ((4, 1, -1, 1), "block_input"),
        ((4, 1, 5, 4), "block_saved"),
    ],
)
def test_segment_model_names_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        segment_memory(*args)


@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_segment_model_matches_what_autograd_keeps(k):
    model = memory.mlp_stack(width=16, blocks=6, seed=0)
    x = torch.randn(4, 16)
    n = len(model)
    a_in = memory.saved_activation_bytes(model, x, checkpointed=True) // n
    a_block = memory.saved_activation_bytes(model, x) // n
    m = segment_memory(n, k, a_in, a_block)
    assert memory.saved_activation_bytes(model, x, checkpointed=True, segment=k) == m.stored
    assert memory.saved_activation_bytes(model[:k], x) - a_in == m.recomputed


# --- counted FLOPs -----------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4])
def test_checkpointing_adds_exactly_one_forward(k):
    model = memory.mlp_stack(width=16, blocks=4, seed=0)
    x = torch.randn(8, 16)
    plain, ckpt = step_flops(model, x), step_flops(model, x, segment=k)
    assert plain["forward"] == ckpt["forward"] == 2 * 8 * 4 * 2 * 16 * 64
    assert ckpt["backward"] - plain["backward"] == plain["forward"]
    assert plain["backward"] == 2 * plain["forward"] - plain["forward"] // 8  # no input grad
    assert all(p.grad is None for p in model.parameters())


def test_step_operator_calls_of_one_block_by_hand():
    # One block, Linear -> GELU -> Linear -> GELU, then pow and mean: each Linear
    # dispatches a transpose and an addmm, so forward calls 2 + 1 + 2 + 1 + 2 = 8 operators.
    model = memory.mlp_stack(width=4, blocks=1, seed=0)
    x = torch.randn(3, 4)
    plain, ckpt = step_operator_calls(model, x), step_operator_calls(model, x, segment=1)
    assert plain["forward"] == ckpt["forward"] == 8  # checkpointing keeps less, calls the same
    # Backward recomputes the block, except its last GELU, whose output backward does not
    # need: 2 transposes, 2 addmm and 1 GELU at least (the rest is checkpoint's detaches).
    assert ckpt["backward"] >= plain["backward"] + 5
    assert all(p.grad is None for p in model.parameters())


def test_operator_calls_do_not_grow_with_width_but_flops_do():
    small, large = (memory.mlp_stack(width=w, blocks=2, seed=0) for w in (4, 16))
    for segment in (None, 1):
        calls = [
            step_operator_calls(m, torch.randn(3, w), segment) for m, w in ((small, 4), (large, 16))
        ]
        assert calls[0] == calls[1]
    flops = [step_flops(m, torch.randn(3, w)) for m, w in ((small, 4), (large, 16))]
    assert flops[1]["forward"] == 16 * flops[0]["forward"]  # 2 x rows x w x 4w per product


def test_step_operator_calls_names_bad_arguments():
    with pytest.raises(ValueError, match="model"):
        step_operator_calls(TransformerLayer(8, 2), torch.randn(1, 4, 8), segment=1)
    with pytest.raises(ValueError, match="model"):
        step_operator_calls(None, torch.randn(1, 4, 8))


def test_step_flops_names_bad_arguments():
    with pytest.raises(ValueError, match="model"):
        step_flops(TransformerLayer(8, 2), torch.randn(1, 4, 8), segment=1)
    with pytest.raises(ValueError, match="model"):
        step_flops("not a model", torch.randn(1, 4, 8))


# --- one transformer layer ---------------------------------------------------------------


def test_korthikanti_by_hand():
    # the 175B GPT-3 layer: s = 2048, b = 1, h = 12288, a = 96 -> 34 + 5 * 96 * 2048 / 12288 = 114
    assert korthikanti_bytes(2048, 1, 12288, 96) == 2048 * 12288 * 114 == 2_868_903_936
    terms = korthikanti_terms(128, 2, 256, 8)
    sbh, as2b = 128 * 2 * 256, 8 * 128 * 128 * 2
    assert terms == {"attention": 11 * sbh + 5 * as2b, "MLP": 19 * sbh, "layer norms": 4 * sbh}
    with pytest.raises(ValueError, match="heads"):
        korthikanti_bytes(128, 2, 256, 0)


def test_activation_parts_add_up_to_the_papers_34_and_5():
    assert sum(part.per_sbh for part in ACTIVATION_PARTS) == 34
    assert sum(part.per_as2b for part in ACTIVATION_PARTS) == 5
    assert sum(part.per_sbh for part in ACTIVATION_PARTS if not part.split_by_tp) == 10
    assert sum(part.per_sbh for part in ACTIVATION_PARTS if part.split_by_tp) == 24
    assert all(part.split_by_tp for part in ACTIVATION_PARTS if part.per_as2b)  # split by heads


# s = 4, b = 2, h = 8, a = 2: s*b*h = 64, a*s*s*b = 64, so 5as/h = 5; t = 2.
@pytest.mark.parametrize(
    ("tp", "sp", "mode", "expected"),
    [
        (1, False, "none", 2_496),  # sbh(34 + 5as/h) = 64 x 39
        (2, False, "none", 1_568),  # sbh(10 + 24/t + 5as/(ht)) = 64 x (10 + 12 + 2.5)
        (2, True, "none", 1_248),  # sbh(34/t + 5as/(ht)) = 64 x (17 + 2.5)
        (2, False, "selective", 1_408),  # sbh(10 + 24/t) = 64 x 22
        (2, True, "selective", 1_088),  # sbh 34/t = 64 x 17
        (2, False, "full", 128),  # the layer's 16-bit input only: 2 sbh
        (2, True, "full", 64),  # sharded along the sequence: 2 sbh / t
        (1, True, "none", 2_496),  # sequence parallelism alone changes nothing
    ],
)
def test_layer_activations_follow_korthikanti_table_2(tp, sp, mode, expected):
    got = layer_activation_bytes(4, 2, 8, 2, tp=tp, sequence_parallel=sp, recompute=mode)
    assert got == expected


def test_gpt3_layer_by_hand():
    # s = 2048, b = 1, h = 12288, a = 96, t = 8: 5as/h = 80, sbh = 25,165,824.
    assert layer_activation_bytes(2048, 1, 12288, 96) == 25_165_824 * 114 == 2_868_903_936
    tp_only = 25_165_824 * (10 + 24 / 8 + 80 / 8)  # sbh(10 + 24/t + 5as/(ht))
    assert layer_activation_bytes(2048, 1, 12288, 96, 8) == tp_only == 578_813_952
    with_sp = 25_165_824 * (34 / 8 + 80 / 8)  # sbh(34/t + 5as/(ht))
    assert layer_activation_bytes(2048, 1, 12288, 96, 8, True) == with_sp == 358_612_992
    assert layer_activation_bytes(2048, 1, 12288, 96, 8, True, "selective") == 106_954_752


@given(
    st.integers(1, 4096),
    st.integers(1, 8),
    st.sampled_from([(64, 1), (128, 2), (4096, 32), (96, 3)]),
)
def test_korthikanti_bytes_is_the_table_without_parallelism(s, b, shape):
    h, a = shape
    assert korthikanti_bytes(s, b, h, a) == layer_activation_bytes(s, b, h, a, 1, False, "none")


@given(
    st.integers(1, 8192),
    st.integers(1, 16),
    st.sampled_from([(64, 1), (128, 2), (4096, 32), (8192, 64), (96, 3)]),
    st.integers(1, 64),
    st.booleans(),
)
def test_recomputation_never_increases_activation_memory(s, b, shape, tp, sp):
    h, a = shape
    none, selective, full = (layer_activation_bytes(s, b, h, a, tp, sp, m) for m in RECOMPUTE)
    assert 0 < full <= selective <= none
    assert layer_activation_bytes(s, 2 * b, h, a, tp, sp) == 2 * none  # linear in the batch


def test_selective_recompute_flops_is_q_k_transpose_by_hand():
    # 2 b s^2 h: b = 2, s = 128, h = 256 -> 16,777,216 FLOPs, what chapter 3 measures.
    assert selective_recompute_flops(128, 2, 256) == 16_777_216
    # The 70B example: s = 4096, b = 1, h = 8192 over TP 8: 2 x 4096^2 x 8192 / 8.
    assert selective_recompute_flops(4096, 1, 8192, tp=8) == 34_359_738_368
    with pytest.raises(ValueError, match="tp"):
        selective_recompute_flops(128, 2, 256, tp=0)


def test_selective_recompute_flops_is_what_pytorch_recomputes():
    x = torch.randn(B, S, H)
    plain = nn.Sequential(TransformerLayer(H, A, fused_dropout=True))
    selective = nn.Sequential(TransformerLayer(H, A, fused_dropout=True, recompute_attention=True))
    extra = step_flops(selective, x)["backward"] - step_flops(plain, x)["backward"]
    assert extra == selective_recompute_flops(S, B, H) == 2 * B * S * S * H


# The same s = 4, b = 2, h = 8, a = 2 (sbh = 64), Llama-shaped: one key/value head,
# a gated MLP of width 16 = 2h (half of GPT's 4h), fused attention, no dropout.
LLAMA_SHAPED = {"kv_heads": 1, "ffn_hidden": 16, "gated_mlp": True, "fused_attention": True}


@pytest.mark.parametrize(
    ("tp", "sp", "options", "expected"),
    [
        # sbh x (2 norm out + 4 x 3/4 Q,K + 2 x 1/2 V + 2 proj in + 2 norm out
        #        + 8 x 1/2 x 2 gate,up + 8 x 1/2 product + 4 norm inputs) = 64 x 26,
        # plus the fp32 row statistic 4 a s b = 64 bytes; no s^2 table, no masks.
        (1, False, LLAMA_SHAPED | {"dropout": False}, 1_728),
        # TP 2 without SP: 8 sbh stay whole (512), 18 sbh split (576), statistic 32.
        (2, False, LLAMA_SHAPED | {"dropout": False}, 1_120),
        # With SP everything splits: 1,728 / 2.
        (2, True, LLAMA_SHAPED | {"dropout": False}, 864),
        # With dropout the three 1-byte masks outside the s^2 table come back: +2 sbh.
        (1, False, LLAMA_SHAPED, 1_728 + 128),
        # Grouped-query attention alone: keys and values halve (-2 sbh) of 2,496.
        (1, False, {"kv_heads": 1}, 2_496 - 128),
        # A 2h-wide ungated MLP halves the 16 sbh of the MLP's two wide rows.
        (1, False, {"ffn_hidden": 16}, 2_496 - 512),
        # Fused attention drops 5 a s^2 b = 320 and keeps 4 a s b = 64.
        (1, False, {"fused_attention": True}, 2_496 - 320 + 64),
    ],
)
def test_layer_activations_of_non_gpt_layers_by_hand(tp, sp, options, expected):
    got = layer_activation_bytes(4, 2, 8, 2, tp=tp, sequence_parallel=sp, **options)
    assert got == expected


def test_fused_attention_makes_selective_recomputation_free():
    shape = {"kv_heads": 8, "ffn_hidden": 28672, "gated_mlp": True, "fused_attention": True}
    args = (4096, 1, 8192, 64, 8, True)
    none = layer_activation_bytes(*args, "none", **shape)
    assert none == layer_activation_bytes(*args, "selective", **shape)
    assert layer_activation_bytes(*args, "full", **shape) == 2 * 4096 * 8192 / 8


def test_gpt_defaults_are_unchanged_by_the_shape_arguments():
    plain = layer_activation_bytes(2048, 1, 12288, 96, 8, True)
    shaped = layer_activation_bytes(
        2048, 1, 12288, 96, 8, True, kv_heads=96, ffn_hidden=4 * 12288, dropout=True
    )
    assert plain == shaped == 358_612_992


def test_layer_activation_bytes_names_bad_shape_arguments():
    for kwargs, name in (
        ({"kv_heads": 3}, "kv_heads"),  # does not divide 2 heads
        ({"kv_heads": 0}, "kv_heads"),
        ({"ffn_hidden": 0}, "ffn_hidden"),
        ({"gated_mlp": 1}, "gated_mlp"),
        ({"fused_attention": "yes"}, "fused_attention"),
        ({"dropout": None}, "dropout"),
    ):
        with pytest.raises(ValueError, match=name):
            layer_activation_bytes(4, 1, 8, 2, **kwargs)


def test_layer_activation_bytes_names_bad_arguments():
    for kwargs, name in (
        ({"seq_len": 0}, "seq_len"),
        ({"recompute": "half"}, "recompute"),
        ({"sequence_parallel": None}, "sequence_parallel"),
        ({"tp": 0}, "tp"),
    ):
        args = {"seq_len": 4, "micro_batch": 1, "hidden": 8, "heads": 2} | kwargs
        with pytest.raises(ValueError, match=name):
            layer_activation_bytes(**args)


S, B, H, A = 16, 2, 32, 4
SBH, AS2B = S * B * H, A * S * S * B


def _saved(dtype=torch.bfloat16, **options):
    layer = TransformerLayer(H, A, **options).to(dtype)
    return memory.saved_activation_bytes(
        layer, torch.randn(B, S, H, dtype=dtype, requires_grad=True)
    )


def test_layer_with_one_byte_masks_is_the_formula_plus_layer_norm_statistics():
    stats = 4 * S * B * 2
    assert _saved(fused_dropout=True) == korthikanti_bytes(S, B, H, A) + stats
    assert _saved() == korthikanti_bytes(S, B, H, A) + 2 * SBH + AS2B + stats  # 2-byte masks
    assert _saved(torch.float32, fused_dropout=True) == 66 * SBH + 9 * AS2B + 4 * S * B * 4


def test_selective_recomputation_and_fused_attention_drop_the_square_term():
    stats = 4 * S * B * 2
    assert _saved(fused_dropout=True, recompute_attention=True) == 34 * SBH + stats
    assert _saved(dropout=0.0) == 32 * SBH + 2 * AS2B + stats
    assert _saved(dropout=0.0, attention="sdpa") == 32 * SBH + stats + A * S * B * 4


def test_saved_by_op_lists_what_the_hooks_count():
    layer = TransformerLayer(H, A).to(torch.bfloat16)
    x = torch.randn(B, S, H, dtype=torch.bfloat16, requires_grad=True)
    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    rows = saved_by_op(layer(x), weights)
    assert sum(r.nbytes for r in rows) == memory.saved_activation_bytes(layer, x)
    assert rows[0].op == "NativeLayerNormBackward0" and rows[0].slot == "input"
    assert sum(r.op == "SoftmaxBackward0" for r in rows) == 1
    with pytest.raises(ValueError, match="output"):
        saved_by_op(torch.ones(3))


@pytest.mark.parametrize("how", ["selective", "full"])
def test_recomputation_gives_bit_identical_gradients_even_with_dropout(how):
    x = torch.randn(B, S, H)
    plain = TransformerLayer(H, A, dropout=0.2, seed=4)
    torch.manual_seed(1)
    expected = torch.autograd.grad(plain(x).pow(2).mean(), list(plain.parameters()))
    if how == "selective":
        layer = TransformerLayer(H, A, dropout=0.2, recompute_attention=True, seed=4)
        run = lambda: layer(x)  # noqa: E731
    else:
        layer = plain
        run = lambda: memory.run_checkpointed(nn.Sequential(layer), x, 1)  # noqa: E731
    torch.manual_seed(1)
    got = torch.autograd.grad(run().pow(2).mean(), list(layer.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_selective_recomputation_costs_only_the_score_product():
    x = torch.randn(B, S, H)
    plain = step_flops(nn.Sequential(TransformerLayer(H, A)), x)
    full = step_flops(nn.Sequential(TransformerLayer(H, A)), x, segment=1)
    selective = step_flops(nn.Sequential(TransformerLayer(H, A, recompute_attention=True)), x)
    assert plain["forward"] == 24 * B * S * H * H + 4 * B * S * S * H
    assert full["backward"] - plain["backward"] == plain["forward"]
    assert selective["backward"] - plain["backward"] == 2 * B * S * S * H


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"heads": 3}, "heads"),
        ({"hidden": 0}, "hidden"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
        ({"attention": "flash"}, "attention"),
        ({"attention": "sdpa", "recompute_attention": True}, "recompute_attention"),
        ({"fused_dropout": 1}, "fused_dropout"),
    ],
)
def test_layer_names_bad_arguments(kwargs, name):
    args = {"hidden": H, "heads": A} | kwargs
    with pytest.raises(ValueError, match=name):
        TransformerLayer(**args)


def test_layer_weights_are_seeded_without_touching_the_global_rng():
    torch.manual_seed(9)
    before = torch.rand(1)
    torch.manual_seed(9)
    a = TransformerLayer(H, A, seed=2)
    after = torch.rand(1)
    b = TransformerLayer(H, A, seed=2)
    assert torch.equal(before, after)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_the_layer_is_the_models_block_as_korthikanti_counts_it():
    layer = TransformerLayer(H, A, dropout=0.2, recompute_attention=True, fused_dropout=True)
    assert isinstance(layer, transformer.Block)
    assert layer.config == transformer.GPTConfig(
        d_model=H, heads=A, layers=1, dropout=0.2, fused_dropout=True, recompute="selective"
    )
    assert TransformerLayer(H, A, attention="sdpa").config.attention == "sdpa"


# s = 4, b = 2, h = 8, a = 2: sbh = 64; t = 2. DTensor's plan keeps the two 2 sbh
# layer-norm outputs whole: 34 sbh/t + 4 sbh (1 - 1/t) = 64 x (17 + 2) = 1,216 (scores
# recomputed); with the scores kept, + 5as/(ht) sbh = 64 x 2.5 = 160 more.
@pytest.mark.parametrize(
    ("mode", "expected"), [("selective", 1_216), ("none", 1_376), ("full", 64)]
)
def test_keeping_the_gathered_inputs_by_hand(mode, expected):
    got = layer_activation_bytes(4, 2, 8, 2, 2, True, mode, keep_gathered_inputs=True)
    assert got == expected


def test_keeping_the_gathered_inputs_of_the_7b_layer_by_hand():
    # s = h = 4096, b = 1, t = 8: sbh = 16 MiB; sbh (4 + 30/8) = 7.75 sbh = 124 MiB,
    # against Megatron's 34/8 = 4.25 sbh = 68 MiB and TP alone's 13 sbh = 208 MiB.
    kept = layer_activation_bytes(
        4096, 1, 4096, 32, 8, True, "selective", keep_gathered_inputs=True
    )
    assert kept == 124 * 2**20
    assert layer_activation_bytes(4096, 1, 4096, 32, 8, True, "selective") == 68 * 2**20
    assert layer_activation_bytes(4096, 1, 4096, 32, 8, False, "selective") == 208 * 2**20


@given(st.integers(1, 64), st.booleans(), st.sampled_from(["none", "selective"]))
def test_keeping_the_gathered_inputs_adds_4_sbh_times_1_minus_1_over_t(tp, dropout, mode):
    s, b, h, a = 64, 2, 128, 4
    args = (s, b, h, a, tp, True, mode)
    extra = layer_activation_bytes(*args, dropout=dropout, keep_gathered_inputs=True)
    extra -= layer_activation_bytes(*args, dropout=dropout)
    assert math.isclose(extra, 4 * s * b * h * (1 - 1 / tp))
    whole = layer_activation_bytes(s, b, h, a, tp, False, mode, dropout=dropout)
    assert extra + layer_activation_bytes(*args, dropout=dropout) <= whole  # never above TP alone


def test_keeping_the_gathered_inputs_is_refused_without_sequence_parallelism():
    with pytest.raises(ValueError, match="keep_gathered_inputs"):
        layer_activation_bytes(4, 2, 8, 2, 2, False, keep_gathered_inputs=True)
    with pytest.raises(ValueError, match="keep_gathered_inputs"):
        layer_activation_bytes(4, 2, 8, 2, 2, True, keep_gathered_inputs="yes")
