"""planner: memory, step time and ranking of TP x PP x DP layouts against hand-worked numbers."""

import dataclasses
import functools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainscale import checkpointing, collectives, compute, context, experts, sharding
from trainscale import planner as P
from trainscale.compute import training_seconds
from trainscale.memory import model_state_bytes
from trainscale.planner.calibration import _choices
from trainscale.planner.kernels import (
    _forward_and_backward,
    _fused_attention_seconds,
    _layer_times,
    _rates,
    _roofline,
)
from trainscale.planner.traffic import _data_parallel_seconds, _zero3_extra, _zero3_prefetch

# The hand-worked numbers below take a batch of 64 sequences (the chapter's example now
# takes P.EXAMPLE_GLOBAL_BATCH, 1,024; nbval and tests/test_main.py check what it prints).
SIMPLE = P.KERNEL_EFFICIENCY  # the simple cost model: 6N FLOPs at one efficiency

M70, H100, BATCH = P.EXAMPLE_MODEL, P.EXAMPLE_CLUSTER, 64
SBH_70B = 4096 * 8192  # s * h for one sequence of the worked example
RATE = 989e12 * 0.6  # the H100's FLOP/s at the simple model's kernel efficiency


@pytest.fixture(scope="module")
def layouts_70b():
    return P.plan(M70, H100, BATCH)


# --- Korthikanti et al.: activations of one transformer layer (chapter 3's table) ------------


def test_the_planner_counts_activations_with_chapter_09s_table():
    assert P.layer_activation_bytes is checkpointing.layer_activation_bytes
    assert P.RECOMPUTE == ("none", "selective", "full")
    # GPT-3 175B, TP 8 with sequence parallelism: sbh(34/t + 5as/(ht)), s b h = 25,165,824.
    assert P.layer_activation_bytes(2048, 1, 12288, 96, 8, True) == 25_165_824 * (34 + 80) / 8


# --- Model state per GPU: chapters 2 and 7 ------------------------------------------


def test_70b_state_is_1_1_tb():
    assert model_state_bytes(70e9) == 70 * 10**9 * 16 == 1_120_000_000_000


def test_70b_state_per_gpu_with_tp8_pp4_dp2_at_each_zero_stage():
    # Embedding and output layer: 2 x 32,000 x 8,192 = 524,288,000 parameters; the other
    # 69,475,712,000 shared by 80 layers is 868,446,400 each. A stage of PP 4 holds
    # 20 layers plus one vocabulary matrix: 17,631,072,000, and TP 8 leaves 2,203,884,000.
    assert M70.embedding_params == 524_288_000
    assert M70.layer_params == 868_446_400
    per_gpu = 2_203_884_000
    assert P.stage_params(M70, 8, 4) == per_gpu == (20 * 868_446_400 + 262_144_000) // 8
    bytes_per_param = [16, 2 + 2 + 12 / 2, 2 + 2 / 2 + 12 / 2, 16 / 2]  # DP 2 shards halves
    for stage, per_param in enumerate(bytes_per_param):
        state = P.model_state_per_gpu(M70, 8, 4, 2, stage)
        assert sum(state.values()) == per_param * per_gpu
    assert P.model_state_per_gpu(M70, 8, 4, 2, 0) == {
        "weights": 2 * per_gpu,
        "gradients": 2 * per_gpu,
        "optimiser state": 12 * per_gpu,
    }
    assert sum(P.model_state_per_gpu(M70, 8, 4, 2, 0).values()) / 1e9 == pytest.approx(
        35.26, abs=0.01
    )


def test_context_parallel_ranks_shard_the_state_like_data_parallel_ones():
    # CP splits the tokens, not the weights: ZeRO shards over DP x CP (chapter 10).
    for zero in range(4):
        split = P.model_state_per_gpu(M70, 8, 4, 1, zero, context_parallel=2)
        assert split == P.model_state_per_gpu(M70, 8, 4, 2, zero)
    assert P.model_state_per_gpu(M70, 8, 4, 2, 0, context_parallel=2) == P.model_state_per_gpu(
        M70, 8, 4, 2, 0
    )  # without ZeRO nothing is sharded: CP holds whole copies too


def test_stage_params_without_a_pipeline_is_the_whole_model_over_tp():
    assert P.stage_params(M70, 1, 1) == 70 * 10**9
    assert P.stage_params(M70, 3, 1) == math.ceil(70e9 / 3)  # uneven shards: the largest
    tied = P.Model(
        params=1e9, layers=10, hidden=1024, heads=8, seq_len=512, vocab=1000, tied_embeddings=True
    )
    # Tied: the output layer is a copy of the embedding, held by the last stage.
    assert tied.embedding_params == 1000 * 1024
    assert P.stage_params(tied, 1, 2) == 5 * (10**9 - 1_024_000) // 10 + 1_024_000


def test_uneven_stages_get_the_larger_share_of_layers():
    # 80 layers over PP 3: the fullest stage has 27.
    expected = math.ceil(27 * M70.layer_params) + 32000 * 8192
    assert P.stage_params(M70, 1, 3) == expected


# --- Activations per GPU: layers x micro-batches in flight ---------------------------------


SHAPE_70B = {"fused_attention": True}  # the example model's layer, GPT-shaped otherwise


def test_70b_activations_on_the_first_stage_of_tp8_pp4():
    # Selective recomputation, sequence parallelism, TP 8, and the fused attention
    # kernel's fp32 row statistic, 4 a s b / t = 4 x 64 x 4096 / 8 bytes.
    per_layer = SBH_70B * 34 / 8 + 4 * 64 * 4096 / 8
    first = 4 * 20 * per_layer + 4 * SBH_70B / 8  # 4 micro-batches in flight, embedding masks
    last = 20 * per_layer + 4 * SBH_70B / 8 + 4 * 4096 * 32000 / 8  # one in flight, logits
    got = P.activation_bytes_per_gpu(M70, 8, 4, 1, 32, "selective", True)
    assert got == first == max(first, last) == 11_435_769_856


@pytest.mark.parametrize("pp", [2, 4, 8, 16])
def test_1f1b_first_stage_holds_the_whole_models_layers(pp):
    # Korthikanti et al. 4.2.3: p micro-batches in flight x L/p layers = L layers.
    per_layer = P.layer_activation_bytes(4096, 1, 8192, 64, 8, True, "selective", **SHAPE_70B)
    extras = pp * SBH_70B / 8
    assert P.activation_bytes_per_gpu(M70, 8, pp, 1, 64, "selective") == 80 * per_layer + extras
    # With fewer micro-batches than stages, only those are in flight.
    assert P.activation_bytes_per_gpu(M70, 8, pp, 1, 1, "selective") < 80 * per_layer


def test_interleaved_schedule_holds_korthikanti_extra_share():
    # v = 2 chunks per GPU, p = 4: L (1 + (p-1)/(p v)) = 80 x 11/8 = 110 layers.
    per_layer = P.layer_activation_bytes(4096, 1, 8192, 64, 8, True, "selective", **SHAPE_70B)
    got = P.activation_bytes_per_gpu(M70, 8, 4, 1, 64, "selective", virtual_stages=2)
    assert got == 110 * per_layer + 4 * SBH_70B / 8


# --- One layout's step time, term by term --------------------------------------------------


def test_effective_batch_is_micro_batch_times_accumulation_times_dp():
    layout = P.evaluate(M70, H100, BATCH, tp=8, pp=4, dp=2, micro_batch=2)
    assert layout.accumulation == 16
    assert layout.effective_batch == 2 * 16 * 2 == 64
    assert layout.gpus == 64 and layout.shape == (8, 4, 2)
    assert layout.name == "TP 8 \u00d7 PP 4 \u00d7 DP 2"


def test_compute_is_6nd_at_the_achievable_rate():
    layout = P.evaluate(M70, H100, BATCH, 8, 1, 8, 0, "none", 1, efficiency=SIMPLE)
    expected = training_seconds(70e9, BATCH * 4096, 64, 989e12, 0.6)
    assert layout.times["compute"] == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(2.899, abs=1e-3)
    assert layout.times["recomputation"] == 0


def test_full_recomputation_costs_one_more_forward_pass():
    layout = P.evaluate(M70, H100, BATCH, 8, 4, 2, 1, "full", 1, efficiency=SIMPLE)
    assert layout.times["recomputation"] == pytest.approx(layout.times["compute"] / 3)


def test_selective_recomputation_costs_the_attention_scores_again():
    layout = P.evaluate(M70, H100, BATCH, 8, 4, 2, 1, "selective", 1, efficiency=SIMPLE)
    per_micro = 2 * 4096**2 * 8192 * 20 / 8 / RATE  # Q K^T: 2bs^2h FLOPs per layer, 20 layers
    assert layout.times["recomputation"] == pytest.approx(32 * per_micro, rel=1e-12)
    assert layout.times["recomputation"] / layout.times["compute"] == pytest.approx(
        0.0128, abs=1e-4
    )


