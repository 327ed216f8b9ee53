"""Parity with one process, tensor by tensor: does a layout train the same model?

Two runs of the same training on the same data from the same weights differ only in
the order of their float32 additions (tensor parallelism splits the sums of matrix
products, data parallelism reduce-scatters gradients, context parallelism computes
softmax block by block). How far that order alone moves a final tensor is measured,
not assumed: the same run in one process with its global batch cut into micro-batches
of other sizes adds the same gradients in other groupings, and the largest
difference between those runs, tensor by tensor, is the *spread* of reduction order
(:func:`spread`). Adam's update ``m / (sqrt(v) + eps)`` divides by the gradient's own
size, so an element whose gradient is close to zero can move by up to a learning rate
between two orders: the spread catches that too, where a bound of ``sqrt(n) eps |x|``
would not. A layout passes when every final weight and both of Adam's moments of every
parameter lie within :data:`MARGIN` times that spread of one process's, plus
:data:`FLOOR` ulps of their size (:func:`tolerances`, :func:`mismatches`).

Comparing every tensor catches a wrong gradient on a small parameter group (a norm, a
bias) that the loss and the global gradient norm hardly see
(``tests/test_train.py`` plants one).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch

from trainscale import _checks

MARGIN = 32.0
"""How many times the one-process spread a layout may differ by. Measured over 4 steps of
the book's 4-block model (``tests/test_train.py``, which prints it): layouts without
tensor parallelism within 2.0 (PP 2 x DP 4) and 2.6 (FSDP 8) spreads of every tensor,
CP 2 x TP 2 x PP 2 within 10.0, TP 2 x DP 4 within 14.2 and TP 2 with HSDP within 12.7
(tensor parallelism splits the sums of every matrix product, which regrouping
micro-batches does not). 32 keeps a margin of 2.25 over the worst; a gradient that
misses one micro-batch on a 16-number shard of one layer norm's bias lands 24,108
tolerances away (measured)."""

FLOOR = 64 * torch.finfo(torch.float32).eps
"""The least tolerance, relative to a tensor's largest value: 64 units in the last
place of float32, ~7.6e-6, for a tensor that every reference run computed alike."""

State = Mapping[str, torch.Tensor]
"""A final state: tensor name -> full tensor (``--final-weights``' file)."""


def _max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def spread(references: list[State]) -> dict[str, float]:
    """Tensor by tensor, the largest absolute difference between any two of
    ``references``: final states of the same run in one process, their reduction order
    changed (another micro-batch size). Raises ``ValueError`` with fewer than two, or
    if they do not hold the same tensors."""
    if len(references) < 2:
        raise ValueError(f"references must hold at least 2 states, got {len(references)}")
    names = list(references[0])
    if any(list(r) != names for r in references):
        raise ValueError("references must hold the same tensor names, in the same order")
    return {
        name: max(
            _max_difference(a[name], b[name]) for a, b in itertools.combinations(references, 2)
        )
        for name in names
    }


def tolerances(
    reference: State, spreads: Mapping[str, float], margin: float = MARGIN, floor: float = FLOOR
) -> dict[str, float]:
    """The absolute tolerance of each tensor: ``margin`` times its spread, plus ``floor``
    times its largest absolute value in ``reference``."""
    _checks.positive("margin", margin)
    _checks.positive("floor", floor)
    return {
        name: margin * spreads[name] + floor * (t.abs().max().item() if t.numel() else 0.0)
        for name, t in reference.items()
    }


def mismatches(state: State, reference: State, tolerance: Mapping[str, float]) -> dict[str, float]:
    """The tensors of ``state`` farther from ``reference`` than their ``tolerance``,
    each with how many tolerances away it is (empty: the layout trained the same model).
    A tensor missing from either side counts as infinitely far."""
    far = {}
    for name in reference.keys() | state.keys():
        if name not in state or name not in reference:
            far[name] = float("inf")
            continue
        distance = _max_difference(state[name], reference[name])
        if distance > tolerance[name]:
            far[name] = distance / tolerance[name] if tolerance[name] else float("inf")
    return far


def worst_ratio(state: State, reference: State, spreads: Mapping[str, float]) -> float:
    """The largest ratio, over tensors with a nonzero spread, of ``state``'s distance
    from ``reference`` to the spread: how many spreads of reduction order the layout
    is away, at worst (what :data:`MARGIN` bounds)."""
    ratios = [
        _max_difference(state[name], reference[name]) / s for name, s in spreads.items() if s > 0
    ]
    return max(ratios, default=0.0)
