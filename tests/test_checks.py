"""_checks: every argument check returns a clean value or names the argument and its range."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainscale import _checks


def test_count_accepts_whole_numbers_written_as_floats():
    assert _checks.count("params", 7e9) == 7_000_000_000
    assert isinstance(_checks.count("params", 7e9), int)
    assert _checks.count("ranks", 4, minimum=1) == 4


@pytest.mark.parametrize("bad", [True, 1.5, -1, math.nan, math.inf, "4", None])
def test_count_refuses_and_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"^ranks must be a whole number >= 0"):
        _checks.count("ranks", bad)


def test_positive_and_its_maximum():
    assert _checks.positive("efficiency", 0.6, maximum=1.0) == 0.6
    for bad in (0, -0.1, 1.01, math.nan, math.inf, False):
        with pytest.raises(ValueError, match=r"^efficiency must be"):
            _checks.positive("efficiency", bad, maximum=1.0)


def test_fraction_includes_both_ends():
    assert _checks.fraction("share", 0) == 0.0
    assert _checks.fraction("share", 1) == 1.0
    for bad in (-0.01, 1.01, True):
        with pytest.raises(ValueError, match=r"^share must be a number in \[0, 1\]"):
            _checks.fraction("share", bad)


def test_choice_refuses_a_bool_that_equals_an_allowed_number():
    assert _checks.choice("zero_stage", 3, (0, 1, 2, 3)) == 3
    with pytest.raises(ValueError, match=r"^zero_stage must be one of"):
        _checks.choice("zero_stage", True, (0, 1, 2, 3))  # True == 1, but is no stage


def test_boolean_takes_only_true_and_false():
    assert _checks.boolean("tied", True) is True
    assert _checks.boolean("tied", False) is False
    for bad in (0, 1, None, "yes"):
        with pytest.raises(ValueError, match=r"^tied must be True or False"):
            _checks.boolean("tied", bad)


@given(st.floats(min_value=0, max_value=1e300))
def test_non_negative_returns_every_finite_number_from_zero_up(value):
    assert _checks.non_negative("delay", value) == value


@pytest.mark.parametrize("bad", [-1e-300, -1, math.nan, math.inf, -math.inf, True, "0"])
def test_non_negative_refuses_and_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"^delay must be a finite number >= 0"):
        _checks.non_negative("delay", bad)
