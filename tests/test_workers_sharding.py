"""Chapter 05: ZeRO's stages and FSDP, counted (trainscale.sharding) and run for real (FSDP2)."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale import figures
from trainscale.collectives import ring_bytes_per_rank
from trainscale.distributed import run_ranks
from trainscale.memory import model_state_bytes
from trainscale.parallel import full_batch_gradient
from trainscale.sharding import (
    FP32_ADAM_BYTES_PER_PARAM,
    STAGE_NAMES,
    bytes_per_param,
    fsdp_collectives,
    fsdp_moments,
    fsdp_padded_numel,
    fsdp_shard_numels,
    fsdp_shard_rows,
    fsdp_state_bytes,
    traffic_relative_to_ddp,
    zero_traffic,
)
from trainscale.workers import sharding as workers

STAGES = list(STAGE_NAMES)

# --- ZeRO stages: memory and traffic ---------------------------------------------------


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


# --- Figures ---------------------------------------------------------------------------


def test_figures_draw():
    parts = {"weights": 1.0, "gradients": 1.0, "optimiser state": 6.0}
    fig = figures.zero_stage_bars({"DDP": parts, "ZeRO-1": parts}, 74.5, "test")
    assert len(fig.axes[0].patches) == 6
    fig = figures.fsdp_timeline(fsdp_moments(3), ["a", "b", "c"], upto=2)
    assert fig.axes[0].get_title().startswith("One FSDP step")
    with pytest.raises(ValueError, match="upto"):
        figures.fsdp_timeline(fsdp_moments(3), ["a", "b", "c"], upto=7)


# --- FSDP2 on real processes -----------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp_run():
    """One small FSDP2 step on 4 gloo ranks (the model of the chapter, narrower)."""
    kwargs = {"width": 16, "blocks": 2, "head": 6, "batch": 8, "seed": 3}
    return kwargs, run_ranks(workers.worker, 4, *kwargs.values(), timeout=180)


def test_fsdp2_bytes_per_rank_match_the_formula(fsdp_run):
    kwargs, results = fsdp_run
    model = workers.sharded_model(kwargs["width"], kwargs["blocks"], kwargs["head"], kwargs["seed"])
    shapes = [tuple(p.shape) for p in model.parameters()]
    for rank, result in enumerate(results):
        assert result["bytes"] == fsdp_state_bytes(shapes, 4, rank)
        padded = sum(fsdp_padded_numel(s, 4) for s in shapes)
        assert result["allocated weight bytes"] == 4 * padded


def test_fsdp2_gathers_and_scatters_in_the_modelled_order(fsdp_run):
    kwargs, results = fsdp_run
    units = kwargs["blocks"] + 1
    for result in results:
        order = [(c["kind"], c["layer"]) for c in result["collectives"]]
        assert order == fsdp_collectives(fsdp_moments(units))
        assert result["whole in forward"] == [[i] for i in range(units)]
        gathered = sum(c["bytes"] for c in result["collectives"] if c["kind"] == "all-gather")
        scattered = sum(c["bytes"] for c in result["collectives"] if c["kind"] == "reduce-scatter")
        assert gathered == 2 * scattered  # two passes over the weights, one over the gradients


def test_fsdp2_gradient_and_update_equal_one_process(fsdp_run):
    kwargs, results = fsdp_run
    model = workers.sharded_model(kwargs["width"], kwargs["blocks"], kwargs["head"], kwargs["seed"])
    x, y = workers.step_data(kwargs["batch"], kwargs["width"], kwargs["head"], kwargs["seed"])
    expected = full_batch_gradient(model, workers.loss_fn, x, y)
    got = results[0]["gradients"]
    assert got.keys() == expected.keys()
    assert all(torch.allclose(got[k], expected[k], atol=1e-6) for k in expected)
    assert all(r["update difference"] <= 1e-7 for r in results)


def test_fsdp2_mixed_precision_gathers_bf16_and_keeps_fp32_shards(fsdp_run):
    _, results = fsdp_run
    mixed = results[0]["mixed precision"]
    assert {c["dtype"] for c in mixed["collectives"]} == {"bfloat16"}
    assert mixed["sharded weight dtypes"] == ["float32"]
    assert mixed["gradient dtypes"] == ["float32"]
    fp32 = [c["bytes"] for c in results[0]["collectives"]]
    assert [2 * c["bytes"] for c in mixed["collectives"]] == fp32


def test_worker_rejects_a_batch_that_does_not_split():
    with pytest.raises(ValueError, match="batch"):
        workers.worker(0, 3, batch=8)