def test_tensor_parallel_traffic_of_the_worked_example():
    # 32 micro-batches x 20 layers x 4 all-reduces x 2(7/8) x 2sbh bytes over 450 GB/s NVLink.
    args = (M70, H100, BATCH, 8, 4, 2, 1, "selective", 1)
    layout = P.evaluate(*args, efficiency=SIMPLE, sequence_parallel=False)
    expected = 32 * 20 * 4 * 1.75 * 2 * SBH_70B / 450e9
    assert layout.times["tensor-parallel traffic"] == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.668, abs=1e-3)
    full = P.evaluate(
        M70, H100, BATCH, 8, 4, 2, 1, "full", 1, efficiency=SIMPLE, sequence_parallel=False
    )  # the recomputed forward repeats 2
    assert full.times["tensor-parallel traffic"] == pytest.approx(1.5 * expected, rel=1e-12)
    # Sequence parallelism as Megatron-LM runs it (the default stack): 8 half-collectives
    # and 2 all-gathers more in backward, 10 halves = 5 all-reduces' bytes, a quarter more;
    # the recomputed forward adds its 4 halves: 14 = 7 all-reduces.
    megatron = P.evaluate(*args, efficiency=SIMPLE)
    assert megatron.times["tensor-parallel traffic"] == pytest.approx(1.25 * expected, rel=1e-12)
    again = P.evaluate(M70, H100, BATCH, 8, 4, 2, 1, "full", 1, efficiency=SIMPLE)
    assert again.times["tensor-parallel traffic"] == pytest.approx(1.75 * expected, rel=1e-12)
    # DTensor's plan (torchtitan) keeps the gathered input: the same bytes as TP alone.
    titan = P.evaluate(*args, efficiency=SIMPLE, software="torchtitan-fsdp2")
    assert titan.times["tensor-parallel traffic"] == pytest.approx(expected, rel=1e-12)


def test_data_parallel_all_reduce_hides_under_the_last_backward():
    # ZeRO-0, DP 2 across nodes: 2 x (1/2) x 2 bytes x 2,203,884,000 parameters at 50 GB/s,
    # minus the backward (and recomputation) of one micro-batch on the stage.
    layout = P.evaluate(M70, H100, BATCH, 8, 4, 2, 0, "selective", 1, efficiency=SIMPLE)
    all_reduce = 2 * 0.5 * 2 * 2_203_884_000 / 50e9
    compute = 6 * 70e9 * 4096 / 32 / RATE
    window = 2 / 3 * compute + 2 * 4096**2 * 8192 * 20 / 8 / RATE
    assert layout.times["data-parallel traffic"] == pytest.approx(all_reduce - window, rel=1e-9)
    assert all_reduce == pytest.approx(0.0882, abs=1e-4)


def _bare(nodes=2, gpus_per_node=2, peak=1e30):
    """A cluster so fast at maths that no communication can hide."""
    return P.Cluster(nodes, gpus_per_node, 80e9, peak, 100e9, 10e9)


SMALL = P.Model(params=1.2e9, layers=8, hidden=1024, heads=8, seq_len=256, vocab=1000)


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_zero_traffic_per_stage_relative_to_an_all_reduce(micro_batches):
    # With nothing to hide behind: ZeRO-1 = one all-reduce's volume; ZeRO-2 adds a
    # reduce-scatter per extra micro-batch; ZeRO-3 moves 3 halves per micro-batch,
    # 1.5 times ZeRO-0 when there is one micro-batch.
    batch = 4 * micro_batches  # DP 4, micro-batch 1
    dp = [
        P.evaluate(SMALL, _bare(), batch, 1, 1, 4, z, "none", 1, efficiency=SIMPLE)
        for z in range(4)
    ]
    traffic = [lay.times["data-parallel traffic"] for lay in dp]
    m = micro_batches
    assert traffic[1] == pytest.approx(traffic[0], rel=1e-9)
    assert traffic[2] == pytest.approx(traffic[0] * (m + 1) / 2, rel=1e-9)
    assert traffic[3] == pytest.approx(traffic[0] * 3 * m / 2, rel=1e-9)
    # All four move (d-1)/d x 2 bytes per parameter per collective, DP across nodes.
    assert traffic[0] == pytest.approx(2 * 0.75 * 2 * 1.2e9 / 10e9, rel=1e-9)
    # The bytes are chapter 7's, per step of m micro-batches, over the 10 GB/s network.
    for zero, seconds in enumerate(traffic):
        sent = sharding.zero_traffic(1.2e9, 4, zero, micro_batches=m)
        assert seconds == pytest.approx(sum(sent.values()) / 10e9, rel=1e-9)


def test_bubble_share_is_gpipes_formula_without_data_parallelism():
    layout = P.evaluate(M70, H100, BATCH, 8, 8, 1, 0, "selective", 1, efficiency=SIMPLE)  # m = 64
    assert layout.bubble == pytest.approx(7 / (64 + 7), rel=1e-12)
    assert layout.verdict == "fits"
    flagged = P.evaluate(M70, H100, BATCH, 8, 8, 1, 0, "selective", 8, efficiency=SIMPLE)  # m = 8
    assert flagged.bubble == pytest.approx(7 / 15, rel=1e-12)
    assert "bubble too large" in flagged.problems
    interleaved = P.evaluate(
        M70, H100, BATCH, 8, 8, 1, 0, "selective", 8, virtual_stages=2, efficiency=SIMPLE
    )
    assert interleaved.bubble == pytest.approx(7 / (2 * 8 + 7), rel=1e-12)


def test_times_and_memory_add_up():
    layout = P.evaluate(M70, H100, BATCH, 8, 4, 2, 1, "selective", 1)
    assert list(layout.times) == list(P.TIME_PARTS)
    assert list(layout.memory_parts) == list(P.MEMORY_PARTS)
    assert sum(layout.times.values()) == pytest.approx(layout.step_seconds, rel=1e-12)
    assert sum(layout.memory_parts.values()) == layout.memory_bytes
    six_nd = 6 * 70e9 * BATCH * 4096
    assert layout.mfu == pytest.approx(six_nd / (layout.step_seconds * 64 * 989e12), rel=1e-12)


# --- The worked example: the whole plan ----------------------------------------------------


def test_classic_3d_layout_wins_without_zero(layouts_70b):
    # Tensor, pipeline and data parallelism alone, micro-batch 2 as in the text:
    # TP 8 x PP 4 x DP 2 with 16 accumulation steps is the planner's first choice.
    plain = P.plan(M70, H100, BATCH, zero_stages=(0,), micro_batches=(2,), context_parallel=(1,))
    best = P.top_layouts(plain, 5)
    assert best[0].shape == (8, 4, 2) and best[0].accumulation == 16
    # With every micro-batch size it stays among the five best shapes.
    assert (8, 4, 2) in [
        lay.shape for lay in P.top_layouts(P.plan(M70, H100, BATCH, zero_stages=(0,)), 5)
    ]


def test_with_zero_the_common_layout_stays_close_to_the_best(layouts_70b):
    best = P.top_layouts(layouts_70b, 10)
    shapes = [lay.shape for lay in best]
    assert (8, 4, 2) in shapes
    common = best[shapes.index((8, 4, 2))]
    assert common.step_seconds <= 1.15 * best[0].step_seconds
    # Every layout ranked above it keeps TP inside a node and fits.
    for layout in best[: shapes.index((8, 4, 2))]:
        assert layout.tp <= 8 and layout.verdict == "fits"


def test_every_layout_with_tp_above_8_crosses_nodes(layouts_70b):
    wide = [lay for lay in layouts_70b if lay.tp > 8]
    assert {lay.tp for lay in wide} == {16, 32, 64}
    assert all("TP across nodes" in lay.problems for lay in wide)
    assert all(lay.verdict != "fits" for lay in wide)
    assert not any("TP across nodes" in lay.problems for lay in layouts_70b if lay.tp <= 8)


def test_the_plan_is_ranked_and_counted(layouts_70b):
    counts = P.verdict_counts(layouts_70b)
    assert list(counts) == list(P.VERDICTS)
    # (TP, CP, PP) with TP x CP x PP dividing 64, CP in 1, 2, 4 (4,096 tokens, at least
    # 1,024 per rank): 28 + 21 + 15 shapes, x 4 ZeRO stages x 3 modes x 4 micro-batches
    assert P.context_parallel_degrees(M70, H100) == (1, 2, 4)
    assert sum(counts.values()) == len(layouts_70b) == (28 + 21 + 15) * 4 * 3 * 4
    fits = [lay for lay in layouts_70b if lay.verdict == "fits"]
    assert layouts_70b[: len(fits)] == fits  # those that fit come first
    steps = [lay.step_seconds for lay in fits]
    assert steps == sorted(steps)
    assert all(lay.verdict == "invalid" for lay in layouts_70b[-counts["invalid"] :])


def test_no_layout_fits_the_70b_without_splitting_the_model(layouts_70b):
    alone = [lay for lay in layouts_70b if lay.shape == (1, 1, 64) and lay.zero_stage == 0]
    assert {lay.verdict for lay in alone} == {"out of memory", "invalid"}  # micro-batches > 1
    assert all(lay.memory_bytes > 1.12e12 for lay in alone if lay.verdict != "invalid")
    # The note compares with the capacity the H100 reports, in GiB: 81,559 MiB / 1,024.
    oom = next(lay for lay in alone if lay.verdict == "out of memory")
    assert any(note.endswith("GiB per GPU, over 90% of 79.6 GiB") for note in oom.notes)


