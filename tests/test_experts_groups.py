"""Expert parallelism beside TP, PP and DP: the group sizes and the model state per GPU
(trainscale.experts.groups)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale import experts as ex
from trainscale import memory, planner

DSV3_DTYPES = memory.StateDtypes(
    weights=torch.bfloat16,
    gradients=torch.float32,
    master_weights=torch.float32,
    optimizer_moments=torch.bfloat16,
)


def test_group_sizes_by_hand():
    # DeepSeek-V3: 2,048 GPUs, PP 16, EP 64, no TP: DP 2,048 / 16 = 128, EDP 2,048 / 1,024 = 2
    assert ex.data_parallel_size(2048, pp=16) == 128
    assert ex.expert_data_parallel_size(2048, ep=64, pp=16) == 2
    # Megatron's Mixtral example on 4 nodes: TP 1, PP 4, EP 8 on 32 GPUs: DP 8, EDP 1
    assert ex.data_parallel_size(32, 1, 4) == 8
    assert ex.expert_data_parallel_size(32, 8, 1, 4) == 1
    # CP counts against DP; ETP against EDP
    assert ex.data_parallel_size(16, tp=2, pp=2, cp=2) == 2
    assert ex.expert_data_parallel_size(64, ep=8, etp=2, pp=2) == 2


def test_model_state_by_hand():
    # 1,000 dense parameters on every one of 8 GPUs, ZeRO-1 over 8: 2,000 + 2,000 bytes of
    # bf16 weights and gradients, 12 x 125 = 1,500 of optimiser state. 8,000 expert
    # parameters over EP 4: 2,000 per GPU, sharded over EDP 2: 4,000 + 4,000, 12 x 1,000.
    state = ex.model_state_per_gpu(1000, 8000, 8, ep=4)
    assert state == {
        "dense": {"weights": 2000, "gradients": 2000, "optimiser state": 1500},
        "experts": {"weights": 4000, "gradients": 4000, "optimiser state": 12_000},
    }
    # ZeRO-0 shards nothing; ZeRO-3 shards all three, each over its own group
    assert ex.model_state_per_gpu(1000, 8000, 8, ep=4, zero_stage=0)["experts"] == {
        "weights": 4000,
        "gradients": 4000,
        "optimiser state": 24_000,
    }
    assert ex.model_state_per_gpu(1000, 8000, 8, ep=4, zero_stage=3)["dense"] == {
        "weights": 250,
        "gradients": 250,
        "optimiser state": 1500,
    }


def test_deepseek_v3_by_hand():
    # Routed experts: 58 MoE layers x 256 experts x 3 x 7,168 x 2,048 = 653,908,770,816;
    # the rest of the 671B: 17,091,229,184. PP 16, EP 64, ZeRO-1 on 2,048 GPUs, BF16
    # weights, FP32 gradients and master weights, BF16 Adam moments (14 bytes).
    experts = 58 * 256 * 3 * 7168 * 2048
    assert experts == 653_908_770_816
    state = ex.model_state_per_gpu(
        671_000_000_000 - experts, experts, 2048, pp=16, ep=64, dtypes=DSV3_DTYPES
    )
    # dense: ceil(17,091,229,184 / 16) = 1,068,201,824 per GPU; optimiser 8 bytes x
    # ceil(1,068,201,824 / 128) = 8 x 8,345,327
    assert state["dense"] == {
        "weights": 2 * 1_068_201_824,
        "gradients": 4 * 1_068_201_824,
        "optimiser state": 8 * 8_345_327,
    }
    # experts: 653,908,770,816 / 1,024 = 638,582,784 per GPU, optimiser over EDP 2
    assert state["experts"] == {
        "weights": 2 * 638_582_784,
        "gradients": 4 * 638_582_784,
        "optimiser state": 8 * 319_291_392,
    }


def test_mixtral_on_megatrons_example_layout_by_hand():
    # Mixtral 8x7B: 32 x 8 x 3 x 4,096 x 14,336 = 45,097,156,608 expert parameters of
    # 46,702,792,704; TP 1, PP 4, EP 8 on 32 GPUs, --bf16 (fp32 gradients: 18 bytes).
    model = planner.MOE_MODEL
    experts = model.layers * model.expert_params_per_layer
    assert experts == 45_097_156_608
    state = ex.model_state_per_gpu(
        model.params - experts, experts, 32, pp=4, ep=8, dtypes=memory.FP32_MAIN_GRADIENTS
    )
    # dense: 1,605,636,096 / 4 = 401,409,024 per GPU, optimiser 12 x 401,409,024 / 8
    assert state["dense"]["optimiser state"] == 12 * 50_176_128
    # experts: 45,097,156,608 / 32 = 1,409,286,144 per GPU, EDP 1: nothing sharded
    assert state["experts"]["optimiser state"] == 12 * 1_409_286_144
    assert state["experts"]["gradients"] == 4 * 1_409_286_144


@given(
    st.sampled_from([(1, 1, 1, 1, 1), (2, 2, 1, 4, 1), (1, 4, 2, 2, 2), (2, 1, 1, 8, 1)]),
    st.integers(1, 4),
    st.integers(0, 1000),
    st.integers(0, 1000),
    st.sampled_from([0, 1, 2, 3]),
)
def test_every_parameter_is_held_once_across_its_group(layout, dp, a, b, zero):
    # Summed over all GPUs, the optimiser state of the dense and of the expert parameters
    # is 12 bytes per parameter times the copies ZeRO leaves: 1 when it shards (stage >= 1),
    # else the group's size.
    tp, pp, cp, ep, etp = layout
    world = tp * pp * cp * dp * ep * etp
    dense, experts = world * a, world * b
    state = ex.model_state_per_gpu(
        dense, experts, world, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, zero_stage=zero
    )
    dense_copies = 1 if zero else world // (tp * pp)
    expert_copies = 1 if zero else ex.expert_data_parallel_size(world, ep, etp, pp)
    assert world * state["dense"]["optimiser state"] == 12 * dense * dense_copies
    assert world * state["experts"]["optimiser state"] == 12 * experts * expert_copies
    # weights are sharded only by ZeRO-3
    weight_copies = 1 if zero == 3 else ex.expert_data_parallel_size(world, ep, etp, pp)
    assert world * state["experts"]["weights"] == 2 * experts * weight_copies


def test_etp_defaults_to_tp():
    assert ex.model_state_per_gpu(800, 800, 8, tp=2, ep=2) == ex.model_state_per_gpu(
        800, 800, 8, tp=2, ep=2, etp=2
    )


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: ex.data_parallel_size(6, tp=4), "world"),
        (lambda: ex.data_parallel_size(8, tp=0), "tp"),
        (lambda: ex.expert_data_parallel_size(8, ep=3), "world"),
        (lambda: ex.expert_data_parallel_size(8, ep=0), "ep"),
        (lambda: ex.model_state_per_gpu(-1, 10, 4), "dense_params"),
        (lambda: ex.model_state_per_gpu(10, 1.5, 4), "expert_params"),
        (lambda: ex.model_state_per_gpu(10, 10, 4, etp=0), "etp"),
        (lambda: ex.model_state_per_gpu(10, 10, 4, zero_stage=4), "zero_stage"),
    ],
)
def test_bad_arguments_are_refused(call, name):
    with pytest.raises(ValueError, match=name):
        call()
