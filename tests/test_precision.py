"""precision: what fp16's range, bf16's precision and fp8 with a scale lose."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale.precision import (
    accumulate_updates,
    amax_scale,
    bit_string,
    delayed_scales,
    float_format,
    fp16_cast_losses,
    quantize,
    relative_error,
    scaled_cast,
)


def test_fp16_boundaries_are_exact():
    tiny = torch.finfo(torch.float16).smallest_normal * 2.0**-10  # smallest subnormal, 2**-24
    assert tiny == 2.0**-24
    values = [2.0**-25, 2.0**-25 * 1.001, 65504.0, 65519.0, 65520.0, 1.0]
    under, over = fp16_cast_losses(values)
    assert (under, over) == (1 / 6, 1 / 6)


def test_loss_scale_moves_values_into_range():
    values = [1e-9, 1e-7, 1e-2]
    assert fp16_cast_losses(values)[0] == pytest.approx(1 / 3)
    assert fp16_cast_losses(values, scale=1024) == (0.0, 0.0)
    assert fp16_cast_losses(values, scale=2.0**24)[1] == pytest.approx(1 / 3)


def test_zero_never_counts_as_underflow():
    assert fp16_cast_losses(torch.zeros(5)) == (0.0, 0.0)


@given(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=50))
def test_shares_are_shares(values):
    under, over = fp16_cast_losses(values)
    assert 0.0 <= under <= 1.0 and 0.0 <= over <= 1.0 and under + over <= 1.0


def test_bad_precision_arguments():
    with pytest.raises(ValueError, match="values"):
        fp16_cast_losses([])
    with pytest.raises(ValueError, match="scale"):
        fp16_cast_losses([1.0], scale=0)
    with pytest.raises(ValueError, match="dtype"):
        accumulate_updates(torch.int32)


def test_bf16_loses_small_updates_fp32_keeps_them():
    assert accumulate_updates(torch.bfloat16) == 1.0
    assert accumulate_updates(torch.float32) == pytest.approx(1.1, abs=1e-4)
    assert accumulate_updates(torch.float32, steps=0) == 1.0


# --- fp8 -------------------------------------------------------------------------------

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_fp8_formats_read_from_finfo():
    # e4m3: bias 7, no infinity, the top code 1111.111 is NaN: largest 1.110b x 2^8 = 448;
    # smallest normal 2^(1-7) = 2^-6, smallest subnormal 2^-6 x 2^-3 = 2^-9.
    e4m3 = float_format(E4M3)
    assert (e4m3.bits, e4m3.exponent_bits, e4m3.mantissa_bits) == (8, 4, 3)
    assert (e4m3.largest, e4m3.smallest_normal, e4m3.smallest_subnormal) == (448.0, 2**-6, 2**-9)
    # e5m2: bias 15, IEEE-like (top exponent for inf and NaN): largest 1.11b x 2^15 = 57344.
    e5m2 = float_format(E5M2)
    assert (e5m2.exponent_bits, e5m2.mantissa_bits) == (5, 2)
    assert (e5m2.largest, e5m2.smallest_normal, e5m2.smallest_subnormal) == (
        57344.0,
        2**-14,
        2**-16,
    )


def test_fp8_bit_strings():
    assert bit_string(1.0, E4M3) == "0 0111 000"  # exponent 7 = bias
    assert bit_string(448.0, E4M3) == "0 1111 110"
    assert bit_string(-2.0, E5M2) == "1 10000 00"
    assert bit_string(2.0**-9, E4M3) == "0 0000 001"  # the smallest subnormal


def test_quantize_rounds_to_nearest_even_and_saturates():
    # e4m3 near 1 has steps of 2^-3: 1.0625 is halfway between 1 and 1.125 -> 1 (even);
    # 1.1875 is halfway between 1.125 and 1.25 -> 1.25 (even). Half the smallest
    # subnormal, 2^-10, ties to 0; 3 x 2^-10 ties to 2^-8 (even). Beyond 448: clipped.
    values = [1.0625, 1.1875, 2.0**-10, 2.0**-10 * 1.01, 3 * 2.0**-10, 460.0, -1e6]
    stored = quantize(values, E4M3).to(torch.float64).tolist()
    assert stored == [1.0, 1.25, 0.0, 2.0**-9, 2.0**-8, 448.0, -448.0]
    assert quantize([3.0], E4M3, scale=0.25).dtype == E4M3


def test_quantize_matches_the_nearest_fp8_number():
    # Every positive finite e4m3 number, from its bit patterns 0x00 to 0x7e (0x7f is NaN).
    grid = torch.arange(0, 127, dtype=torch.uint8).view(E4M3).to(torch.float64)
    generator = torch.Generator().manual_seed(0)
    values = (torch.rand(5_000, generator=generator, dtype=torch.float64) * 20 - 11).exp2()
    values = values.float().to(torch.float64)  # what is cast is an fp32 tensor
    stored = quantize(values, E4M3).to(torch.float64)
    gaps = (values[:, None] - grid[None, :]).abs()
    nearest = gaps.min(dim=1).values
    assert torch.equal((stored - values).abs(), nearest)


def test_scaled_cast_counts_what_is_lost():
    # 1e-4 is below 2^-10 (half e4m3's smallest subnormal): 0. 1000 saturates to 448.
    cast = scaled_cast([1e-4, 1.0, 1000.0, 0.0], E4M3)
    assert (cast.underflowed, cast.saturated) == (0.25, 0.25)
    # read back: 0, 1, 448, 0; error sqrt(1e-8 + 552^2), norm sqrt(1e-8 + 1 + 1e6)
    assert cast.relative_error == pytest.approx(552 / 1000.0005, rel=1e-6)
    # A power-of-two scale only moves exponents: 2^8 x 2^-2 = 64 fits, 2^-12 x 2^-2 does not.
    shifted = scaled_cast([2.0**-12, 1.0, 2.0**8], E4M3, scale=0.25)
    assert (shifted.underflowed, shifted.saturated) == (pytest.approx(1 / 3), 0.0)


def test_amax_scale_is_largest_over_amax_over_two_to_the_margin():
    assert amax_scale(448.0, E4M3) == 1.0
    assert amax_scale(7.0, E4M3, margin=1) == 32.0  # 448 / 7 / 2
    assert amax_scale(57344.0 / 4, E5M2) == 4.0


@given(
    st.lists(
        st.floats(1e-30, 1e30).flatmap(lambda v: st.sampled_from([v, -v])), min_size=1, max_size=40
    ),
    st.sampled_from([E4M3, E5M2]),
)
def test_the_amax_scale_never_saturates(values, dtype):
    amax = max(abs(v) for v in values)
    assert scaled_cast(values, dtype, amax_scale(amax, dtype)).saturated == 0.0


def test_delayed_scales_use_the_history_before_each_step():
    # amax 1, 1, 4, 1, 1 with a history of 2 steps: step 0 has none (scale 1), steps 1-2
    # see amax 1 (448), steps 3-4 see the 4 (112); with a history of 1, step 4 sees 1 again.
    amaxes = [1.0, 1.0, 4.0, 1.0, 1.0]
    assert delayed_scales(amaxes, E4M3, history_len=2) == [1.0, 448.0, 448.0, 112.0, 112.0]
    assert delayed_scales(amaxes, E4M3, history_len=1) == [1.0, 448.0, 448.0, 112.0, 448.0]
    assert delayed_scales([2.0, 2.0], E4M3, margin=1) == [1.0, 112.0]
    assert delayed_scales([], E5M2) == []


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: quantize([1.0], torch.float16), "dtype"),
        (lambda: quantize([1.0], E4M3, scale=0), "scale"),
        (lambda: scaled_cast([], E4M3), "values"),
        (lambda: scaled_cast([float("nan")], E4M3), "values"),
        (lambda: amax_scale(0.0, E4M3), "amax"),
        (lambda: amax_scale(1.0, E4M3, margin=-1), "margin"),
        (lambda: delayed_scales([1.0, 0.0], E4M3), "amaxes"),
        (lambda: delayed_scales([1.0], E4M3, history_len=0), "history_len"),
    ],
)
def test_bad_fp8_arguments_are_named(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_relative_error_by_hand():
    # ||(3, 4) - (3, 0)|| / ||(3, 0)|| = 4 / 3; exact zeros give 0.
    assert relative_error(torch.tensor([3.0, 4.0]), torch.tensor([3.0, 0.0])) == 4 / 3
    assert relative_error(torch.ones(2), torch.zeros(2)) == 0.0
    with pytest.raises(ValueError, match="approximate"):
        relative_error(torch.ones(3), torch.ones(2))
