"""planner: memory, step time and ranking of TP x PP x DP layouts against hand-worked numbers."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainscale import checkpointing, collectives, sharding
from trainscale import planner as P
from trainscale.compute import training_seconds
from trainscale.memory import model_state_bytes

# The hand-worked numbers below take a batch of 64 sequences (the chapter's example now
# takes P.EXAMPLE_GLOBAL_BATCH, 1,024; nbval and tests/test_main.py check what it prints).
M70, H100, BATCH = P.EXAMPLE_MODEL, P.EXAMPLE_CLUSTER, 64
SBH_70B = 4096 * 8192  # s * h for one sequence of the worked example
RATE = 989e12 * 0.6  # the H100's FLOP/s at the default kernel efficiency


@pytest.fixture(scope="module")
def layouts_70b():
    return P.plan(M70, H100, BATCH)


# --- Korthikanti et al.: activations of one transformer layer (chapter 09's table) ------------


def test_the_planner_counts_activations_with_chapter_09s_table():
    assert P.layer_activation_bytes is checkpointing.layer_activation_bytes
    assert P.RECOMPUTE == ("none", "selective", "full")
    # GPT-3 175B, TP 8 with sequence parallelism: sbh(34/t + 5as/(ht)), s b h = 25,165,824.
    assert P.layer_activation_bytes(2048, 1, 12288, 96, 8, True) == 25_165_824 * (34 + 80) / 8


# --- Model state per GPU: chapters 02 and 05 ------------------------------------------


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


def test_70b_activations_on_the_first_stage_of_tp8_pp4():
    per_layer = SBH_70B * 34 / 8  # selective recomputation, sequence parallelism, TP 8
    first = 4 * 20 * per_layer + 4 * SBH_70B / 8  # 4 micro-batches in flight, embedding masks
    last = 20 * per_layer + 4 * SBH_70B / 8 + 4 * 4096 * 32000 / 8  # one in flight, logits
    got = P.activation_bytes_per_gpu(M70, 8, 4, 1, 32, "selective", True)
    assert got == first == max(first, last) == 11_425_284_096


@pytest.mark.parametrize("pp", [2, 4, 8, 16])
def test_1f1b_first_stage_holds_the_whole_models_layers(pp):
    # Korthikanti et al. 4.2.3: p micro-batches in flight x L/p layers = L layers.
    per_layer = P.layer_activation_bytes(4096, 1, 8192, 64, 8, True, "selective")
    extras = pp * SBH_70B / 8
    assert P.activation_bytes_per_gpu(M70, 8, pp, 1, 64, "selective") == 80 * per_layer + extras
    # With fewer micro-batches than stages, only those are in flight.
    assert P.activation_bytes_per_gpu(M70, 8, pp, 1, 1, "selective") < 80 * per_layer


def test_interleaved_schedule_holds_korthikanti_extra_share():
    # v = 2 chunks per GPU, p = 4: L (1 + (p-1)/(p v)) = 80 x 11/8 = 110 layers.
    per_layer = P.layer_activation_bytes(4096, 1, 8192, 64, 8, True, "selective")
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
    layout = P.evaluate(M70, H100, BATCH, 8, 1, 8, 0, "none", 1)
    expected = training_seconds(70e9, BATCH * 4096, 64, 989e12, 0.6)
    assert layout.times["compute"] == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(2.899, abs=1e-3)
    assert layout.times["recomputation"] == 0


def test_full_recomputation_costs_one_more_forward_pass():
    layout = P.evaluate(M70, H100, BATCH, 8, 4, 2, 1, "full", 1)
    assert layout.times["recomputation"] == pytest.approx(layout.times["compute"] / 3)


def test_selective_recomputation_costs_the_attention_scores_again():
    layout = P.evaluate(M70, H100, BATCH, 8, 4, 2, 1, "selective", 1)
    per_micro = 2 * 4096**2 * 8192 * 20 / 8 / RATE  # Q K^T: 2bs^2h FLOPs per layer, 20 layers
    assert layout.times["recomputation"] == pytest.approx(32 * per_micro, rel=1e-12)
    assert layout.times["recomputation"] / layout.times["compute"] == pytest.approx(
        0.0128, abs=1e-4
    )


def test_tensor_parallel_traffic_of_the_worked_example():
    # 32 micro-batches x 20 layers x 4 all-reduces x 2(7/8) x 2sbh bytes over 450 GB/s NVLink.
    layout = P.evaluate(M70, H100, BATCH, 8, 4, 2, 1, "selective", 1)
    expected = 32 * 20 * 4 * 1.75 * 2 * SBH_70B / 450e9
    assert layout.times["tensor-parallel traffic"] == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.668, abs=1e-3)
    full = P.evaluate(M70, H100, BATCH, 8, 4, 2, 1, "full", 1)  # the recomputed forward repeats 2
    assert full.times["tensor-parallel traffic"] == pytest.approx(1.5 * expected, rel=1e-12)


def test_data_parallel_all_reduce_hides_under_the_last_backward():
    # ZeRO-0, DP 2 across nodes: 2 x (1/2) x 2 bytes x 2,203,884,000 parameters at 50 GB/s,
    # minus the backward (and recomputation) of one micro-batch on the stage.
    layout = P.evaluate(M70, H100, BATCH, 8, 4, 2, 0, "selective", 1)
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
    dp = [P.evaluate(SMALL, _bare(), batch, 1, 1, 4, z, "none", 1) for z in range(4)]
    traffic = [lay.times["data-parallel traffic"] for lay in dp]
    m = micro_batches
    assert traffic[1] == pytest.approx(traffic[0], rel=1e-9)
    assert traffic[2] == pytest.approx(traffic[0] * (m + 1) / 2, rel=1e-9)
    assert traffic[3] == pytest.approx(traffic[0] * 3 * m / 2, rel=1e-9)
    # All four move (d-1)/d x 2 bytes per parameter per collective, DP across nodes.
    assert traffic[0] == pytest.approx(2 * 0.75 * 2 * 1.2e9 / 10e9, rel=1e-9)
    # The bytes are chapter 05's, per step of m micro-batches, over the 10 GB/s network.
    for zero, seconds in enumerate(traffic):
        sent = sharding.zero_traffic(1.2e9, 4, zero, micro_batches=m)
        assert seconds == pytest.approx(sum(sent.values()) / 10e9, rel=1e-9)


def test_bubble_share_is_gpipes_formula_without_data_parallelism():
    layout = P.evaluate(M70, H100, BATCH, 8, 8, 1, 0, "selective", 1)  # m = 64
    assert layout.bubble == pytest.approx(7 / (64 + 7), rel=1e-12)
    assert layout.verdict == "fits"
    flagged = P.evaluate(M70, H100, BATCH, 8, 8, 1, 0, "selective", 8)  # m = 8
    assert flagged.bubble == pytest.approx(7 / 15, rel=1e-12)
    assert "bubble too large" in flagged.problems
    interleaved = P.evaluate(M70, H100, BATCH, 8, 8, 1, 0, "selective", 8, virtual_stages=2)
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
    plain = P.plan(M70, H100, BATCH, zero_stages=(0,), micro_batches=(2,))
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
    assert sum(counts.values()) == len(layouts_70b) == 28 * 4 * 3 * 4
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
    between = [lay for lay in layouts_70b if 72e9 < lay.memory_bytes <= usable]
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
        {(lay.shape, lay.zero_stage, lay.recompute, lay.micro_batch) for lay in layouts}
    )
    by_setting = {}
    for lay in layouts:
        assert lay.tp * lay.pp * lay.dp == cluster.gpus
        assert ("TP across nodes" in lay.problems) == (cluster.gpus_per_node % lay.tp != 0)
        assert lay.verdict in P.VERDICTS and (lay.verdict == "fits") == (not lay.problems)
        if lay.verdict == "invalid":
            assert math.isnan(lay.step_seconds) and lay.accumulation is None
            continue
        assert lay.effective_batch == batch
        assert 0 < lay.mfu <= P.KERNEL_EFFICIENCY + 1e-12
        assert 0 <= lay.bubble < 1
        by_setting[(lay.shape, lay.recompute, lay.micro_batch, lay.zero_stage)] = lay
    for (shape, mode, b, zero), lay in by_setting.items():
        if zero > 0:  # a higher ZeRO stage never needs more memory
            assert lay.memory_bytes <= by_setting[(shape, mode, b, zero - 1)].memory_bytes
        if mode != "none":  # recomputation never keeps more activations
            keep = by_setting[(shape, P.RECOMPUTE[P.RECOMPUTE.index(mode) - 1], b, zero)]
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
    layouts = P.plan(model, cluster, 16384)
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
    }
    assert P.A100_NODE["peak_flops"] == 312e12 and P.A100_NODE["inter_node_bandwidth"] == 25e9
    assert P.A100_NODE["memory_bytes"] == 80 * 2**30  # 81,920 MiB: exactly 80 GiB


def test_published_runs_become_planner_models_and_clusters():
    runs = P.published_runs()
    assert all(isinstance(run, P.PublishedRun) for run in runs)
    megatron_1t, llama = runs[3], runs[4]
    model = P.published_model(megatron_1t)
    assert model.tied_embeddings and model.embedding_params == 51200 * 25600
    assert (model.params, model.layers, model.hidden, model.heads) == (
        1_008 * 10**9,
        128,
        25600,
        160,
    )
    cluster = P.published_cluster(megatron_1t)
    assert (cluster.nodes, cluster.gpus, cluster.peak_flops) == (384, 3072, 312e12)
    assert cluster.inter_node_bandwidth == 25e9 and cluster.intra_node_bandwidth == 300e9
    assert not P.published_model(llama).tied_embeddings
    assert P.published_cluster(llama).gpus == 8192


def test_megatron_counts_recomputation_so_its_52_percent_is_39_in_6n_terms():
    run = P.published_runs()[3]
    # Equation 3 per token: 96 L h^2 (1 + s/(6h) + V/(16 L h)); 163 of 312 TFLOP/s.
    per_token = 96 * 128 * 25600**2 * (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600))
    assert P.reported_mfu_6n(run) == pytest.approx(163 / 312 * 6 * 1.008e12 / per_token, rel=1e-12)
    assert P.reported_mfu_6n(run) == pytest.approx(0.387, abs=1e-3)


def test_llama3_mfu_adds_the_attention_flops():
    run = P.published_runs()[4]
    six_n = 6 * 405e9
    expected = 430 / 989 * six_n / (six_n + 12 * 126 * 16384 * 8192)
    assert P.reported_mfu_6n(run) == pytest.approx(expected, rel=1e-12)
    assert P.reported_mfu_6n(run) == pytest.approx(0.401, abs=1e-3)


@pytest.mark.parametrize("index", [1, 3, 4])
def test_estimates_for_published_runs_use_their_shape(index):
    run = P.published_runs()[index]
    layout = P.estimate_run(run)
    assert layout.shape == (run.tp, run.pp, run.dp)
    assert layout.recompute == run.recompute
    assert layout.zero_stage == run.zero_stage
    assert 0 < layout.mfu < P.KERNEL_EFFICIENCY


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
    layout = P.evaluate(odd, _bare(), 8, 1, 4, 1)
    assert "4 pipeline chunks for 2 layers" in layout.notes[0]


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: P.stage_params(M70, 1, 81), "pp x virtual_stages"),
        (lambda: P.stage_params("70B", 1, 1), "model"),
        (lambda: P.model_state_per_gpu(M70, 8, 4, 2, 5), "zero_stage"),
        (lambda: P.activation_bytes_per_gpu(M70, 8, 4, 1, 0), "micro_batches"),
        (lambda: P.top_layouts([], 0), "count"),
        (lambda: P.reported_mfu_6n({"model": M70}), "run"),
        (lambda: P.estimate_run({}), "run"),
        (lambda: P.node_settings("V100", 25e9), "gpu"),
    ],
)
def test_bad_helper_arguments_are_named(call, name):
    with pytest.raises(ValueError, match=name):
        call()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_traffic_uses_chapter_04s_ring(tp):
    # 4 all-reduces of 2 s b h bytes per layer and micro-batch, ring_factor(t) of each sent.
    layout = P.evaluate(M70, H100, BATCH, tp, 1, 64 // tp, 1, "none", 1)
    per_layer = 4 * collectives.ring_factor(tp) * 2 * SBH_70B / 450e9
    assert layout.times["tensor-parallel traffic"] == pytest.approx(
        layout.accumulation * 80 * per_layer, rel=1e-12
    )
