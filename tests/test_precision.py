"""precision: what fp16's range and bf16's precision lose."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale.precision import accumulate_updates, fp16_cast_losses


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
