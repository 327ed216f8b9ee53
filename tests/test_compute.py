"""compute: 6ND, training time, MFU and the step timeline against hand-worked numbers."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
