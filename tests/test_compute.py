"""compute: 6ND, training time, MFU and the step timeline against hand-worked numbers."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainscale import compute
from trainscale.compute import mfu, step_timeline, training_flops, training_seconds


def test_one_billion_params_on_100b_tokens_is_6e20_flops():
    assert training_flops(1e9, 100e9) == 6 * 10**20


def test_one_billion_on_eight_gpus_takes_187500_seconds():
    seconds = training_seconds(1e9, 100e9, gpus=8, peak_flops=1000e12, mfu=0.4)
    assert seconds == pytest.approx(187_500)
    assert seconds / 86_400 == pytest.approx(2.17, abs=0.01)


def test_3b_exercise_is_about_9_8_days():
    days = training_seconds(3e9, 300e9, gpus=16, peak_flops=1000e12, mfu=0.4) / 86_400
    assert days == pytest.approx(9.77, abs=0.01)


def test_7b_step_of_131072_tokens_takes_1_7_seconds():
    tokens = 8 * 4 * 4096
    assert tokens == 131_072
    # BOOK_SPEC prints 5.5e18 here; 6 * 7e9 * 131072 is 5.5e15 (and 1.72 s follows from that).
    assert training_flops(7e9, tokens) == pytest.approx(5.5e15, rel=0.01)
    assert training_seconds(7e9, tokens, 8, 1000e12, 0.4) == pytest.approx(1.72, abs=0.01)


def test_mfu_of_7b_at_3000_tokens_per_second_is_40_percent():
    assert mfu(3000, 7e9, gpus=1, peak_flops=312e12) == pytest.approx(0.4038, abs=1e-4)


@given(st.integers(0, 10**15), st.integers(0, 10**16))
def test_training_flops_is_exact_for_huge_counts(params, tokens):
    assert training_flops(params, tokens) == 6 * params * tokens


@given(
    st.integers(1, 10**12),
    st.integers(1, 10**13),
    st.integers(1, 100_000),
    st.floats(1e9, 1e16),
    st.floats(0.01, 1.0),
)
def test_mfu_inverts_training_seconds(params, tokens, gpus, peak, utilisation):
    seconds = training_seconds(params, tokens, gpus, peak, utilisation)
    assert mfu(tokens / seconds, params, gpus, peak) == pytest.approx(utilisation, rel=1e-9)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"params": -1}, "params"),
        ({"params": 1.5}, "params"),
        ({"tokens": -5}, "tokens"),
        ({"gpus": 0}, "gpus"),
        ({"peak_flops": 0}, "peak_flops"),
        ({"peak_flops": math.inf}, "peak_flops"),
        ({"mfu": 0}, "mfu"),
        ({"mfu": 1.5}, "mfu"),
    ],
)
def test_training_seconds_names_the_bad_argument(kwargs, name):
    args = {"params": 1e9, "tokens": 1e9, "gpus": 8, "peak_flops": 1e15, "mfu": 0.4} | kwargs
    with pytest.raises(ValueError, match=name):
        training_seconds(**args)


def test_step_timeline_hides_overlapped_communication_under_backward():
    no_overlap = step_timeline(1.0, 2.0, 0.5, 0.1, overlap=0.0)
    full = step_timeline(1.0, 2.0, 0.5, 0.1, overlap=1.0)
    assert [p.name for p in no_overlap] == ["forward", "backward", "all-reduce", "optimiser"]
    assert no_overlap[-1].end == pytest.approx(3.6)
    assert full[2].start == pytest.approx(2.5) and full[2].end == pytest.approx(3.0)
    assert full[-1].end == pytest.approx(3.1)


def test_step_timeline_communication_never_starts_before_backward():
    phases = step_timeline(1.0, 0.2, 5.0, 0.1, overlap=1.0)
    assert phases[2].start == pytest.approx(1.0)
    assert phases[3].start == pytest.approx(6.0)


def test_step_timeline_on_one_gpu_has_no_all_reduce():
    assert [p.name for p in step_timeline(1.0, 2.0, 0.0, 0.1, 0.5)] == [
        "forward",
        "backward",
        "optimiser",
    ]


def test_step_timeline_rejects_bad_overlap():
    with pytest.raises(ValueError, match="overlap"):
        step_timeline(1.0, 2.0, 0.5, 0.1, overlap=1.5)


def test_flops_per_token_conventions_by_hand():
    from trainscale.compute import flops_per_token

    # Llama 3 405B: 126 layers, h = 16,384, s = 8,192; PaLM adds 12 L h s to 6N.
    llama = (405e9, 126, 16384, 8192, 128000)
    assert flops_per_token(*llama, "6n") == 2_430_000_000_000
    assert flops_per_token(*llama, "palm") == 2_430_000_000_000 + 202_937_204_736
    # Megatron 1T: 96 L h^2 (1 + s/(6h) + V/(16 L h)) = 96 x 128 x 25600^2 x 1.0143...
    megatron = flops_per_token(1.008e12, 128, 25600, 2048, 51200, "megatron")
    assert megatron == pytest.approx(8_053_063_680_000 * (1 + 2 / 150 + 1 / 1024), rel=1e-12)
    with pytest.raises(ValueError, match="convention"):
        flops_per_token(*llama, "hardware")


def test_palm_count_is_2_34_times_6n_for_llama3_at_131072_tokens():
    from trainscale.compute import ModelShape, convert_utilisation

    shape = ModelShape(405_000_000_000, 126, 16384, 131072, 128000)
    # 12 L h s = 12 x 126 x 16,384 x 131,072 = 3,246,995,275,776 FLOPs per token.
    assert shape.flops_per_token("palm") == 2_430_000_000_000 + 3_246_995_275_776
    ratio = shape.flops_per_token("palm") / shape.flops_per_token("6n")
    assert ratio == pytest.approx(2.3362, abs=1e-4)
    # Table 4's 380 TFLOP/s of 989 is 38.4 % in PaLM's count, 38.4 / 2.3362 = 16.4 % in 6N.
    assert convert_utilisation(380 / 989, "palm", "6n", shape) == pytest.approx(0.1645, abs=1e-4)


def test_megatron_table_1_smallest_run_is_29_5_percent_in_6n():
    from trainscale.compute import ModelShape, convert_utilisation, megatron_params

    # eq. 2: 12 x 24 x 2304^2 + 13 x 24 x 2304 + (51,200 + 2,048) x 2,304
    n = megatron_params(24, 2304, 2048, 51200)
    assert n == 1_528_823_808 + 718_848 + 122_683_392 == 1_652_226_048
    shape = ModelShape(n, 24, 2304, 2048, 51200)
    # eq. 3 per token: 96 x 24 x 2304^2 x (1 + 2048/13824 + 51200/884736) = 1.4750e10
    assert shape.flops_per_token("megatron") == pytest.approx(1.47504e10, rel=1e-5)
    # 137/312 = 43.9 % as counted; x 6N / eq. 3 = 0.6721 gives 29.5 %.
    assert convert_utilisation(137 / 312, "megatron", "6n", shape) == pytest.approx(
        0.2951, abs=1e-4
    )


def test_hfu_adds_the_recomputed_share_of_the_forward_pass():
    from trainscale.compute import flops_per_token

    # N = 10, L = 1, h = 2, s = 3: 6N = 60, attention 12 x 1 x 2 x 3 = 72, PaLM 132.
    args = (10, 1, 2, 3, 5)
    assert flops_per_token(*args, "palm") == 132
    assert flops_per_token(*args, "hfu", recomputed=0.0) == 132
    # Full recomputation repeats the forward pass, 2N + 4Lhs = 44: 8N + 16Lhs = 176.
    assert flops_per_token(*args, "hfu", recomputed=1.0) == pytest.approx(176)
    assert flops_per_token(*args, "hfu", recomputed=0.5) == pytest.approx(154)
    with pytest.raises(ValueError, match="recomputed"):
        flops_per_token(*args, "hfu", recomputed=1.5)


def test_every_convention_is_documented_and_only_recomputation_is_not_model_work():
    from trainscale.compute import FLOP_CONVENTIONS, FLOPS_CONVENTIONS

    assert FLOPS_CONVENTIONS == ("6n", "palm", "megatron", "hfu")
    assert {k for k, c in FLOP_CONVENTIONS.items() if c.model_flops} == {"6n", "palm"}
    for key, convention in FLOP_CONVENTIONS.items():
        assert convention.key == key
        assert convention.counts and convention.used_by and convention.per_token


@given(
    st.floats(0.01, 1.0),
    st.sampled_from(["6n", "palm", "megatron", "hfu"]),
    st.sampled_from(["6n", "palm", "megatron", "hfu"]),
    st.integers(1, 200),
    st.integers(64, 32768),
    st.integers(128, 1_048_576),
)
def test_converting_there_and_back_returns_the_utilisation(value, a, b, layers, hidden, seq):
    from trainscale.compute import ModelShape, convert_utilisation

    shape = ModelShape(12 * layers * hidden * hidden, layers, hidden, seq, 50_000)
    there = convert_utilisation(value, a, b, shape, recomputed=1.0)
    assert convert_utilisation(there, b, a, shape, recomputed=1.0) == pytest.approx(value)


def test_convert_utilisation_names_its_bad_arguments():
    from trainscale.compute import ModelShape, convert_utilisation

    shape = ModelShape(1_000, 1, 8, 16, 32)
    with pytest.raises(ValueError, match="shape"):
        convert_utilisation(0.4, "6n", "palm", (1_000, 1, 8, 16, 32))
    with pytest.raises(ValueError, match="value"):
        convert_utilisation(0.0, "6n", "palm", shape)
    with pytest.raises(ValueError, match="convention"):
        convert_utilisation(0.4, "6n", "kaplan", shape)
    with pytest.raises(ValueError, match="layers"):
        ModelShape(1_000, 0, 8, 16, 32)


def test_published_utilisations_agree_with_the_planners_step_times():
    from trainscale.compute import PUBLISHED_UTILISATION
    from trainscale.planner import published_runs, reported_mfu_6n

    ours = {r.name: r for r in PUBLISHED_UTILISATION}
    matched = 0
    for run in published_runs():
        if run.name not in ours:  # the planner's calibration set has more rows
            continue
        row = ours[run.name]
        assert row.utilisation("6n") == pytest.approx(reported_mfu_6n(run), rel=5e-3)
        matched += 1
    assert matched == 15


def test_mt_nlg_counted_recomputation_its_step_time_says_so():
    from trainscale.compute import PUBLISHED_UTILISATION

    row = next(r for r in PUBLISHED_UTILISATION if r.name == "MT-NLG 530B on 2,240 A100s")
    # Section 2.4: batch 1,920 x 2,048 tokens in 60.1 s on 2,240 GPUs; 6N per token.
    six_n = 1920 * 2048 / 60.1 / 2240 * 6 * row.shape.params / 312e12
    assert row.utilisation("6n") == pytest.approx(six_n, rel=5e-3)
    assert six_n == pytest.approx(0.298, abs=1e-3)


def test_published_utilisation_rejects_bad_rows():
    from trainscale.compute import ModelShape, PublishedUtilisation

    shape = ModelShape(1_000, 1, 8, 16, 32)
    good = {
        "name": "x",
        "source": "y",
        "convention": "palm",
        "flops_per_gpu": 1e12,
        "peak_flops": 2e12,
        "shape": shape,
        "gpus": 8,
        "kind": "benchmark",
    }
    assert PublishedUtilisation(**good).reported == 0.5
    for field, bad in (("kind", "guess"), ("convention", "?"), ("flops_per_gpu", 3e12)):
        with pytest.raises(ValueError, match=field):
            PublishedUtilisation(**(good | {field: bad}))


def test_utilisation_band_is_the_published_training_runs():
    # Chapter 15's band: MT-NLG on 3,360 GPUs (26.7 % in 6N) to Llama 3 405B's 8K stage
    # on 8,192 GPUs (40.1 %); benchmarks (Megatron-LM's, Korthikanti's) are left out.
    low, high = compute.utilisation_band()
    trained = [
        r.utilisation("6n")
        for r in compute.PUBLISHED_UTILISATION
        if r.kind == "training run" and r.shape.seq_len <= 8192
    ]
    assert (low, high) == (min(trained), max(trained))
    assert round(low, 3) == 0.267 and round(high, 3) == 0.401
    with pytest.raises(ValueError, match="max_seq_len"):
        compute.utilisation_band(1)
