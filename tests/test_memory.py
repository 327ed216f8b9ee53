"""memory: the 16 bytes, ZeRO shards and measured activations."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale.memory import (
    BYTES_PER_PARAM,
    GIB,
    OPTIMIZER_STATE,
    mlp_stack,
    model_state_bytes,
    model_state_gib,
    model_state_parts,
    saved_activation_bytes,
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


def test_mlp_stack_rejects_zero_blocks():
    with pytest.raises(ValueError, match="blocks"):
        mlp_stack(blocks=0)