def test_a_layout_fits_in_what_the_gpu_reports_not_in_80e9_bytes(layouts_70b):
    # Capacity in the plan is 0.9 x 81,559 x 2**20 = 76.97e9 bytes; with 80e9 bytes it was
    # 72e9. A layout whose fullest GPU needs between the two fits now and did not before.
    usable = 0.9 * 81_559 * 2**20
    assert usable == pytest.approx(76.969e9, rel=1e-4)
    between = [lay for lay in layouts_70b if 72e9 < lay.memory_bytes <= usable and lay.cp == 1]
    assert between and all("out of memory" not in lay.problems for lay in between)
    marketed = P.Cluster(nodes=8, **(P.H100_NODE | {"memory_bytes": 80e9}))
    for lay in between:
        again = P.evaluate(
            M70,
            marketed,
            BATCH,
            *lay.shape,
            lay.zero_stage,
            lay.recompute,
            lay.micro_batch,
        )
        assert "out of memory" in again.problems


# --- Properties on random small clusters -----------------------------------------------------


@st.composite
def problems(draw):
    heads = draw(st.sampled_from([1, 2, 4, 8, 12]))
    hidden = heads * draw(st.sampled_from([16, 64]))
    layers = draw(st.integers(1, 24))
    vocab = draw(st.integers(1, 5000))
    extra = draw(st.integers(1, 10**10))
    model = P.Model(
        params=2 * vocab * hidden + extra,
        layers=layers,
        hidden=hidden,
        heads=heads,
        seq_len=draw(st.sampled_from([1, 128, 2048])),
        vocab=vocab,
    )
    cluster = P.Cluster(
        nodes=draw(st.integers(1, 4)),
        gpus_per_node=draw(st.sampled_from([1, 2, 3, 4, 8])),
        memory_bytes=draw(st.sampled_from([16e9, 80e9, 1e15])),
        peak_flops=draw(st.sampled_from([1e12, 989e12])),
        intra_node_bandwidth=450e9,
        inter_node_bandwidth=draw(st.sampled_from([1e9, 50e9])),
    )
    return model, cluster, draw(st.integers(1, 48))


@given(problems(), st.sampled_from([1, 2]))
def test_plan_properties(problem, virtual_stages):
    model, cluster, batch = problem
    micro = [1, 2, 3]
    layouts = P.plan(model, cluster, batch, micro_batches=micro, virtual_stages=virtual_stages)
    assert micro == [1, 2, 3]  # inputs are not mutated
    assert len(layouts) == len(
        {(lay.shape, lay.cp, lay.zero_stage, lay.recompute, lay.micro_batch) for lay in layouts}
    )
    by_setting = {}
    for lay in layouts:
        assert lay.tp * lay.cp * lay.pp * lay.dp == cluster.gpus
        assert ("TP across nodes" in lay.problems) == (cluster.gpus_per_node % lay.tp != 0)
        assert lay.verdict in P.VERDICTS and (lay.verdict == "fits") == (not lay.problems)
        if lay.verdict == "invalid":
            assert math.isnan(lay.step_seconds) and lay.accumulation is None
            continue
        assert lay.effective_batch == batch
        assert 0 < lay.mfu <= P.KERNEL_EFFICIENCY + 1e-12
        assert 0 <= lay.bubble < 1
        by_setting[(lay.shape, lay.cp, lay.recompute, lay.micro_batch, lay.zero_stage)] = lay
    for (shape, cp, mode, b, zero), lay in by_setting.items():
        if zero > 0:  # a higher ZeRO stage never needs more memory
            assert lay.memory_bytes <= by_setting[(shape, cp, mode, b, zero - 1)].memory_bytes
        if mode != "none":  # recomputation never keeps more activations
            keep = by_setting[(shape, cp, P.RECOMPUTE[P.RECOMPUTE.index(mode) - 1], b, zero)]
            assert lay.memory_parts["activations"] <= keep.memory_parts["activations"]


@given(problems())
def test_one_gpu_per_cluster_has_one_layout_per_setting(problem):
    model, _, batch = problem
    single = P.Cluster(1, 1, 80e9, 1e15, 1e11, 1e10)
    layouts = P.plan(model, single, batch, micro_batches=(1,), zero_stages=(0,))
    assert [lay.shape for lay in layouts] == [(1, 1, 1)] * 3
    for lay in layouts:
        assert lay.times["data-parallel traffic"] == lay.times["tensor-parallel traffic"] == 0
        assert lay.bubble == 0 and lay.accumulation == batch


def test_top_layouts_keep_one_setting_per_shape(layouts_70b):
    best = P.top_layouts(layouts_70b, 100)
    assert len({lay.shape for lay in best}) == len(best)
    assert all(lay.verdict == "fits" for lay in best)
    steps = [lay.step_seconds for lay in best]
    assert steps == sorted(steps)
    assert P.top_layouts(layouts_70b, 1) == best[:1]


def test_1t_on_16384_gpus_enumerates_every_layout():
    model = P.Model(params=1.008e12, layers=128, hidden=25600, heads=160, seq_len=2048, vocab=51200)
    cluster = P.Cluster(nodes=2048, **P.H100_NODE)
    layouts = P.plan(model, cluster, 16384, context_parallel=(1,))
    assert len(layouts) == 120 * 4 * 3 * 4  # 120 (TP, PP) pairs x ZeRO x recompute x micro
    assert all(lay.tp <= 8 for lay in P.top_layouts(layouts, 5))


# --- Published runs --------------------------------------------------------------------------


def test_nodes_come_from_the_gpu_table():
    assert P.H100_NODE == {
        "gpus_per_node": 8,
        "memory_bytes": 81_559 * 2**20,  # what nvidia-smi reports: 79.6 GiB, not 80e9 bytes
        "peak_flops": 989e12,
        "intra_node_bandwidth": 450e9,
        "inter_node_bandwidth": 50e9,
        "memory_bandwidth": 3.35e12,  # HBM3, H100 SXM datasheet
        "multiprocessors": 132,
        "max_matmul_share": 794.5 / 989,  # the fastest bf16 GEMM measured on it
        "peak_flops_low": None,  # not power-limited below its datasheet
        "attention_share": (0.35, 0.75),  # FlashAttention-2 to -3 (arXiv 2407.08608)
        "fp8_peak_flops": 1979e12,  # dense FP8
        "fp8_max_matmul_share": 1541 / 1979,  # the fastest FP8 GEMM measured (tile-lang)
    }
    assert P.A100_NODE["peak_flops"] == 312e12 and P.A100_NODE["inter_node_bandwidth"] == 25e9
    assert P.A100_NODE["memory_bytes"] == 80 * 2**30  # 81,920 MiB: exactly 80 GiB


def _run(name: str) -> P.PublishedRun:
    return next(run for run in P.published_runs() if run.name == name)


MEGATRON_1T = "GPT 1008.0B on 3,072 A100s"
LLAMA_8K = "Llama 3 405B on 8,192 H100s, 8K tokens"


def test_published_runs_become_planner_models_and_clusters():
    runs = P.published_runs()
    assert all(isinstance(run, P.PublishedRun) for run in runs)
    megatron_1t, llama = _run(MEGATRON_1T), _run(LLAMA_8K)
    model = P.published_model(megatron_1t)
    assert model.tied_embeddings and model.embedding_params == 51200 * 25600
    assert (model.params, model.layers, model.hidden, model.heads) == (
        1_008_038_707_200,  # eq. 2: 12 l h^2 + 13 l h + (V + s) h
        128,
        25600,
        160,
    )
    cluster = P.published_cluster(megatron_1t)
    assert (cluster.nodes, cluster.gpus, cluster.peak_flops) == (384, 3072, 312e12)
    assert cluster.inter_node_bandwidth == 25e9 and cluster.intra_node_bandwidth == 300e9
    assert not P.published_model(llama).tied_embeddings
    assert P.published_cluster(llama).gpus == 8192
    # The attention kernel and dropout are the software's (trainscale.software).
    assert P.published_model(llama).fused_attention is None
    assert P.published_model(llama).under(llama.software).fused_attention
    assert not model.under(megatron_1t.software).fused_attention
    assert not P.published_model(llama).under(llama.software).dropout
    assert (P.published_model(llama).kv_heads, P.published_model(llama).gated_mlp) == (8, True)


def test_megatron_counts_recomputation_so_its_52_percent_is_39_in_6n_terms():
    run = _run(MEGATRON_1T)
    # Equation 3 per token: 96 L h^2 (1 + s/(6h) + V/(16 L h)); 163 of 312 TFLOP/s.
    per_token = 96 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600))
    n = 1_008_038_707_200
    assert P.reported_mfu_6n(run) == pytest.approx(163 / 312 * 6 * n / per_token, rel=1e-12)
    assert P.reported_mfu(run) == P.reported_mfu_6n(run)
    assert P.reported_mfu_6n(run) == pytest.approx(0.387, abs=1e-3)


