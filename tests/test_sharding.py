"""sharding: ZeRO's collectives per run, per step and per micro-batch, against hand-worked bytes."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale.collectives import ring_bytes_per_rank
from trainscale.memory import model_state_bytes
from trainscale.sharding import (
    FP32_ADAM_BYTES_PER_PARAM,
    STAGE_NAMES,
    ZERO_COLLECTIVES,
    bytes_per_param,
    decoder_units,
    fsdp_collectives,
    fsdp_memory_moments,
    fsdp_moments,
    fsdp_padded_numel,
    fsdp_peak,
    fsdp_shard_numels,
    fsdp_shard_rows,
    fsdp_state_bytes,
    traffic_relative_to_ddp,
    zero_collective_bytes,
    zero_traffic,
)
from trainscale.workers import sharding as workers

# 7B parameters on 8 GPUs in bf16: each ring pass sends 7/8 of 14 GB = 12.25 GB per GPU.
PASS = 12_250_000_000


def test_one_micro_batch_keeps_the_chapter_05_numbers():
    assert zero_traffic(7e9, 8, 0) == {"all-reduce of gradients": 2 * PASS}
    assert zero_traffic(7e9, 8, 1) == {
        "reduce-scatter of gradients": PASS,
        "all-gather of updated weights": PASS,
    }
    assert zero_traffic(7e9, 8, 2) == zero_traffic(7e9, 8, 1)
    assert zero_traffic(7e9, 8, 3) == {
        "all-gather of weights, forward": PASS,
        "all-gather of weights, backward": PASS,
        "reduce-scatter of gradients": PASS,
    }


def test_gradient_accumulation_by_hand():
    # k = 4 micro-batches: DDP (no_sync) and ZeRO-1 still communicate once per step;
    # ZeRO-2 reduce-scatters after every micro-batch (4 RS + 1 AG);
    # ZeRO-3 gathers twice and reduce-scatters every micro-batch (4 x 3 passes).
    k = 4
    assert sum(zero_traffic(7e9, 8, 0, micro_batches=k).values()) == 2 * PASS
    assert sum(zero_traffic(7e9, 8, 1, micro_batches=k).values()) == 2 * PASS
    assert zero_traffic(7e9, 8, 2, micro_batches=k) == {
        "reduce-scatter of gradients": 4 * PASS,
        "all-gather of updated weights": PASS,
    }
    assert sum(zero_traffic(7e9, 8, 3, micro_batches=k).values()) == 12 * PASS
    assert [traffic_relative_to_ddp(s, k) for s in range(4)] == [1, 1, 2.5, 6]
    assert [traffic_relative_to_ddp(s) for s in range(4)] == [1, 1, 1, 1.5]


def test_fp32_gradients_double_only_the_gradient_collectives():
    traffic = zero_traffic(7e9, 8, 2, bytes_per_gradient=4)
    assert traffic == {
        "reduce-scatter of gradients": 2 * PASS,
        "all-gather of updated weights": PASS,
    }
    assert zero_traffic(7e9, 8, 0, bytes_per_gradient=4) == {"all-reduce of gradients": 4 * PASS}


def test_one_run_of_each_collective_pads_to_whole_shards():
    # 10 values on 4 GPUs: shards of 3 (padded to 12), each pass sends 3 shards of 3 values.
    assert zero_collective_bytes(10, 4, 1, bytes_per_value=1) == {
        "reduce-scatter of gradients": 9,
        "all-gather of updated weights": 9,
    }
    assert zero_collective_bytes(10, 4, 0, bytes_per_value=2) == {"all-reduce of gradients": 36}
    assert zero_collective_bytes(10, 1, 3) == dict.fromkeys(
        [c.name for c in ZERO_COLLECTIVES[3]], 0
    )


def test_which_collectives_run_every_micro_batch():
    every = {s: [c.per_micro_batch for c in ZERO_COLLECTIVES[s]] for s in range(4)}
    assert every == {0: [False], 1: [False, False], 2: [True, False], 3: [True, True, True]}


@given(
    st.integers(0, 10**12),
    st.integers(1, 4096),
    st.sampled_from([0, 1, 2, 3]),
    st.integers(1, 64),
)
def test_per_step_is_per_run_times_how_often_it_runs(params, gpus, stage, k):
    runs = zero_collective_bytes(params, gpus, stage)
    step = zero_traffic(params, gpus, stage, micro_batches=k)
    for c in ZERO_COLLECTIVES[stage]:
        assert step[c.name] == runs[c.name] * (k if c.per_micro_batch else 1)
    ddp = sum(zero_traffic(params, gpus, 0, micro_batches=k).values())
    if ddp:  # the ratio of ring passes, whatever the size
        assert sum(step.values()) / ddp == pytest.approx(traffic_relative_to_ddp(stage, k))


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: zero_traffic(1e9, 8, 0, micro_batches=0), "micro_batches"),
        (lambda: zero_traffic(1e9, 8, 2, bytes_per_gradient=0), "bytes_per_gradient"),
        (lambda: zero_collective_bytes(1e9, 0, 1), "gpus"),
        (lambda: zero_collective_bytes(1e9, 8, 4), "zero_stage"),
        (lambda: traffic_relative_to_ddp(1, micro_batches=1.5), "micro_batches"),
    ],
)
def test_bad_arguments_are_named(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# --- ZeRO stages: memory and traffic ---------------------------------------------------

STAGES = list(STAGE_NAMES)


def test_bytes_per_parameter_on_8_gpus():
    assert [bytes_per_param(8, s) for s in STAGES] == [16, 5.5, 3.75, 2]
    # 2 + 2 + 12/8, 2 + 2/8 + 12/8, 16/8: the hand-worked sums
    assert bytes_per_param(8, 1) == 2 + 2 + 12 / 8
    assert bytes_per_param(8, 2) == 2 + 2 / 8 + 12 / 8


@given(st.integers(1, 4096), st.sampled_from(STAGES), st.integers(1, 10**6))
def test_bytes_per_param_agrees_with_memory_for_divisible_counts(gpus, stage, per_gpu):
    params = gpus * per_gpu
    assert bytes_per_param(gpus, stage) * params == pytest.approx(
        model_state_bytes(params, gpus, stage), rel=1e-12
    )


def test_traffic_relative_to_ddp():
    assert [traffic_relative_to_ddp(s) for s in STAGES] == [1, 1, 1, 1.5]


def test_ddp_traffic_is_a_ring_all_reduce_of_bf16_gradients():
    traffic = zero_traffic(7e9, 8, 0)
    assert traffic == {"all-reduce of gradients": 24_500_000_000}
    assert sum(traffic.values()) == ring_bytes_per_rank(2 * 7e9, 8) == 2 * 7 / 8 * 14e9


@given(st.integers(0, 10**13), st.integers(1, 10_000))
def test_traffic_of_each_stage_against_ddp(params, gpus):
    ddp = sum(zero_traffic(params, gpus, 0).values())
    assert sum(zero_traffic(params, gpus, 1).values()) == ddp
    assert sum(zero_traffic(params, gpus, 2).values()) == ddp
    assert 2 * sum(zero_traffic(params, gpus, 3).values()) == 3 * ddp
    if gpus == 1:
        assert ddp == 0  # nobody to talk to


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: bytes_per_param(0, 1), "gpus"),
        (lambda: bytes_per_param(8, 4), "zero_stage"),
        (lambda: zero_traffic(-1, 8, 0), "params"),
        (lambda: zero_traffic(1e9, 8, 0, bytes_per_value=0), "bytes_per_value"),
        (lambda: traffic_relative_to_ddp(True), "zero_stage"),
    ],
)
def test_zero_functions_name_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# --- How FSDP2 cuts tensors ------------------------------------------------------------


def test_fsdp_rows_split_like_torch_chunk():
    assert fsdp_shard_rows(10, 4) == [3, 3, 3, 1]
    assert fsdp_shard_rows(5, 4) == [2, 2, 1, 0]
    assert fsdp_shard_rows(1024, 4) == [256] * 4
    assert fsdp_shard_rows(0, 3) == [0, 0, 0]


@given(st.integers(0, 5000), st.integers(1, 64))
def test_fsdp_rows_cover_the_tensor_with_padded_chunks(rows, world):
    held = fsdp_shard_rows(rows, world)
    chunks = [c.shape[0] for c in torch.chunk(torch.empty(rows), world)] if rows else []
    assert held == chunks + [0] * (world - len(chunks))
    assert sum(held) == rows
    assert max(held) == math.ceil(rows / world)
    assert fsdp_padded_numel((rows, 3), world) == math.ceil(rows / world) * 3


@given(st.lists(st.integers(0, 40), min_size=0, max_size=3), st.integers(1, 9))
def test_fsdp_shards_hold_every_element_once(shape, world):
    numels = fsdp_shard_numels(shape, world)
    assert sum(numels) == math.prod(shape)
    assert all(n <= fsdp_padded_numel(shape, world) for n in numels)


def test_fsdp_state_bytes_of_the_chapter_model():
    shapes = [tuple(p.shape) for p in workers.sharded_model().parameters()]
    original = list(shapes)
    per_rank = [sum(fsdp_state_bytes(shapes, 4, r).values()) for r in range(4)]
    # 4 blocks of 525,568 parameters split evenly; the 10 x 256 head and its bias
    # split 3, 3, 3, 1 rows: 771 parameters on ranks 0-2, 257 on rank 3.
    assert per_rank == [16 * 526_339] * 3 + [16 * 525_825]
    assert sum(per_rank) == 16 * 2_104_842
    assert fsdp_state_bytes(shapes, 4, 0) == dict.fromkeys(FP32_ADAM_BYTES_PER_PARAM, 4 * 526_339)
    assert shapes == original


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: fsdp_shard_rows(-1, 4), "rows"),
        (lambda: fsdp_shard_rows(8, 0), "world_size"),
        (lambda: fsdp_shard_numels("ab", 2), "shape"),
        (lambda: fsdp_shard_numels((3, -2), 2), "shape"),
        (lambda: fsdp_state_bytes([(4,)], 4, 4), "rank"),
    ],
)
def test_fsdp_functions_name_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# --- One FSDP step, moment by moment --------------------------------------------------


def test_fsdp_collective_order_for_five_layers():
    # The order FSDP2 issued for the chapter's 5-unit model on 4 gloo ranks.
    expected = [("all-gather", i) for i in range(5)] + [
        ("all-gather", 4),
        ("all-gather", 3),
        ("reduce-scatter", 4),
        ("all-gather", 2),
        ("reduce-scatter", 3),
        ("all-gather", 1),
        ("reduce-scatter", 2),
        ("all-gather", 0),
        ("reduce-scatter", 1),
        ("reduce-scatter", 0),
    ]
    assert fsdp_collectives(fsdp_moments(5)) == expected


@given(st.integers(1, 60), st.booleans())
def test_fsdp_moments_gather_twice_and_scatter_once(layers, prefetch):
    moments = fsdp_moments(layers, prefetch)
    assert len(moments) == 2 * layers + 1
    order = fsdp_collectives(moments)
    for layer in range(layers):
        assert order.count(("all-gather", layer)) == 2
        assert order.count(("reduce-scatter", layer)) == 1
        # the backward gather comes before the reduce-scatter of the same layer
        second = [i for i, c in enumerate(order) if c == ("all-gather", layer)][1]
        assert second < order.index(("reduce-scatter", layer))
    most = max(len(m.whole) for m in moments)
    assert most == (2 if prefetch and layers > 1 else 1)
    assert moments[-1].whole == frozenset()
    assert all(m.layer in m.whole for m in moments[:-1])


def test_fsdp_moments_name_bad_arguments():
    with pytest.raises(ValueError, match="layers"):
        fsdp_moments(0)
    with pytest.raises(ValueError, match="prefetch"):
        fsdp_moments(3, prefetch=1)


def test_forward_prefetch_keeps_the_next_layer_whole_without_reordering():
    moments = fsdp_moments(5)
    assert [sorted(m.whole) for m in moments[:5]] == [[0, 1], [1, 2], [2, 3], [3, 4], [4]]
    assert [m.all_gathers for m in moments[:5]] == [(0, 1), (2,), (3,), (4,), ()]
    plain = fsdp_moments(5, prefetch=False)
    assert [sorted(m.whole) for m in plain[:5]] == [[0], [1], [2], [3], [4]]
    assert fsdp_collectives(plain) != fsdp_collectives(moments)  # backward differs...
    forward = fsdp_collectives(moments)[:5]
    assert forward == [("all-gather", i) for i in range(5)]  # ...forward order does not


# --- Working memory of an FSDP2 step -----------------------------------------------------

# Two units on 2 ranks: unit 0 one (4, 2) tensor (8 values, 4 per rank, whole 8);
# unit 1 one (3,) tensor (shards of 2 and 1, padded to 2, whole 4).
TINY = [[(4, 2)], [(3,)]]


def test_memory_moments_by_hand_on_rank_1():
    moments = fsdp_memory_moments(TINY, 2, rank=1)
    assert [(m.phase, m.unit) for m in moments] == [
        ("forward", 0),
        ("forward", 1),
        ("backward", 1),
        ("backward", 0),
        ("optimiser", None),
    ]
    # sharded weights: 4 B x (4 + 2) padded = 24; Adam: 8 B x (4 + 1) held = 40
    assert {m.sharded_weights for m in moments} == {24}
    assert {m.optimizer_state for m in moments} == {40}
    # forward: the unit's gathered weights and its all-gather buffer: 2 x 4 B x whole
    assert [m.whole_weights for m in moments[:2]] == [64, 32]
    # backward of 1: unit 1 (4 x 4) and unit 0 prefetched (4 x 8); its gradients 4 x 3
    assert (moments[2].whole_weights, moments[2].whole_gradients) == (48, 12)
    assert moments[2].gradient_shards == 0
    # backward of 0: unit 0 (32); its gradients (4 x 8) and unit 1's reduce-scatter
    # input (4 x 4); unit 1's gradient shard (4 x 2)
    assert (moments[3].whole_weights, moments[3].whole_gradients) == (32, 48)
    assert moments[3].gradient_shards == 8
    assert [m.total for m in moments] == [128, 96, 124, 152, 88]
    assert fsdp_peak(TINY, 2, rank=1) == moments[3]
    assert moments[-1].whole == 0 and moments[-1].sharded == 24 + 24 + 40


def test_memory_moments_prefetch_and_dtypes():
    # explicit forward prefetch adds the next unit's all-gather buffer: 4 x (16 + 4)
    ahead = fsdp_memory_moments(TINY, 2, 1, forward_prefetch=1)
    assert ahead[0].whole_weights == 80
    assert fsdp_memory_moments(TINY, 2, 1, backward_prefetch=0)[2].whole_weights == 16
    # bf16 compute, fp32 reduce: backward of 0 holds 2 x 8 of weights, 2 x 8 of gradients
    # and 4 x 4 of unit 1's reduce-scatter input
    mixed = fsdp_memory_moments(TINY, 2, 1, compute_bytes=2, reduce_bytes=4)[3]
    assert (mixed.whole_weights, mixed.whole_gradients) == (16, 32)
    # rank 0 holds 2 of unit 1's 3 values: Adam 8 x (4 + 2)
    assert fsdp_memory_moments(TINY, 2, 0)[0].optimizer_state == 48


@given(st.lists(st.integers(1, 50), min_size=1, max_size=6), st.integers(1, 5), st.integers(0, 2))
def test_memory_moments_hold_the_state_and_at_most_the_prefetched_units(sizes, world, ahead):
    units = [[(n,)] for n in sizes]
    moments = fsdp_memory_moments(units, world, forward_prefetch=ahead)
    state = fsdp_state_bytes([(n,) for n in sizes], world, 0)
    assert moments[-1].optimizer_state == state["Adam momentum"] + state["Adam variance"]
    assert moments[-1].sharded_weights >= state["weights"]
    whole = [world * math.ceil(n / world) for n in sizes]
    for m in moments[: len(sizes)]:
        assert m.whole_weights == 4 * (2 * whole[m.unit] + sum(whole[m.unit + 1 :][:ahead]))
    assert max(m.total for m in moments) == fsdp_peak(units, world, forward_prefetch=ahead).total


def test_decoder_units_by_hand():
    # 70B, 80 layers, width 8192, 128,256 tokens: tables of 1,050,673,152; the blocks
    # share 67,898,653,696 = 80 x 848,733,171 + 16, the head takes the 16.
    units = decoder_units(70e9, 80, 8192, 128_256)
    assert len(units) == 82
    assert units[0] == [(1_050_673_152,)] and units[1] == [(848_733_171,)]
    assert units[-1] == [(1_050_673_168,)]
    assert sum(u[0][0] for u in units) == 70_000_000_000


def test_zero_traffic_with_unsharded_gradient_accumulation():
    k = 4
    keep = {"micro_batches": k, "keep_unsharded_gradients": True}
    # ZeRO-3: 4 forward and 4 backward all-gathers, one reduce-scatter: 9 passes
    assert zero_traffic(7e9, 8, 3, **keep) == {
        "all-gather of weights, forward": 4 * PASS,
        "all-gather of weights, backward": 4 * PASS,
        "reduce-scatter of gradients": PASS,
    }
    # ZeRO-2 falls back to ZeRO-1's traffic; DDP is unchanged
    assert sum(zero_traffic(7e9, 8, 2, **keep).values()) == 2 * PASS
    assert zero_traffic(7e9, 8, 0, **keep) == zero_traffic(7e9, 8, 0, micro_batches=k)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: fsdp_memory_moments([], 2), "units"),
        (lambda: fsdp_memory_moments(["ab"], 2), "units"),
        (lambda: fsdp_memory_moments(TINY, 0), "world_size"),
        (lambda: fsdp_memory_moments(TINY, 2, rank=2), "rank"),
        (lambda: fsdp_memory_moments(TINY, 2, forward_prefetch=-1), "forward_prefetch"),
        (lambda: fsdp_memory_moments(TINY, 2, backward_prefetch=0.5), "backward_prefetch"),
        (lambda: fsdp_memory_moments(TINY, 2, compute_bytes=0), "compute_bytes"),
        (lambda: fsdp_memory_moments(TINY, 2, reduce_bytes=0), "reduce_bytes"),
        (lambda: fsdp_memory_moments(TINY, 2, shard_bytes=0), "shard_bytes"),
        (lambda: decoder_units(1e6, 2, 1000, 1000), "params"),
        (lambda: decoder_units(7e9, 0, 4096, 32_000), "layers"),
        (lambda: zero_traffic(1e9, 8, 3, keep_unsharded_gradients=1), "keep_unsharded"),
    ],
)
def test_memory_functions_name_bad_arguments(call, name):
    with pytest.raises(ValueError, match=name):
        call()
