"""schedule: the learning-rate curve, and PyTorch's own schedulers giving it step for step."""

import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale.schedule import learning_rate, torch_schedule


def test_schedule_reference_points():
    kwargs = {"peak": 3e-4, "warmup": 500, "total": 10_000}
    assert learning_rate(0, **kwargs) == pytest.approx(3e-4 / 500)
    assert learning_rate(499, **kwargs) == pytest.approx(3e-4)
    assert learning_rate(500, **kwargs) == pytest.approx(3e-4)
    assert learning_rate(5250, **kwargs) == pytest.approx((3e-4 + 3e-5) / 2)
    assert learning_rate(10_000, **kwargs) == pytest.approx(3e-5)
    assert learning_rate(50_000, **kwargs) == pytest.approx(3e-5)


@given(st.integers(0, 1000), st.integers(1, 1000), st.integers(0, 3000), st.floats(0, 1))
def test_schedule_stays_between_floor_and_peak(warmup, extra, step, floor):
    total = warmup + extra
    lr = learning_rate(step, 1.0, warmup, total, floor)
    assert 0.0 < lr <= 1.0 + 1e-12
    if step >= warmup:
        assert lr >= floor - 1e-12
        assert learning_rate(step + 1, 1.0, warmup, total, floor) <= lr + 1e-12


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"warmup": 10, "total": 10}, "warmup"),
        ({"warmup": -1}, "warmup"),
        ({"total": 0}, "total"),
        ({"floor": 1.5}, "floor"),
        ({"peak": -1}, "peak"),
        ({"step": -1}, "step"),
        ({"peak": math.nan}, "peak"),
    ],
)
def test_schedule_names_bad_arguments(kwargs, name):
    args = {"step": 0, "peak": 1.0, "warmup": 1, "total": 10} | kwargs
    with pytest.raises(ValueError, match=name):
        learning_rate(**args)


# --- torch_schedule: PyTorch's own schedulers ------------------------------------------


def _rates(peak: float, warmup: int, total: int, floor: float, steps: int) -> list[float]:
    """The learning rate each of ``steps`` optimiser steps uses under torch_schedule."""
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=peak)
    scheduler = torch_schedule(optimizer, warmup, total, floor)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_reference_schedule_agrees_at_every_step():
    peak, warmup, total, floor = 3e-4, 500, 10_000, 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation or ordering warnings either
        rates = _rates(peak, warmup, total, floor, 12_000)
    worst = max(
        abs(rate - learning_rate(step, peak, warmup, total, floor)) / peak
        for step, rate in enumerate(rates)
    )
    assert worst < 1e-12
    assert rates[0] == pytest.approx(peak / 500, rel=1e-12)
    assert rates[499] == pytest.approx(peak, rel=1e-12)
    assert rates[10_000] == pytest.approx(3e-5, rel=1e-12)
    assert rates[11_999] == rates[10_000]  # constant after the end, never back up


@pytest.mark.parametrize(
    ("warmup", "total", "floor"),
    [(0, 10, 0.1), (1, 10, 0.1), (1, 2, 0.0), (0, 1, 1.0), (9, 10, 0.5), (3, 10, 0.0)],
)
def test_edges_agree(warmup, total, floor):
    rates = _rates(2.0, warmup, total, floor, total + 5)
    for step, rate in enumerate(rates):
        assert rate == pytest.approx(learning_rate(step, 2.0, warmup, total, floor), abs=1e-12)


@given(st.integers(0, 60), st.integers(1, 120), st.floats(0, 1), st.floats(1e-6, 10))
def test_any_schedule_agrees(warmup, extra, floor, peak):
    total = warmup + extra
    rates = _rates(peak, warmup, total, floor, total + 3)
    for step, rate in enumerate(rates):
        assert rate == pytest.approx(learning_rate(step, peak, warmup, total, floor), rel=1e-9)


def test_every_group_follows_the_schedule():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([{"params": [a]}, {"params": [b], "weight_decay": 0.0}], lr=1.0)
    scheduler = torch_schedule(optimizer, 4, 8)
    for _ in range(6):
        optimizer.step()
        scheduler.step()
    expected = learning_rate(6, 1.0, 4, 8)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([expected, expected])


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"warmup": 10, "total": 10}, "warmup"),
        ({"warmup": -1}, "warmup"),
        ({"total": 0}, "total"),
        ({"floor": 1.5}, "floor"),
        ({"floor": math.nan}, "floor"),
    ],
)
def test_bad_arguments_are_named(kwargs, name):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    args = {"warmup": 2, "total": 10, "floor": 0.1} | kwargs
    with pytest.raises(ValueError, match=name):
        torch_schedule(optimizer, **args)


def test_optimizer_must_have_one_peak():
    a, b = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    two_rates = torch.optim.SGD([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.2}])
    with pytest.raises(ValueError, match="optimizer"):
        torch_schedule(two_rates, 2, 10)
    with pytest.raises(ValueError, match="optimizer"):
        torch_schedule("sgd", 2, 10)