def test_llama3_mfu_adds_the_attention_flops():
    run = _run(LLAMA_8K)
    six_n = 6 * 405e9
    expected = 430 / 989 * six_n / (six_n + 12 * 126 * 16384 * 8192)
    assert P.reported_mfu_6n(run) == pytest.approx(expected, rel=1e-12)
    assert P.reported_mfu_6n(run) == pytest.approx(0.401, abs=1e-3)


@pytest.mark.parametrize("name", [MEGATRON_1T, LLAMA_8K, "GPT 174.6B on 768 A100s, ZeRO-3"])
def test_estimates_for_published_runs_use_their_shape(name):
    run = _run(name)
    estimate = P.estimate_run(run)
    layout = estimate.layout
    assert layout.shape == (run.tp, run.pp, run.dp)
    assert layout.recompute == run.recompute and layout.zero_stage == run.zero_stage
    assert 0 < estimate.mfu_low <= estimate.mfu <= estimate.mfu_high < 1
    assert estimate.times is layout.times and estimate.memory_bytes == layout.memory_bytes


def test_tile_overhead_by_hand():
    # The output write: 0.5 x 1e15 FLOP/s over 2.5e12 B/s = 200 FLOPs per byte, so the
    # tile's 2 x 256 x 128 bytes take as long as 200 more steps of k.
    assert P.tile_overhead_k(0.5, 1e15, 2.5e12) == pytest.approx(200)
    # An A100 (312e12, 2.039e12 B/s) at 0.72 of peak: 110.
    assert P.tile_overhead_k(0.72, 312e12, 2.039e12) == pytest.approx(0.72 * 312 / 2.039)
    with pytest.raises(ValueError, match="bandwidth"):
        P.tile_overhead_k(0.5, 1e15, 0)


def test_gemm_roofline_and_waves_by_hand():
    # 8192 x 8192 x 8192 on 128 SMs: 32 x 64 = 2,048 tiles of 256 x 128 = 16 full waves,
    # 2 x 8192^3 = 1.1e12 FLOPs at 0.5 x 1e15 = 2.2 ms, and each tile's fixed cost (149
    # of k at 0.5e15 FLOP/s and 3.35e12 B/s) on top; its 3 x 2 x 8192^2 = 403 MB at
    # 3.35e12 B/s take 0.12 ms: compute bound, no wave wasted.
    k0 = 0.5e15 / 3.35e12
    full = P.gemm_seconds(8192, 8192, 8192, 1e15, 3.35e12, 0.5, multiprocessors=128)
    assert full == pytest.approx(2 * 8192**2 * (8192 + k0) / 0.5e15)
    hidden = P.gemm_seconds(8192, 8192, 8192, 1e15, 3.35e12, 0.5, 1, 128, tile_overhead=0)
    assert hidden == pytest.approx(2 * 8192**3 / 0.5e15)
    # 132 SMs: 2,048 tiles take 16 waves (15.5 rounded up), as long as 16 x 132 tiles.
    waves = P.gemm_seconds(8192, 8192, 8192, 1e15, 3.35e12, 0.5, multiprocessors=132)
    assert waves == pytest.approx(16 * 132 * 2 * 256 * 128 * (8192 + k0) / 0.5e15)
    # A short k costs more per FLOP: k = 1024 pays the same fixed cost on 1/8 the work.
    short = P.gemm_seconds(8192, 1024, 8192, 1e15, 3.35e12, 0.5, multiprocessors=128)
    assert short / (full / 8) == pytest.approx((1024 + k0) / 1024 * 8192 / (8192 + k0))
    # Q K^T of one head, s = 8192, d = 128: 17.2 GFLOPs take 34 us at 0.5 PFLOP/s (74 us
    # with each tile's fixed cost), and its 2 (2 x 8192 x 128 + 8192^2) = 138 MB 41 us:
    # the tiles' fixed cost makes it compute bound.
    qk = P.gemm_seconds(8192, 128, 8192, 1e15, 3.35e12, 0.5, multiprocessors=128)
    assert qk == pytest.approx(2 * 8192**2 * (128 + k0) / 0.5e15)
    flat = P.gemm_seconds(8192, 128, 8192, 1e15, 3.35e12, 0.5, 1, 128, tile_overhead=0)
    assert flat == pytest.approx(2 * (2 * 8192 * 128 + 8192**2) / 3.35e12)
    with pytest.raises(ValueError, match="tile_overhead"):
        P.gemm_seconds(1, 1, 1, 1e15, 1e12, 0.5, tile_overhead=-1)
    with pytest.raises(ValueError, match="share"):
        P.gemm_seconds(1, 1, 1, 1e15, 1e12, 1.5)
    with pytest.raises(ValueError, match="multiprocessors"):
        P.gemm_seconds(1, 1, 1, 1e15, 1e12, 0.5, multiprocessors=0)


def test_zero3_regathers_under_full_recompute_and_pays_ring_latency():
    # 1e9 parameters per GPU over DP 4: the forward gather sends 3/4 x 2e9 bytes,
    # 1.5 s at 1e9 B/s; 10 layers x (3 collectives + the regather) x 3 ring steps x 5 us.
    regather, latency = _zero3_extra(10**9, 4, 3, "full", 10, 1e9)
    assert regather == pytest.approx(1.5) and latency == pytest.approx(10 * 4 * 3 * 5e-6)
    assert _zero3_extra(10**9, 4, 3, "selective", 10, 1e9)[0] == 0.0
    assert _zero3_extra(10**9, 4, 1, "full", 10, 1e9) == (0.0, 0.0)


@functools.cache
def calibration_estimates() -> tuple[P.RunEstimate, ...]:
    """The planner's estimate of every fit run (the A100 runs), once per test session."""
    fit, _ = P.split_runs()
    return tuple(P.estimate_run(run) for run in fit)


def test_runs_are_split_by_gpu_before_anything_is_read_off_them():
    fit, held_out = P.split_runs()
    assert len(fit) == 32 and {run.gpu for run in fit} == {"A100-80GB"}
    assert len(held_out) == 17 and "A100-80GB" not in {run.gpu for run in held_out}
    assert len(fit) + len(held_out) == len(P.published_runs())
    # Table 4's run, the one measurement the GEMM share is read off, is a fit run.
    assert P.TABLE4_RUN in {run.name for run in fit}


def test_calibration_against_the_fit_runs(capsys):
    """The A100 runs the model is read against. Its margin makes 90 % of them fall in the
    range by construction (conformal), so coverage here is no evidence; the median error
    of the central estimate and the ranges' widths are. The held-out runs' figures are
    chapter 16's appendix's to print: no test pins them."""
    estimates = calibration_estimates()
    summary = P.calibration_targets(estimates)
    with capsys.disabled():
        print({key: round(value, 3) for key, value in summary.items()})
    assert summary["coverage"] >= P.MARGIN_COVERAGE
    assert summary["median error"] <= P.CALIBRATION_TARGETS["median error"]
    assert summary["within 1.35"] == 1.0  # every run whose software documents its overlap
    assert summary["fits"] == 1.0


def test_the_margin_is_the_conformal_margin_of_the_fit_runs():
    unwidened = [dataclasses.replace(e, margin=0.0) for e in calibration_estimates()]
    assert P.MODEL_MARGIN == P.conformal_margin(unwidened) == P.model_margin()
    # ceil(33 x 0.9) = 30th smallest of 32 scores: exactly two fit runs stay outside.
    outside = [
        e for e in calibration_estimates() if not e.mfu_low <= P.reported_mfu(e.run) <= e.mfu_high
    ]
    assert len(outside) <= 32 - 30


def _fake(span: tuple[float, float], published: float) -> P.RunEstimate:
    """An estimate of GPT 1.7B on 32 A100s with the given span, its step time set so that
    its published MFU is ``published``."""
    run = P.published_runs()[0]
    seconds = run.step_seconds * P.reported_mfu(run) / published
    run = dataclasses.replace(run, step_seconds=seconds)
    layout = P.evaluate(P.published_model(run), P.published_cluster(run), 512, 1, 1, 32)
    return P.RunEstimate(run, layout, 0.3, *span, 0.0, 1.0, True, None)


def test_conformal_margin_by_hand():
    # Scores max(low / p, p / high) - 1: 0.4 / 0.5 - 1 < 0 (inside), 0.5 / 0.4 - 1 = 0.25,
    # 0.55 / 0.5 - 1 = 0.1, 0.6 / 0.5 - 1 = 0.2 ... nine runs; at coverage 0.8 the
    # ceil(10 x 0.8) = 8th smallest score is the margin.
    spans = [(0.4, 0.6)] * 5 + [(0.55, 0.6), (0.6, 0.7), (0.2, 0.4), (0.2, 0.3)]
    estimates = [_fake(span, 0.5) for span in spans]
    # scores: -0.167 x 5, 0.1, 0.2, 0.25, 0.667 -> 8th smallest is 0.25
    assert P.conformal_margin(estimates, coverage=0.8) == pytest.approx(0.25)
    assert P.conformal_margin(estimates[:5], coverage=0.5) == 0.0  # all inside: no widening
    with pytest.raises(ValueError, match="coverage"):
        P.conformal_margin(estimates, coverage=0.95)  # ceil(10 x 0.95) = 10 > 9 runs
    with pytest.raises(ValueError, match="estimates"):
        P.conformal_margin([])
    with pytest.raises(ValueError, match="coverage"):
        P.conformal_margin(estimates, coverage=1.5)


