"""The gradient noise scale and the critical batch size (chapter 13).

McCandlish et al. (arXiv 1812.06162) model one step of SGD on a batch of ``B``
examples. The batch's mean gradient is the true gradient ``G`` plus noise whose
covariance is ``Sigma / B`` (``Sigma``: the covariance of one example's
gradient). Two numbers sum up how much a larger batch can help:

- the *simple noise scale* ``B_simple = tr(Sigma) / |G|^2`` (:func:`simple_noise_scale`):
  the batch at which the noise in the mean gradient, ``tr(Sigma) / B``, is as
  large as the signal ``|G|^2``. It equals their ``B_noise =
  tr(H Sigma) / (G^T H G)`` when the Hessian ``H`` is a multiple of the identity;
- the *critical batch size* ``B_crit``, measured from training runs: where the
  trade-off between steps and examples bends. With ``B_noise`` for ``B_crit``,
  the paper's model predicts :func:`steps_ratio` ``S / S_min = 1 + B_noise / B``,
  :func:`examples_ratio` ``E / E_min = 1 + B / B_noise``, and
  :func:`optimal_lr_share` ``eps_opt / eps_max = 1 / (1 + B_noise / B)``.

Neither ``|G|^2`` nor ``tr(Sigma)`` is observed directly. :func:`two_batch_estimates`
are the paper's unbiased estimates (its appendix A.1) from the squared norms
of the mean gradient of a small and a large batch; :func:`noise_estimates`
applies them to per-example gradients (``B_small = 1``, ``B_big = n``), which
:func:`per_example_gradients` computes with ``torch.func``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from trainscale import _checks


@dataclass(frozen=True)
class NoiseEstimate:
    """Unbiased estimates from one set of gradients.

    ``gradient_sq``: ``|G|^2``, the squared norm of the true gradient (loss
    units squared per parameter unit squared); ``trace``: ``tr(Sigma)``, the
    summed variance of one example's gradient, same units; ``examples``: how
    many examples they came from. ``gradient_sq`` can come out negative when
    the noise swamps the signal (too few examples for this ``B_simple``).
    """

    gradient_sq: float
    trace: float
    examples: int

    @property
    def simple_noise_scale(self) -> float:
        """``B_simple = trace / gradient_sq``, in examples (see :func:`simple_noise_scale`)."""
        return simple_noise_scale(self.trace, self.gradient_sq)


def two_batch_estimates(
    small_sq: float, big_sq: float, b_small: float, b_big: float
) -> tuple[float, float]:
    """McCandlish et al.'s unbiased estimates of ``(|G|^2, tr(Sigma))`` (their appendix A.1).

    ``small_sq`` is the squared norm of the mean gradient of a batch of
    ``b_small`` examples, ``big_sq`` that of a batch of ``b_big > b_small``
    examples. Since ``E|G_B|^2 = |G|^2 + tr(Sigma) / B``, two batch sizes give two
    equations in the two unknowns::

        |G|^2    = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        tr(Sigma) = (small_sq - big_sq) / (1 / b_small - 1 / b_big)

    Each is unbiased; their ratio is not, so average each over many batches
    before dividing (the paper keeps a moving average of each).
    """
    small = _checks.positive("b_small", b_small)
    big = _checks.positive("b_big", b_big)
    if big <= small:
        raise ValueError(f"b_big must be larger than b_small = {small:g}, got {b_big!r}")
    s = _checks.non_negative("small_sq", small_sq)
    b = _checks.non_negative("big_sq", big_sq)
    gradient_sq = (big * b - small * s) / (big - small)
    trace = (s - b) / (1.0 / small - 1.0 / big)
    return gradient_sq, trace


def noise_estimates(per_example: torch.Tensor) -> NoiseEstimate:
    """:func:`two_batch_estimates` from ``n`` per-example gradients, shape ``(n, P)``.

    The small batches are the single examples (``b_small = 1``; ``small_sq`` is
    the mean of ``|g_i|^2`` over them, which is unbiased too) and the big batch
    is all of them (``b_big = n``, ``big_sq = |mean g_i|^2``). Then
    ``tr(Sigma)`` is the sample variance ``sum |g_i - mean|^2 / (n - 1)`` and
    ``|G|^2 = |mean|^2 - tr(Sigma) / n``. Computed in float64.
    """
    if not isinstance(per_example, torch.Tensor) or per_example.dim() != 2:
        raise ValueError("per_example must be a 2-D tensor: one row of gradients per example")
    n = _checks.count("number of examples (rows of per_example)", per_example.shape[0], minimum=2)
    rows = per_example.double()
    small_sq = float(rows.pow(2).sum(dim=1).mean())
    big_sq = float(rows.mean(dim=0).pow(2).sum())
    gradient_sq, trace = two_batch_estimates(small_sq, big_sq, 1, n)
    return NoiseEstimate(gradient_sq, trace, n)


def simple_noise_scale(trace: float, gradient_sq: float) -> float:
    """``B_simple = tr(Sigma) / |G|^2``, in examples.

    The batch size at which the mean gradient's noise ``tr(Sigma) / B`` equals
    its signal ``|G|^2``. ``gradient_sq`` must be positive: an estimate at or
    below zero means the examples measured were too few to see the gradient
    through its noise.
    """
    t = _checks.non_negative("trace", trace)
    g = _checks.positive("gradient_sq", gradient_sq)
    return t / g


def steps_ratio(batch: float, noise_scale: float) -> float:
    """``S / S_min = 1 + B_noise / B``: steps needed at batch ``batch`` over the
    fewest steps any batch needs, in McCandlish et al.'s model."""
    b = _checks.positive("batch", batch)
    return 1.0 + _checks.positive("noise_scale", noise_scale) / b


