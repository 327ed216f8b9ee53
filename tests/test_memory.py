"""memory: the 16 bytes (and 18 and 20), ZeRO shards and measured activations."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale.memory import (
    BYTES_PER_PARAM,
    FP16_GRADIENTS_WITH_FP32_COPY,
    FP32_MAIN_GRADIENTS,
    FP32_WEIGHTS_AND_GRADIENTS,
    GIB,
    MIXED_16BIT_GRADIENTS,
    OPTIMIZER_STATE,
    STATE_GROUPS,
    StateDtypes,
    mlp_stack,
    model_state_bytes,
    model_state_gib,
    model_state_groups,
    model_state_parts,
    saved_activation_bytes,
    state_bytes_per_param,
)


def test_bf16_adam_costs_16_bytes_per_parameter():
    assert sum(BYTES_PER_PARAM.values()) == 16
    assert sum(BYTES_PER_PARAM[p] for p in OPTIMIZER_STATE) == 12


def test_7b_needs_about_104_gib_and_does_not_fit_80_gb():
    assert model_state_gib(7e9) == pytest.approx(104.31, abs=0.01)
    assert model_state_bytes(7e9) > 80e9
    assert round(80e9 / GIB, 1) == 74.5


def test_1b_needs_about_15_gib():
    assert model_state_gib(1e9) == pytest.approx(14.90, abs=0.01)


def test_zero_stages_for_7b_on_8_gpus():
    gib = [model_state_gib(7e9, gpus=8, zero_stage=s) for s in range(4)]
    assert gib == pytest.approx([104.31, 35.86, 24.45, 13.04], abs=0.01)
    per_param = [model_state_bytes(8, gpus=8, zero_stage=s) / 8 for s in range(4)]
    assert per_param == [16, 5.5, 3.75, 2]


@given(st.integers(0, 10**13), st.integers(1, 10_000), st.sampled_from([0, 1, 2, 3]))
def test_sharded_parts_use_the_largest_shard(params, gpus, stage):
    parts = model_state_parts(params, gpus, stage)
    shard = math.ceil(params / gpus)
    assert parts["weights"] == 2 * (shard if stage == 3 else params)
    assert parts["gradients"] == 2 * (shard if stage >= 2 else params)
    assert parts["Adam variance"] == 4 * (shard if stage >= 1 else params)
    # Shards cover every parameter, and no GPU holds more than one padded shard.
    assert shard * gpus >= params and (shard - 1) * gpus < max(params, 1)


def test_model_state_groups_by_hand():
    # 7B on 8 GPUs: 2 + 2 + 12 bytes per parameter, then ZeRO divides by 8 stage by stage.
    assert model_state_groups(7e9) == {
        "weights": 14 * 10**9,
        "gradients": 14 * 10**9,
        "optimiser state": 84 * 10**9,
    }
    assert model_state_groups(7e9, 8, 1) == {
        "weights": 14 * 10**9,
        "gradients": 14 * 10**9,
        "optimiser state": 10_500_000_000,
    }
    assert model_state_groups(7e9, 8, 3) == {
        "weights": 1_750_000_000,
        "gradients": 1_750_000_000,
        "optimiser state": 10_500_000_000,
    }
    assert tuple(model_state_groups(1)) == STATE_GROUPS
    assert model_state_groups(1)["optimiser state"] == 12  # bytes per parameter


@given(st.integers(0, 10**13), st.integers(1, 10_000), st.sampled_from([0, 1, 2, 3]))
def test_groups_add_up_to_the_state(params, gpus, stage):
    assert sum(model_state_groups(params, gpus, stage).values()) == model_state_bytes(
        params, gpus, stage
    )


@given(st.integers(0, 10**13), st.integers(1, 10_000))
def test_each_stage_never_needs_more_memory(params, gpus):
    sizes = [model_state_bytes(params, gpus, s) for s in range(4)]
    assert sizes == sorted(sizes, reverse=True)


@given(st.integers(0, 10**13), st.sampled_from([0, 1, 2, 3]))
def test_one_gpu_shards_nothing(params, stage):
    assert model_state_bytes(params, 1, stage) == 16 * params


@pytest.mark.parametrize(
    ("args", "name"),
    [((-1,), "params"), ((1e9, 0), "gpus"), ((1e9, 8, 4), "zero_stage"), ((True,), "params")],
)
def test_bad_arguments_are_named(args, name):
    with pytest.raises(ValueError, match=name):
        model_state_bytes(*args)


def test_reference_mlp_saves_5_mib_at_batch_64():
    model = mlp_stack()
    x = torch.randn(64, 256)
    assert saved_activation_bytes(model, x) == 5_242_880 == 8 * 64 * 2560 * 4


def test_activations_double_with_the_batch():
    model = mlp_stack(width=32, blocks=3)
    one = saved_activation_bytes(model, torch.randn(10, 32))
    assert saved_activation_bytes(model, torch.randn(20, 32)) == 2 * one


def test_checkpointing_every_block_keeps_only_block_inputs():
    model = mlp_stack()
    x = torch.randn(64, 256)
    assert saved_activation_bytes(model, x, checkpointed=True) == 8 * 64 * 256 * 4


@pytest.mark.parametrize("segment", [1, 2, 3, 8, 20])
def test_checkpoint_segments_keep_one_input_per_segment(segment):
    model = mlp_stack(width=16, blocks=8)
    x = torch.randn(4, 16)
    segments = math.ceil(8 / segment)
    kept = saved_activation_bytes(model, x, checkpointed=True, segment=segment)
    assert kept == segments * 4 * 16 * 4


def test_mlp_stack_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = mlp_stack(width=8, blocks=2, seed=5)
    after = torch.rand(1)
    b = mlp_stack(width=8, blocks=2, seed=5)
    assert torch.equal(before, after)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_mlp_stack_weights_are_rounded_once_as_on_an_fma_cpu():
    """U(-b, b) is u * 2b - b; rounded once (as a fused multiply-add does) on every CPU.

    Hand-worked: the first draw after seed 0 is u = 0x1.fc2abp-2; a first
    layer of width 8 has b = fp32(1/sqrt(8)) = 0x1.6a09e6p-2. Rounded once,
    u * 2b - b is -0x1.5af244p-9; rounded twice (product, then sum) it would be
    -0.0026469826698303223.
    """
    u, bound = float.fromhex("0x1.fc2abp-2"), float.fromhex("0x1.6a09e6p-2")
    once = float(np.float32(float(Fraction(u) * 2 * Fraction(bound) - Fraction(bound))))
    assert once == float.fromhex("-0x1.5af244p-9")
    first = mlp_stack(width=8, blocks=1, seed=0)[0][0].weight.detach()
    assert float(first[0, 0]) == once != -0.0026469826698303223
    assert float(first.abs().max()) <= bound


def test_mlp_stack_rejects_zero_blocks():
    with pytest.raises(ValueError, match="blocks"):
        mlp_stack(blocks=0)


# --- The dtype of each part: 16, 18 or 20 bytes per parameter ------------------------


def test_default_dtypes_are_the_book_s_16_bytes():
    assert state_bytes_per_param() == BYTES_PER_PARAM == state_bytes_per_param(StateDtypes())
    assert BYTES_PER_PARAM == {
        "weights": 2,
        "gradients": 2,
        "master weights": 4,
        "Adam momentum": 4,
        "Adam variance": 4,
    }
    assert StateDtypes() == MIXED_16BIT_GRADIENTS


def test_fp32_main_gradients_cost_18_bytes():
    # Megatron-Core --bf16: bf16 weights 2, fp32 main grads 4, fp32 master 4, Adam 4 + 4.
    assert state_bytes_per_param(FP32_MAIN_GRADIENTS) == {
        "weights": 2,
        "gradients": 4,
        "master weights": 4,
        "Adam momentum": 4,
        "Adam variance": 4,
    }
    assert model_state_bytes(7e9, dtypes=FP32_MAIN_GRADIENTS) == 126 * 10**9  # 18 x 7e9


def test_fp16_gradients_with_an_fp32_copy_cost_20_bytes():
    # Megatron-Core --fp16: fp16 weights 2 and grads 2, fp32 grad copy 4, master 4, Adam 8.
    parts = state_bytes_per_param(FP16_GRADIENTS_WITH_FP32_COPY)
    assert parts == {
        "weights": 2,
        "gradients": 2,
        "gradient copy": 4,
        "master weights": 4,
        "Adam momentum": 4,
        "Adam variance": 4,
    }
    assert sum(parts.values()) == 20


def test_fp32_weights_and_gradients_keep_no_master_copy():
    # FSDP2 with an fp32 model and bf16 compute: fp32 weights 4, grads 4, Adam 8.
    assert state_bytes_per_param(FP32_WEIGHTS_AND_GRADIENTS) == {
        "weights": 4,
        "gradients": 4,
        "Adam momentum": 4,
        "Adam variance": 4,
    }
    assert model_state_groups(1, dtypes=FP32_WEIGHTS_AND_GRADIENTS) == {
        "weights": 4,
        "gradients": 4,
        "optimiser state": 8,
    }


@pytest.mark.parametrize(
    ("dtypes", "replicated", "sharded"),
    [
        # Megatron-Core's distributed optimizer table: 4 + 16/d, 6 + 12/d, 8 + 8/d.
        (FP16_GRADIENTS_WITH_FP32_COPY, 4, 16),
        (FP32_MAIN_GRADIENTS, 6, 12),
        (FP32_WEIGHTS_AND_GRADIENTS, 8, 8),
    ],
)
def test_zero_1_reproduces_megatron_distributed_optimizer_table(dtypes, replicated, sharded):
    for d in (1, 2, 8, 64):
        per_param = Fraction(model_state_bytes(d * 1000, d, 1, dtypes), d * 1000)
        assert per_param == replicated + Fraction(sharded, d)


def test_the_gradient_copy_is_optimiser_state():
    groups = model_state_groups(8, 8, 1, FP16_GRADIENTS_WITH_FP32_COPY)
    # 8 parameters on 8 GPUs at ZeRO-1: 16 + 16 bytes whole, (4 + 4 + 8) x 1 sharded.
    assert groups == {"weights": 16, "gradients": 16, "optimiser state": 16}


@pytest.mark.parametrize(
    ("dtypes", "name"),
    [
        (StateDtypes(weights=torch.int32), "weights"),
        (StateDtypes(gradients=None), "gradients"),  # type: ignore[arg-type]
        (StateDtypes(master_weights=torch.int8), "master_weights"),
        (StateDtypes(optimizer_moments="fp32"), "optimizer_moments"),  # type: ignore[arg-type]
        (StateDtypes(gradient_copy=torch.bool), "gradient_copy"),
        ("bf16", "dtypes"),
    ],
)
def test_bad_dtypes_are_named(dtypes, name):
    with pytest.raises(ValueError, match=name):
        state_bytes_per_param(dtypes)