def test_a_range_is_the_unknowns_span_widened_by_the_margin():
    e = P.estimate_run(P.published_runs()[0], rank=False)
    assert e.mfu_low == pytest.approx(e.span_low / (1 + P.MODEL_MARGIN))
    assert e.mfu_high == pytest.approx(e.span_high * (1 + P.MODEL_MARGIN))
    assert e.span_low <= e.mfu <= e.span_high
    bare = P.estimate_run(P.published_runs()[0], margin=0.0, rank=False)
    assert (bare.mfu_low, bare.mfu_high) == (e.span_low, e.span_high)
    with pytest.raises(ValueError, match="margin"):
        P.estimate_run(P.published_runs()[0], margin=-0.1, rank=False)


def test_at_table_4s_own_layer_every_corner_gives_the_measured_time():
    # The unknowns Table 4 ties (traffic, tile overhead) move with the share read at each:
    # at the measured layer the corners agree to the bisection's rounding.
    for corners in P.range_corners():
        for u in corners:
            share = P.gemm_share(u.tile_overhead, u.traffic)
            total = sum(P.table4_seconds(share, u.tile_overhead, u.traffic).values())
            assert total == pytest.approx(sum(P.TABLE4_SECONDS.values()), rel=1e-3)


def test_every_range_over_1_35_is_an_overlap_no_source_documents():
    """The fit runs whose range exceeds 1.35 (ZeRO-3 under DeepSpeed) are those whose
    software's overlap of communication with compute is not published: with the overlap
    pinned at any value their range is within 1.35, so the width is that unknown."""
    wide = []
    for e in calibration_estimates():
        run = e.run
        if e.mfu_high / e.mfu_low > 1.35:
            wide.append(run.name)
            assert run.software.overlap_shares(run.pp, run.zero_stage) == (None, None)
            for overlap in (0.0, 1.0):
                pinned = P.estimate_run(run, overlap=overlap, rank=False)
                assert pinned.mfu_high / pinned.mfu_low <= 1.35, (run.name, overlap)
    assert wide and all("ZeRO-3" in name for name in wide)


def test_gemm_share_is_read_off_table_4_at_each_setting_of_the_unknowns():
    measured = sum(P.TABLE4_SECONDS.values())
    for traffic in (2.0, 3.0, 4.0):
        for overhead in (0.0, 1.0):
            share = P.gemm_share(overhead, traffic)
            total = sum(P.table4_seconds(share, overhead, traffic).values())
            assert total == pytest.approx(measured, rel=1e-3)
    # More element-wise traffic leaves less time to the GEMMs, which must run faster;
    # so does a tile write the kernel waits for.
    assert P.gemm_share(0.0, 2.0) < P.gemm_share(0.0, 4.0) < P.gemm_share(1.0, 4.0)
    # At no corner does the model make an A100 GEMM faster than the fastest one measured:
    # the measured maximum's own shape (1024 x 10240 x 5120) and a large square one.
    a100 = P.GPUS[P.TABLE4_GPU]
    for corners in P.range_corners():
        for u in corners:
            share = P.gemm_share(u.tile_overhead, u.traffic)
            for m, n, k in ((1024, 10240, 5120), (16384, 16384, 16384)):
                seconds = P.gemm_seconds(
                    m, k, n, a100.peak_flops, a100.memory_bandwidth, share, 1, 108, u.tile_overhead
                )
                assert 2 * m * n * k / seconds / a100.peak_flops < a100.max_matmul_share
    # Pinned (a change to the layer model or to Table 4 must show here).
    assert P.GEMM_SHARE == P.gemm_share(1.0, 3.0) == 0.6732
    assert (P.gemm_share(0.0, 2.0), P.gemm_share(0.0, 4.0)) == (0.6222, 0.6743)
    assert (P.gemm_share(1.0, 2.0), P.gemm_share(1.0, 4.0)) == (0.6466, 0.702)
    # Read apart, the halves want different shares: the model's error at its own layer.
    assert P.table4_half_shares() == {"forward": 0.6236, "backward": 0.7002}
    # Never faster than the layer's FLOPs at full peak: 24 b s h^2 / t for its matrices
    # and 4 b s^2 h / t for attention's products, forward; twice that backward.
    b, s, h, t = 4, 2048, 6144, 8
    flops = (24 * b * s * h**2 + 4 * b * s**2 * h) / t
    at_peak = P.table4_seconds(1.0, 0.0)
    assert at_peak["forward"] > flops / 312e12 and at_peak["backward"] > 2 * flops / 312e12
    with pytest.raises(ValueError, match="overhead"):
        P.gemm_share(-1.0)
    with pytest.raises(ValueError, match="overhead"):
        P.gemm_share(9.0)  # Table 4's layer would need more than the peak
    with pytest.raises(ValueError, match="traffic"):
        P.gemm_share(1.0, 0.0)
    with pytest.raises(ValueError, match="overhead"):
        P.table4_seconds(0.7, overhead=-1.0)
    with pytest.raises(ValueError, match="share"):
        P.table4_seconds(1.5)


def test_the_share_moves_to_another_gpu_by_its_fastest_measured_gemm():
    h100 = P.Cluster(nodes=1, **P.H100_NODE)
    a100 = P.Cluster(nodes=1, **P.A100_NODE)
    ratio = P.GPUS["H100-80GB"].max_matmul_share / P.GPUS["A100-80GB"].max_matmul_share
    assert _rates(h100)[0] == pytest.approx(P.GEMM_SHARE * ratio)
    assert _rates(a100)[0] == P.GEMM_SHARE
    unmeasured = P.Cluster(nodes=1, **P.node_settings("RTX 4090", 32e9))
    assert unmeasured.max_matmul_share is None and unmeasured.attention_share is None
    assert _rates(unmeasured) == (P.GEMM_SHARE, P.GEMM_SHARE * 165.2e12)  # attention: GEMMs'
    with pytest.raises(ValueError, match="max_matmul_share"):
        P.Cluster(nodes=1, **{**P.H100_NODE, "max_matmul_share": 1.5})


def test_a_power_limited_gpu_and_the_attention_kernel_span_their_measured_ranges():
    # torchtitan's 500 W H100: its peak between the H100 NVL's 835 and the SXM's 989
    # TFLOP/s; a fused attention kernel between FlashAttention-2's 35 % and -3's 75 %.
    capped = P.Cluster(nodes=1, **P.node_settings("H100-96GB-500W", 50e9))
    h100 = P.Cluster(nodes=1, **P.H100_NODE)
    low, high = P.Unknowns(peak="low", attention="low"), P.Unknowns(peak="high", attention="high")
    assert _rates(capped, high) == pytest.approx(_rates(h100, high))
    share, attention = _rates(capped, low)
    assert share == pytest.approx(_rates(h100, low)[0] * 835 / 989)
    assert attention == pytest.approx(0.35 * 835e12)
    assert _rates(h100, high)[1] == pytest.approx(0.75 * 989e12)
    middle = _rates(capped)  # the geometric middle of each span
    assert middle[1] == pytest.approx((0.35 * 0.75) ** 0.5 * (835e12 * 989e12) ** 0.5)
    with pytest.raises(ValueError, match="peak_flops_low"):
        P.Cluster(nodes=1, **{**P.H100_NODE, "peak_flops_low": 2e15})
    with pytest.raises(ValueError, match="attention_share"):
        P.Cluster(nodes=1, **{**P.H100_NODE, "attention_share": (0.8, 0.3)})


def _documented(run: P.PublishedRun) -> tuple[float | None, float | None]:
    return run.software.overlap_shares(run.pp, run.zero_stage)


def test_documented_overlap_follows_the_runs_software():
    runs = {run.name: run for run in P.published_runs()}
    # Megatron-LM of April 2021: gradients all-reduced after the backward, synchronous TP.
    assert _documented(runs["GPT 1.7B on 32 A100s"]) == (0.0, 0.0)
    # Megatron-LM of May 2022: the same all-reduce, and the async TP all-reduce.
    assert _documented(runs["GPT 22B on 8 A100s, full recompute"]) == (0.0, 1.0)
    # Narayanan et al.'s ZeRO-3 rows ran DeepSpeed's data parallelism: not documented.
    assert _documented(runs["GPT 174.6B on 384 A100s, ZeRO-3"]) == (None, None)
    # BLOOM's pipeline ran on DeepSpeed's engine: gradients reduced after the flush, one
    # model chunk per GPU, ZeRO 0 or 1; its tensor parallelism's overlap is not documented.
    bloom = runs["BLOOM 176B on 384 A100s"]
    assert _documented(bloom) == (0.0, None)
    choices = _choices(dataclasses.replace(bloom, zero_stage=None))
    assert choices["v"] == (1,) and choices["zero_stages"] == (0, 1)
    assert P.estimate_run(bloom).layout.virtual_stages == 1


