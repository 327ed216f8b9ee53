"""The learning-rate schedule of chapter 13: linear warmup, then cosine decay to a floor.

:func:`learning_rate` is the formula; :func:`torch_schedule` builds the same
schedule from PyTorch's own schedulers, for a training loop to step.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

from trainscale import _checks

Steps = int
"""A count of optimiser steps."""


def learning_rate(
    step: Steps, peak: float, warmup: Steps, total: Steps, floor: float = 0.1
) -> float:
    """Learning rate at ``step`` (counted from 0).

    * ``step < warmup``: linear warmup, ``peak * (step + 1) / warmup``, so the
      first step already moves and step ``warmup - 1`` reaches the peak;
    * ``warmup <= step <= total``: cosine decay from ``peak`` down to
      ``floor * peak``, reached exactly at ``step == total``;
    * ``step > total``: constant at ``floor * peak``.

    ``floor`` is a share of the peak, in ``[0, 1]``; warmup must satisfy
    ``0 <= warmup < total``.
    """
    s = _checks.count("step", step)
    top = _checks.positive("peak", peak)
    t = _checks.count("total", total, minimum=1)
    w = _checks.count("warmup", warmup)
    if w >= t:
        raise ValueError(f"warmup must be in [0, total) = [0, {t}), got {warmup!r}")
    low = _checks.fraction("floor", floor) * top
    if s < w:
        return top * (s + 1) / w
    if s >= t:
        return low
    progress = (s - w) / (t - w)
    return low + (top - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def torch_schedule(
    optimizer: torch.optim.Optimizer, warmup: int, total: int, floor: float = 0.1
) -> SequentialLR:
    """:func:`learning_rate` built from ``torch.optim.lr_scheduler``'s own pieces.

    The optimiser's learning rate (the same in every parameter group) is the
    peak. Call ``scheduler.step()`` after each ``optimizer.step()``; the rate in
    force for step ``s`` (from 0) is then ``learning_rate(s, peak, warmup,
    total, floor)``, to rounding. Three schedulers take turns:

    * ``LinearLR`` from ``1 / warmup`` to ``1`` of the peak over steps
      ``0 .. warmup - 1`` (left out when ``warmup`` is 0);
    * ``CosineAnnealingLR`` from the peak at step ``warmup`` down to
      ``eta_min = floor * peak`` at step ``total``;
    * ``ConstantLR`` at ``floor`` of the peak from step ``total`` on
      (``total_iters`` infinite: it never switches back).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
    peaks = {group["lr"] for group in optimizer.param_groups}
    if len(peaks) != 1:
        raise ValueError(
            f"optimizer must use one learning rate in every group, got {sorted(peaks)}"
        )
    peak = _checks.positive("lr of the optimizer", peaks.pop())
    t = _checks.count("total", total, minimum=1)
    w = _checks.count("warmup", warmup)
    if w >= t:
        raise ValueError(f"warmup must be in [0, total) = [0, {t}), got {warmup!r}")
    low = _checks.fraction("floor", floor)
    schedulers, milestones = [], []
    if w:
        schedulers.append(LinearLR(optimizer, 1 / w, 1.0, total_iters=w - 1))
        milestones.append(w)
    schedulers.append(CosineAnnealingLR(optimizer, T_max=t - w, eta_min=low * peak))
    milestones.append(t)
    schedulers.append(ConstantLR(optimizer, factor=low, total_iters=math.inf))
    return SequentialLR(optimizer, schedulers, milestones)