def examples_ratio(batch: float, noise_scale: float) -> float:
    """``E / E_min = 1 + B / B_noise``: examples consumed at batch ``batch`` over
    the fewest any batch needs. At ``B = B_noise`` both ratios are 2."""
    b = _checks.positive("batch", batch)
    return 1.0 + b / _checks.positive("noise_scale", noise_scale)


def optimal_lr_share(batch: float, noise_scale: float) -> float:
    """``eps_opt(B) / eps_max = 1 / (1 + B_noise / B)``: SGD's best learning rate at
    batch ``batch`` as a share of its best rate with the exact gradient.

    For ``B`` well below ``B_noise`` it is ``~ B / B_noise``, proportional to the
    batch: the linear scaling rule. Near and above ``B_noise`` it saturates at 1:
    doubling the batch no longer doubles the best rate.
    """
    return 1.0 / steps_ratio(batch, noise_scale)


def scaled_learning_rate(lr: float, batch: float, new_batch: float, exponent: float = 1.0) -> float:
    """The learning rate for ``new_batch`` from one tuned at ``batch``:
    ``lr * (new_batch / batch) ** exponent``.

    ``exponent = 1`` is the linear scaling rule (Goyal et al., arXiv 1706.02677),
    which holds for SGD while the batch is well below the noise scale
    (:func:`optimal_lr_share`); ``0.5`` is the square-root rule, the gain of Adam's
    later steps while noise dominates (chapter 13). McCandlish et al. found Adam's
    best rate to grow with an exponent between the two, so for Adam the linear value
    is an upper bound. The batches are in any one unit (examples, sequences or
    tokens); ``exponent`` is in ``[0, 1]``.
    """
    rate = _checks.positive("lr", lr)
    old = _checks.positive("batch", batch)
    new = _checks.positive("new_batch", new_batch)
    power = _checks.fraction("exponent", exponent)
    return rate * (new / old) ** power


def per_example_gradients(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    chunk: int = 64,
) -> torch.Tensor:
    """The gradient of ``loss`` for each example on its own, shape ``(n, P)``.

    Example ``i`` is ``inputs[i]`` with ``targets[i]``; ``loss(model(x), y)`` is
    evaluated on it as a batch of one, and its gradient with respect to every
    parameter of ``model`` (``named_parameters()`` order, tied weights once) is
    flattened into row ``i``. ``torch.func.vmap(grad(...))`` over
    ``functional_call`` does all ``n`` at once, ``chunk`` examples at a time
    (to bound memory). The model's parameters are not changed.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    n = _checks.count("number of examples (len(inputs))", len(inputs), minimum=1)
    if len(targets) != n:
        raise ValueError(f"targets must hold one entry per input ({n}), got {len(targets)}")
    size = _checks.count("chunk", chunk, minimum=1)
    params = {name: p.detach() for name, p in model.named_parameters()}

    def one_loss(
        weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor:
        outputs = functional_call(model, weights, (x.unsqueeze(0),))
        return loss(outputs, y.unsqueeze(0))

    per_example = vmap(grad(one_loss), in_dims=(None, 0, 0))
    rows = []
    for start in range(0, n, size):
        grads = per_example(params, inputs[start : start + size], targets[start : start + size])
        rows.append(torch.cat([grads[name].flatten(1) for name in params], dim=1))
    return torch.cat(rows)