def test_the_optimiser_step_by_hand():
    # TP 8 x DP 8 with ZeRO-1: each GPU updates 1/8 of its 1/8 of the 70B parameters,
    # 42 bytes each (gradient norm 4, Adam 16 + 12, copy to 16-bit 4 + 2, zeroing 4) at
    # the HBM rate.
    assert P.OPTIMISER_STEP_BYTES == 42
    lay = P.evaluate(M70, H100, 1024, 8, 1, 8, 1, "full")
    owned = math.ceil(math.ceil(M70.params / 8) / 8)
    assert lay.times["optimiser step"] == pytest.approx(owned * 42 / H100.memory_bandwidth)
    zero0 = P.evaluate(M70, H100, 1024, 8, 1, 8, 0, "full")
    assert zero0.times["optimiser step"] == pytest.approx(8 * lay.times["optimiser step"], rel=1e-6)
    simple = P.evaluate(M70, H100, 1024, 8, 1, 8, 1, "full", efficiency=P.KERNEL_EFFICIENCY)
    assert simple.times["optimiser step"] == 0.0


def test_each_forward_gemm_has_two_gradient_gemms_at_their_own_shapes():
    # (m x k) @ (k x n) forward; backward (m x n) @ (n x k) for the input and
    # (k x m) @ (m x n) for the weight: with a short k the forward pays the tiles'
    # fixed cost on little work, the weight gradient (k = m) does not.
    gemm = functools.partial(
        P.gemm_seconds, peak_flops=1e15, bandwidth=3.35e12, share=0.5, multiprocessors=128
    )
    forward, backward = _forward_and_backward(gemm, 8192, 1024, 8192)
    assert forward == gemm(8192, 1024, 8192)
    assert backward == gemm(8192, 8192, 1024) + gemm(1024, 8192, 8192)
    k0 = 0.5e15 / 3.35e12
    assert forward == pytest.approx(2 * 8192**2 * (1024 + k0) / 0.5e15)
    assert backward < 2 * forward  # the gradients' long k amortise the fixed cost


def test_a_fused_attention_backward_takes_two_and_a_half_forwards():
    # 4 (sequence, head) pairs, 1,024 queries against 4,096 keys of dimension 128:
    # 2 x 2 x 1024 x 4096 x 128 FLOPs each, half of them past the causal diagonal, at
    # 1e15 FLOP/s; the backward's five products for the forward's two.
    forward, backward = _fused_attention_seconds(4, 1024, 4096, 128, 1e15)
    assert forward == pytest.approx(4 * 2 * 2 * 1024 * 4096 * 128 * 0.5 / 1e15)
    assert backward == pytest.approx(5 / 2 * forward)
    # The layer's score part is the kernel's forward (Llama 3 8B at 131K, TP 8: 4 heads),
    # at the attention rate of _rates.
    _, rate = _rates(TWO_NODES, P.CENTRAL)
    _, scores, _ = _layer_times(LONG_8B, TWO_NODES, 8, 1, True)
    assert scores == pytest.approx(_fused_attention_seconds(4, 131072, 131072, 128, rate)[0])


def test_the_last_stage_sets_the_pace_with_its_own_layers():
    # BLOOM: 70 layers on 12 stages of 6 slots leave 2 short, so the last stage holds 5
    # layers and the output layer (250,880 x 14,336 over TP 4: more than a layer's
    # work). It is the slower stage, and it recomputes its own 5 layers, not 6.
    run = next(r for r in P.published_runs() if r.name.startswith("BLOOM"))
    model, cluster = P.published_model(run), P.published_cluster(run)
    layer, _, layer_back = _layer_times(model, cluster, 4, 2, False)
    fwd, bwd, rec = _roofline(model, cluster, 4, 2, 6, "full", False, ends_short=2)
    assert rec == pytest.approx(5 * layer)
    assert fwd > 6 * layer and bwd > 6 * layer_back  # the output layer outweighs a layer
    # With no slot short the last stage holds all 6 and the output layer.
    fwd6, _, rec6 = _roofline(model, cluster, 4, 2, 6, "full", False, ends_short=0)
    assert rec6 == pytest.approx(6 * layer) and fwd6 == pytest.approx(fwd + layer)


def test_a_published_utilisation_restated_as_a_run():
    # Korthikanti et al.'s 530B with full recomputation on 2,240 GPUs: 41.4 % of peak in
    # 6N (chapter 15), so the step is 6 N x 2,240 x 2,048 / (2,240 x 312e12 x 0.414).
    use = next(u for u in compute.PUBLISHED_UTILISATION if u.name.endswith("full recompute"))
    base = next(r for r in P.published_runs() if r.name.startswith("GPT 530B on 2,240"))
    run = P.restated_run(use, base, recompute="full", sequence_parallel=False)
    assert (run.name, run.gpus, run.recompute) == (use.name, 2240, "full")
    six_n = 6 * base.params * base.global_batch * base.seq_len
    assert run.step_seconds == pytest.approx(six_n / (2240 * 312e12 * use.utilisation("6n")))
    assert P.reported_mfu(run) == pytest.approx(use.utilisation("6n"))
    with pytest.raises(ValueError, match="use"):
        P.restated_run(base, base)
    with pytest.raises(ValueError, match="estimates"):
        P.calibration_targets([])


def test_mfu_range_brackets_the_central_estimate():
    lay = P.evaluate(M70, H100, 1024, 8, 1, 8, 1, "selective")
    low, high = P.mfu_range(M70, H100, lay)
    assert low < lay.mfu < high
    invalid = P.evaluate(M70, H100, 1000, 8, 1, 8, 1, "selective", micro_batch=3)
    with pytest.raises(ValueError, match="layout"):
        P.mfu_range(M70, H100, invalid)
    with pytest.raises(ValueError, match="layout"):
        P.mfu_range(M70, H100, "TP 8")
    with pytest.raises(ValueError, match="overlap"):
        P.estimate_run(P.published_runs()[0], overlap=1.5)


# --- Bad arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"params": -1}, "params"),
        ({"params": 1000}, "params"),  # no room beside the embeddings
        ({"layers": 0}, "layers"),
        ({"hidden": 100, "heads": 3}, "hidden"),
        ({"heads": 0}, "heads"),
        ({"seq_len": 1.5}, "seq_len"),
        ({"vocab": True}, "vocab"),
        ({"tied_embeddings": 1}, "tied_embeddings"),
    ],
)
def test_bad_model_arguments_are_named(kwargs, name):
    args = {"params": 1e9, "layers": 8, "hidden": 1024, "heads": 8, "seq_len": 512, "vocab": 1000}
    with pytest.raises(ValueError, match=name):
        P.Model(**(args | kwargs))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("nodes", 0),
        ("gpus_per_node", 2.5),
        ("memory_bytes", 0),
        ("peak_flops", math.inf),
        ("intra_node_bandwidth", -1),
        ("inter_node_bandwidth", "fast"),
        ("memory_bandwidth", 0),
        ("multiprocessors", 0),
    ],
)
def test_bad_cluster_arguments_are_named(field, value):
    args = {"nodes": 1, "gpus_per_node": 8} | P.H100_NODE | {field: value}
    with pytest.raises(ValueError, match=field):
        P.Cluster(**args)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"global_batch": 0}, "global_batch"),
        ({"micro_batches": ()}, "micro_batches"),
        ({"micro_batches": [0]}, "micro_batches"),
        ({"micro_batches": 4}, "micro_batches"),
        ({"zero_stages": [4]}, "zero_stages"),
        ({"recompute": ["partial"]}, "recompute"),
        ({"recompute": "full"}, "recompute"),  # a string, not a sequence of modes
        ({"sequence_parallel": "yes"}, "sequence_parallel"),
        ({"virtual_stages": 0}, "virtual_stages"),
        ({"efficiency": 1.5}, "efficiency"),
        ({"usable_memory": 0}, "usable_memory"),
        ({"max_bubble": -0.1}, "max_bubble"),
        ({"model": "70B"}, "model"),
        ({"cluster": None}, "cluster"),
    ],
)
def test_bad_plan_arguments_are_named(kwargs, name):
    args = {"model": SMALL, "cluster": _bare(), "global_batch": 8} | kwargs
    with pytest.raises(ValueError, match=name):
        P.plan(**args)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"tp": 3}, "tp x pp x dp"),
        ({"zero_stage": 4}, "zero_stage"),
        ({"recompute": "some"}, "recompute"),
        ({"micro_batch": 0}, "micro_batch"),
        ({"dp": -1}, "dp"),
    ],
)
def test_bad_evaluate_arguments_are_named(kwargs, name):
    args = {"tp": 1, "pp": 1, "dp": 4} | kwargs
    with pytest.raises(ValueError, match=name):
        P.evaluate(SMALL, _bare(), 8, **args)


