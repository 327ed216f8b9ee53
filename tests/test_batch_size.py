"""batch_size: McCandlish et al.'s noise scale, its unbiased estimates, per-example gradients."""

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale.batch_size import (
    NoiseEstimate,
    examples_ratio,
    noise_estimates,
    optimal_lr_share,
    per_example_gradients,
    scaled_learning_rate,
    simple_noise_scale,
    steps_ratio,
    two_batch_estimates,
)
from trainscale.transformer import GPTConfig, gpt


class Line(torch.nn.Module):
    """``w . x``: one weight vector, no bias."""

    def __init__(self, w: list[float]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(w, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def half_square(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean of (prediction - target)^2 / 2; for one example its gradient is (w.x - y) x."""
    return ((prediction - target) ** 2).mean() / 2


def test_per_example_gradients_of_a_line_by_hand():
    # w = (1, 2): w.x for x = (1, 0), (0, 1), (1, 1) is 1, 2, 3; targets 0, 0, 5
    # residuals 1, 2, -2, so the gradients (w.x - y) x are (1, 0), (0, 2), (-2, -2).
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([0.0, 0.0, 5.0], dtype=torch.float64)
    model = Line([1.0, 2.0])
    grads = per_example_gradients(model, x, y, half_square, chunk=2)
    expected = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-2.0, -2.0]], dtype=torch.float64)
    assert torch.equal(grads, expected)
    assert torch.equal(model.w.detach(), torch.tensor([1.0, 2.0], dtype=torch.float64))


def test_estimates_of_three_gradients_by_hand():
    # Gradients 1, 2, 3 along one axis: mean 2, |mean|^2 = 4, mean |g_i|^2 = 14/3.
    # tr(Sigma): sample variance ((1-2)^2 + 0 + (3-2)^2) / 2 = 1.
    # |G|^2 = |mean|^2 - tr(Sigma) / n = 4 - 1/3 = 11/3; B_simple = 1 / (11/3) = 3/11.
    grads = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0]])
    estimate = noise_estimates(grads)
    assert estimate.examples == 3
    assert estimate.trace == pytest.approx(1.0, rel=1e-15)
    assert estimate.gradient_sq == pytest.approx(11 / 3, rel=1e-15)
    assert estimate.simple_noise_scale == pytest.approx(3 / 11, rel=1e-15)


def test_estimates_of_the_lines_gradients_by_hand():
    # (1, 0), (0, 2), (-2, -2): mean (-1/3, 0), |mean|^2 = 1/9; |g_i|^2 = 1, 4, 8, mean 13/3.
    # tr(Sigma) = (13/3 - 1/9) / (1 - 1/3) = (38/9) * (3/2) = 19/3.
    # |G|^2 = (3 * 1/9 - 13/3) / 2 = (1/3 - 13/3) / 2 = -2: noise swamps the signal.
    grads = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-2.0, -2.0]], dtype=torch.float64)
    estimate = noise_estimates(grads)
    assert estimate.trace == pytest.approx(19 / 3, rel=1e-15)
    assert estimate.gradient_sq == pytest.approx(-2.0, rel=1e-15)
    with pytest.raises(ValueError, match="gradient_sq"):
        _ = estimate.simple_noise_scale


def test_two_batch_estimates_by_hand():
    # |G|^2 = 2 and tr(Sigma) = 8 give E|G_B|^2 = 2 + 8 / B: 10 at B = 1, 3 at B = 8.
    assert two_batch_estimates(10.0, 3.0, 1, 8) == pytest.approx((2.0, 8.0), rel=1e-15)
    # and 2 + 8/4 = 4 at B = 4, 2 + 8/16 = 2.5 at B = 16
    assert two_batch_estimates(4.0, 2.5, 4, 16) == pytest.approx((2.0, 8.0), rel=1e-15)


def test_the_estimates_are_unbiased_where_the_plain_ones_are_not():
    # One example's gradient: G = (1, 0, 0, 0) plus noise of standard deviation 2 on each
    # of 4 coordinates, so |G|^2 = 1 and tr(Sigma) = 4 * 4 = 16: B_simple = 16.
    generator = torch.Generator().manual_seed(0)
    batches, n = 20_000, 8
    truth = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    grads = truth + 2 * torch.randn(batches, n, 4, generator=generator, dtype=torch.float64)
    estimates = [noise_estimates(g) for g in grads]
    gradient_sq = sum(e.gradient_sq for e in estimates) / batches
    trace = sum(e.trace for e in estimates) / batches
    assert gradient_sq == pytest.approx(1.0, abs=0.05)  # standard error ~0.02
    assert trace == pytest.approx(16.0, rel=0.01)
    plain = float(grads.mean(dim=1).pow(2).sum(dim=1).mean())  # |mean|^2: biased by 16 / 8
    assert plain == pytest.approx(1.0 + 16 / n, abs=0.05)
    assert simple_noise_scale(trace, gradient_sq) == pytest.approx(16.0, rel=0.06)


def test_the_trade_off_by_hand():
    # At B = B_noise both ratios are 2 and the best rate is half its limit.
    assert steps_ratio(100, 100) == examples_ratio(100, 100) == 2.0
    assert optimal_lr_share(100, 100) == 0.5
    # B = 10, B_noise = 1000: S/S_min = 101, E/E_min = 1.01, eps share 10/1010.
    assert steps_ratio(10, 1000) == pytest.approx(101.0)
    assert examples_ratio(10, 1000) == pytest.approx(1.01)
    assert optimal_lr_share(10, 1000) == pytest.approx(10 / 1010)


@given(st.floats(1e-2, 1e4), st.floats(1e-2, 1e4))
def test_the_trade_off_is_a_hyperbola(batch, noise):
    # (S / S_min - 1)(E / E_min - 1) = 1 for every batch.
    product = (steps_ratio(batch, noise) - 1) * (examples_ratio(batch, noise) - 1)
    assert product == pytest.approx(1.0, rel=1e-8)  # (1 + x) - 1 loses ~1e-16 x of precision
    assert 0 < optimal_lr_share(batch, noise) < 1


def test_small_batches_follow_the_linear_scaling_rule():
    noise = 10_000.0
    small = [optimal_lr_share(b, noise) for b in (1, 2, 4, 8)]
    assert [b / a for a, b in itertools.pairwise(small)] == pytest.approx([2.0] * 3, rel=1e-3)
    assert optimal_lr_share(2 * noise, noise) / optimal_lr_share(noise, noise) == pytest.approx(
        4 / 3
    )


def test_scaled_learning_rate_by_hand():
    # Goyal et al.: 0.1 per 256 images, 8,192 images -> 0.1 x 32 = 3.2 (linear);
    # the square-root rule gives 0.1 x sqrt(32) = 0.5657; exponent 0 keeps 0.1.
    assert scaled_learning_rate(0.1, 256, 8192) == pytest.approx(3.2)
    assert scaled_learning_rate(0.1, 256, 8192, exponent=0.5) == pytest.approx(0.565685, rel=1e-6)
    assert scaled_learning_rate(0.1, 256, 8192, exponent=0.0) == 0.1


@given(st.floats(1e-6, 1.0), st.floats(1.0, 1e4), st.floats(1.0, 1e4), st.floats(0.0, 1.0))
def test_scaling_there_and_back_is_the_identity(lr, batch, new_batch, exponent):
    there = scaled_learning_rate(lr, batch, new_batch, exponent)
    assert scaled_learning_rate(there, new_batch, batch, exponent) == pytest.approx(lr)
    # a larger batch never lowers the rate, and the linear rule gives the most
    if new_batch >= batch:
        assert lr <= there <= scaled_learning_rate(lr, batch, new_batch) * (1 + 1e-12)


def test_per_example_gradients_of_the_gpt_match_one_backward_per_example():
    config = GPTConfig(vocab=8, context=6, d_model=8, layers=1, heads=2)
    model = gpt(config, seed=1, dtype=torch.float64)
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(8, (5, 7), generator=generator)

    def sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())

    grads = per_example_gradients(model, tokens[:, :-1], tokens[:, 1:], sequence_loss, chunk=3)
    assert grads.shape == (5, sum(p.numel() for p in model.parameters()))  # tied weight once
    for i in range(5):
        model.zero_grad()
        model.loss(tokens[i : i + 1, :-1], tokens[i : i + 1, 1:]).backward()
        one = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert torch.allclose(grads[i], one, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: two_batch_estimates(1.0, 1.0, 0, 4), "b_small"),
        (lambda: two_batch_estimates(1.0, 1.0, 4, 4), "b_big"),
        (lambda: two_batch_estimates(-1.0, 1.0, 1, 4), "small_sq"),
        (lambda: two_batch_estimates(1.0, math.nan, 1, 4), "big_sq"),
        (lambda: noise_estimates(torch.ones(1, 3)), "number of examples"),
        (lambda: noise_estimates(torch.ones(3)), "per_example"),
        (lambda: simple_noise_scale(1.0, 0.0), "gradient_sq"),
        (lambda: simple_noise_scale(-1.0, 1.0), "trace"),
        (lambda: steps_ratio(0, 1), "batch"),
        (lambda: examples_ratio(1, 0), "noise_scale"),
        (lambda: optimal_lr_share(1, -1), "noise_scale"),
        (lambda: scaled_learning_rate(0.0, 1, 2), "lr"),
        (lambda: scaled_learning_rate(1e-3, 0, 2), "batch"),
        (lambda: scaled_learning_rate(1e-3, 1, -2), "new_batch"),
        (lambda: scaled_learning_rate(1e-3, 1, 2, exponent=1.5), "exponent"),
        (lambda: per_example_gradients("net", torch.ones(2, 1), torch.ones(2), None), "model"),
        (
            lambda: per_example_gradients(Line([1.0]), torch.ones(2, 1), torch.ones(3), None),
            "targets",
        ),
        (
            lambda: per_example_gradients(
                Line([1.0]), torch.ones(2, 1), torch.ones(2), None, chunk=0
            ),
            "chunk",
        ),
    ],
)
def test_bad_arguments_are_named(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_a_noise_estimate_is_a_plain_record():
    estimate = NoiseEstimate(gradient_sq=2.0, trace=8.0, examples=10)
    assert estimate.simple_noise_scale == 4.0