def test_invalid_layouts_say_why():
    layout = P.evaluate(SMALL, _bare(), 6, 1, 1, 4)  # 6 sequences over DP 4
    assert layout.verdict == "invalid" and "DP 4 does not divide" in layout.notes[0]
    layout = P.evaluate(SMALL, _bare(), 8, 1, 1, 4, micro_batch=3)
    assert "micro-batch 3 does not divide the 2 sequences" in layout.notes[0]
    odd = P.Model(params=1.2e9, layers=2, hidden=1020, heads=3, seq_len=256, vocab=1000)
    layout = P.evaluate(odd, _bare(), 8, 4, 1, 1)
    assert "TP 4 does not divide the 3" in layout.notes[0]
    assert layout.problems == ("invalid", "TP across nodes")  # 4 GPUs per group, 2 per node
    layout = P.evaluate(odd, _bare(), 8, 1, 4, 1, virtual_stages=2)  # 8 > 2 layers + 2 ends
    assert "8 pipeline chunks for 2 layers" in layout.notes[0]


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: P.stage_params(M70, 1, 83), "pp x virtual_stages"),  # > 80 layers + 2
        (lambda: P.stage_params("70B", 1, 1), "model"),
        (lambda: P.model_state_per_gpu(M70, 8, 4, 2, 5), "zero_stage"),
        (lambda: P.activation_bytes_per_gpu(M70, 8, 4, 1, 0), "micro_batches"),
        (lambda: P.top_layouts([], 0), "count"),
        (lambda: P.reported_mfu_6n({"model": M70}), "run"),
        (lambda: P.estimate_run({}), "run"),
        (lambda: P.reported_mfu(None), "run"),
        (lambda: P.Model(1e9, 8, 1024, 8, 512, 1000, kv_heads=0), "kv_heads"),
        (lambda: P.Model(1e9, 8, 1024, 8, 512, 1000, fused_attention=1), "fused_attention"),
        (lambda: P.plan(M70, H100, 64, efficiency=2.0), "efficiency"),
        (lambda: P.node_settings("V100", 25e9), "gpu"),
    ],
)
def test_bad_helper_arguments_are_named(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_traffic_uses_chapter_04s_ring(tp):
    # 4 all-reduces of 2 s b h bytes per layer and micro-batch, ring_factor(t) of each sent.
    layout = P.evaluate(
        M70, H100, BATCH, tp, 1, 64 // tp, 1, "none", 1, efficiency=SIMPLE, sequence_parallel=False
    )
    per_layer = 4 * collectives.ring_factor(tp) * 2 * SBH_70B / 450e9
    assert layout.times["tensor-parallel traffic"] == pytest.approx(
        layout.accumulation * 80 * per_layer, rel=1e-12
    )


# --- Round 2: layer shape, balanced ends, ZeRO-3 prefetch, zero-bubble schedule -------------


def test_the_planner_passes_the_models_layer_shape_to_chapter_09s_table():
    llama = P.Model(
        params=8e9, layers=32, hidden=4096, heads=32, seq_len=8192, vocab=128000,
        kv_heads=8, ffn_hidden=14336, gated_mlp=True, dropout=False,
    )  # fmt: skip
    # s b h = 8192 x 4096; per token 2 + 2 + 2 x 8/32 x 2 ... by the table's rows:
    # norm out 2, Q 2, K 0.5, V 0.5, proj in 2, norm out 2, gate+up 2 x 2 x 3.5 = 14,
    # product 7, norm inputs 4 = 34 sbh, plus the row statistic 4 a s b; SP over TP 8.
    sbh = 8192 * 4096
    per_layer = (34 * sbh + 4 * 32 * 8192) / 8
    assert P.layer_activation_bytes(8192, 1, 4096, 32, 8, True, **llama.layer_shape) == per_layer
    # PP 1: every layer once, the logits and the last norm's inputs, no dropout masks.
    got = P.activation_bytes_per_gpu(llama, 8, 1, 1, 1, "none", True)
    assert got == 32 * per_layer + 4 * sbh / 8 + 4 * 8192 * 128000 / 8


def test_the_embedding_and_output_layer_may_take_a_chunk_each():
    # 6 layers over PP 4 x 2 chunks = 8 slots: the first chunk holds only the embedding
    # and the last only the output layer, as Llama 3 balanced its pipeline.
    small = P.Model(params=2e8, layers=6, hidden=512, heads=8, seq_len=256, vocab=1000)
    assert P.stage_params(small, 1, 4, 2) > 0
    with pytest.raises(ValueError, match="layers \\+ 2"):
        P.stage_params(small, 1, 4, 3)  # 12 chunks > 6 + 2


def test_zero3_prefetch_exposes_only_what_outlasts_each_layer():
    # 4 layers, 1,000 parameters per GPU over 2 GPUs at 1 byte/s: a gather sends
    # 2 x 1,000 x 1/2 = 1,000 bytes, 250 s per layer; a reduce-scatter the same.
    exposed = _zero3_prefetch(1000, 2, "none", 4, 1.0, forward=400.0, backward=1600.0)
    # forward: first gather 250 + 3 x max(0, 250 - 100) = 700; backward: first gather
    # 250 + 3 x max(0, 250 + 250 - 400) + last reduce-scatter 250 = 800.
    assert exposed == 700 + 800
    # Enough compute hides every gather but the first and the last reduce-scatter.
    assert _zero3_prefetch(1000, 2, "none", 4, 1.0, 4000.0, 8000.0) == 250 + 250 + 250


def test_zero_bubble_schedule_idles_less_than_1f1b():
    args = (P.EXAMPLE_MODEL, P.EXAMPLE_CLUSTER, 64, 8, 4, 2, 1, "selective", 1)
    one_f_one_b = P.evaluate(*args)
    zero_bubble = P.evaluate(*args, schedule="zb-h1")
    m = one_f_one_b.accumulation
    assert m == 32 and 0 < one_f_one_b.bubble <= 3 / 35  # (p-1)/(m+p-1) of the pipeline's time
    assert zero_bubble.bubble < one_f_one_b.bubble / 2
    assert zero_bubble.memory_bytes == one_f_one_b.memory_bytes
    interleaved = P.evaluate(*args, virtual_stages=2, schedule="zb-h1")
    assert interleaved.verdict == "invalid" and "ZB-H1" in interleaved.notes[0]
    with pytest.raises(ValueError, match="schedule"):
        P.evaluate(*args, schedule="zb-v")


def test_fp32_gradients_double_the_gradient_bytes_in_memory_and_on_the_wire():
    args = (P.EXAMPLE_MODEL, P.EXAMPLE_CLUSTER, 64, 8, 4, 2, 0, "selective", 1)
    fp32_stack = P.DEFAULT_SOFTWARE.replace(gradient_reduce_dtype="fp32")
    bf16, fp32 = P.evaluate(*args), P.evaluate(*args, software=fp32_stack)
    assert fp32.memory_parts["gradients"] == 2 * bf16.memory_parts["gradients"]
    assert fp32.memory_parts["weights"] == bf16.memory_parts["weights"]
    # 1,000 parameters over 2 GPUs at 1 byte/s: a ring all-reduce sends 2 x (1/2) x 1,000
    # values, 4,000 bytes in fp32 (2,000 in bf16), all exposed with no compute to hide under.
    assert _data_parallel_seconds(1000, 2, 0, 1.0, 0.0, 0.0, 4) == (0.0, 4000.0)
    assert _data_parallel_seconds(1000, 2, 0, 1.0, 0.0, 0.0, 2) == (0.0, 2000.0)


def test_zero2_reduce_scatter_hides_under_the_next_micro_batch_too():
    # 1,000 parameters over 2 GPUs at 1 byte/s: the reduce-scatter and the all-gather
    # each send 1,000 bytes (1,000 s). Forward 100 s, backward 300 s.
    # One micro-batch: the reduce-scatter has the backward only (700 exposed), the
    # all-gather of updated weights the next forward (900, once per step).
    assert _data_parallel_seconds(1000, 2, 2, 1.0, 100.0, 300.0, 2, 1) == (700.0, 900.0)
    # Many: all but the last reduce-scatter run under the next forward too (600 each);
    # the last exposes 100 more, once, beside the all-gather's 900.
    assert _data_parallel_seconds(1000, 2, 2, 1.0, 100.0, 300.0, 2, 8) == (600.0, 1000.0)


# --- Context and expert parallelism (chapters 10 and 11) -------------------------------------

LONG_8B = P.LONG_CONTEXT_MODEL  # Llama 3 8B's shape at 131,072 tokens
MIXTRAL = P.MOE_MODEL  # Mixtral 8x7B's shape: 8 SwiGLU experts of width 14,336, top-2
TWO_NODES = P.Cluster(nodes=2, **P.H100_NODE)


def test_cp_degrees_are_every_power_of_two_the_cost_model_can_rank():
    # Powers of two c with 2c equal chunks of at least 1,024 tokens per rank, up to the
    # GPUs: 131,072 tokens allow c = 128 on 128 GPUs (1,024 each) but the two nodes
    # stop it at 16; 4,096 tokens stop at 4 (1,024 each); 2,048 at 2.
    assert P.CP_MIN_LOCAL_TOKENS == 1024
    big = P.Cluster(nodes=16, **P.H100_NODE)
    assert P.context_parallel_degrees(LONG_8B, big) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert P.context_parallel_degrees(LONG_8B, TWO_NODES) == (1, 2, 4, 8, 16)
    assert P.context_parallel_degrees(M70, H100) == (1, 2, 4)
    short = dataclasses.replace(M70, seq_len=2048)
    assert P.context_parallel_degrees(short, H100) == (1, 2)
    # An unfused kernel stores the s x s scores, which no ring can split: CP 1 only.
    unfused = dataclasses.replace(LONG_8B, fused_attention=False)
    assert P.context_parallel_degrees(unfused, TWO_NODES) == (1,)


def test_a_128k_token_model_picks_context_parallelism():
    best = P.top_layouts(P.plan(LONG_8B, TWO_NODES, 8), 1)[0]
    assert best.cp > 1 and best.gpus == 16 and "CP" in best.name


def test_ring_attention_traffic_by_hand():
    # TP 8 x CP 2 on two nodes: the ring crosses the network (50e9 B/s). Per layer and
    # micro-batch one rank sends 2 (c-1) B forward and (2 (c-1) + 2 c) B backward, with
    # B = 65,536 tokens x 128 (one key-value head per TP rank) x 2 bytes; half of it
    # hides (OVERLAP's central 0.5, the attention lasts longer than the transfer).
    lay = P.evaluate(LONG_8B, TWO_NODES, 8, 8, 1, 1, 1, "none", context_parallel=2)
    block = 65536 * 128 * 2
    assert block == context.kv_block_bytes(65536, 128)
    hand = 8 * 32 * 0.5 * (2 + 6) * block / 50e9  # 8 micro-batches, 32 layers
    assert lay.times["context-parallel traffic"] == pytest.approx(hand, rel=1e-12)
    assert lay.times["expert-parallel traffic"] == 0.0
    # every term per GPU shrinks with the sequence split
    assert lay.memory_parts["activations"] == pytest.approx(
        P.activation_bytes_per_gpu(LONG_8B, 8, 1, 1, 8, "none", context_parallel=2)
    )


def test_moe_parameters_by_hand():
    per_layer = 8 * 3 * 4096 * 14336  # 8 SwiGLU experts
    assert MIXTRAL.expert_params_per_layer == per_layer == 1_409_286_144
    assert MIXTRAL.active_params == 46_702_792_704 - 32 * per_layer * 6 // 8 == 12_879_925_248
    assert P.EXAMPLE_MODEL.active_params == P.EXAMPLE_MODEL.params
    lay = P.evaluate(MIXTRAL, H100, 1024, 1, 1, 64, 0, "none", expert_parallel=8)
    dense = 46_702_792_704 - 32 * per_layer
    assert lay.memory_parts["weights"] == 2 * (dense + 32 * per_layer // 8)


def test_an_moe_model_picks_expert_parallelism_and_its_all_to_alls_are_chapter_15s():
    best = P.top_layouts(P.plan(MIXTRAL, H100, 1024), 1)[0]
    assert best.ep > 1 and f"EP {best.ep}" in best.settings
    m = best.accumulation
    tokens = best.micro_batch * 4096 / best.tp
    link = 450e9 if 8 % (best.tp * best.ep) == 0 else 50e9
    each = tokens * 4096 * 2 * (best.ep - 1) / best.ep * 2  # top-2, 16-bit
    assert each == pytest.approx(experts.all_to_all_bytes_per_rank(tokens, 4096, 2, best.ep))
    count = 4 + (2 if best.recompute == "full" else 0)
    hand = m * 32 * count * each / link
    assert best.times["expert-parallel traffic"] == pytest.approx(hand, rel=1e-12)


def test_layouts_of_tp1_pp1_dp64_ep8_by_hand():
    # 16 micro-batches of 4,096 tokens; each all-to-all sends 4096 x 4096 x 2 x 7/8 x 2 bytes
    # over NVLink (450e9 B/s), four per layer, 32 layers.
    lay = P.evaluate(MIXTRAL, H100, 1024, 1, 1, 64, 1, "none", expert_parallel=8)
    hand = 16 * 32 * 4 * (4096 * 4096 * 2 * 7 / 8 * 2) / 450e9
    assert lay.times["expert-parallel traffic"] == pytest.approx(hand, rel=1e-12)
    assert lay.times["context-parallel traffic"] == 0.0


def test_cp_and_ep_that_cannot_work_are_invalid_and_say_why():
    unfused = dataclasses.replace(LONG_8B, fused_attention=False)
    lay = P.evaluate(unfused, TWO_NODES, 8, 8, 1, 1, 1, "none", context_parallel=2)
    assert lay.verdict == "invalid" and any("fused" in note for note in lay.notes)
    lay = P.evaluate(M70, H100, 64, 8, 1, 8, 1, "none", expert_parallel=2)
    assert lay.verdict == "invalid" and any("experts" in note for note in lay.notes)
    lay = P.evaluate(MIXTRAL, H100, 1024, 8, 1, 8, 1, "none", expert_parallel=16)
    assert lay.verdict == "invalid" and any("DP 8" in note for note in lay.notes)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: dataclasses.replace(MIXTRAL, top_k=9), "top_k"),
        (lambda: dataclasses.replace(MIXTRAL, experts=0), "experts"),
        (lambda: dataclasses.replace(MIXTRAL, params=10**9), "params"),
        (lambda: P.evaluate(M70, H100, 64, 8, 4, 2, context_parallel=0), "context_parallel"),
        (lambda: P.evaluate(M70, H100, 64, 8, 4, 2, expert_parallel=0), "expert_parallel"),
        (lambda: P.evaluate(M70, H100, 64, 8, 4, 2, context_parallel=2), "context_parallel"),
        (lambda: P.plan(M70, H100, 64, context_parallel=[]), "context_parallel"),
        (lambda: P.plan(M70, H100, 64, expert_parallel=[0]), "expert_parallel"),
        (lambda: P.context_parallel_degrees(M70, "H100"), "cluster"),
        (lambda: P.expert_parallel_degrees("M70"), "model"),
        (lambda: P.activation_bytes_per_gpu(M70, 8, 4, 1, 8, context_parallel=3), "context"),
    ],
)
def test_bad_cp_and_ep_arguments_are_named(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_expert_and_tensor_parallelism_need_sequence_parallelism():
    lay = P.evaluate(
        MIXTRAL, H100, 1024, 2, 1, 32, 1, "none", expert_parallel=4, sequence_parallel=False
    )
    assert lay.verdict == "invalid" and any("sequence parallelism" in n for n in lay.notes)


def test_a_fused_causal_kernel_computes_half_the_scores_and_cp_splits_them():
    # FlashAttention skips the key blocks past the diagonal (context.CAUSAL_WORK_SHARE):
    # per (sequence, head) pair 2 products x 2 s^2 d FLOPs x 1/2, at the H100's central
    # fused-attention share, the geometric middle of FlashAttention-2's 35 % and
    # FlashAttention-3's 75 %: sqrt(0.35 x 0.75) = 0.5123 of 989e12 FLOP/s. Llama 3 8B's
    # shape at 131,072 tokens, TP 8: 32 / 8 = 4 heads of 128 per GPU.
    _, scores, _ = _layer_times(LONG_8B, TWO_NODES, 8, 1, True)
    hand = 4 * 2 * 2 * 131072**2 * 128 * 0.5 / (math.sqrt(0.35 * 0.75) * 989e12)
    assert scores == pytest.approx(hand, rel=1e-12)
    _, split, _ = _layer_times(LONG_8B, TWO_NODES, 8, 1, True, P.CENTRAL, 4)
    assert split == pytest.approx(hand / 4, rel=1e-12)


def test_zero_shards_the_experts_over_the_ranks_that_hold_the_same_ones():
    # ZeRO-1 on DP 64 with EP 8: the dense parameters' optimiser state (12 bytes each)
    # is sharded 64 ways, the 8 / 8 = 1 expert per GPU's only 64 / 8 = 8 ways.
    lay = P.evaluate(MIXTRAL, H100, 1024, 1, 1, 64, 1, "none", expert_parallel=8)
    dense = 46_702_792_704 - 32 * 1_409_286_144
    experts_per_gpu = 32 * 1_409_286_144 // 8
    hand = 12 * (-(-dense // 64) + -(-experts_per_gpu // 8))
    assert lay.memory_parts["optimiser state"] == hand


def test_a_published_shape_ranks_where_the_search_puts_it():
    # torchtitan's Llama 3.1 8B on 8 H100s: TP 1 x PP 1 x DP 8, first at its own CP degree
    # and still first when CP is searched too (8,192 tokens: CP 2 and 4 are tried)
    name = "Llama 3.1 8B on 8 H100s (torchtitan FSDP)"
    run = next(r for r in P.published_runs() if r.name == name)
    model, cluster = P.published_model(run), P.published_cluster(run)
    assert P.context_parallel_degrees(model, cluster, run.software) != (1,)
    assert P.shape_rank(run) == 1
    assert P.ranked_search(run)[0].shape == (run.tp, run.pp, run.dp)
    assert P.shape_rank(run, search_context_parallel=True) == 1
    # a shape that breaks a rule ranks nowhere: DP 8 cannot split a batch of 4 sequences
    assert P.shape_rank(dataclasses.replace(run, global_batch=4)) is None
