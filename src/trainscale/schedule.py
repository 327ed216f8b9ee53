"""The learning-rate schedule of chapter 10: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math

from trainscale import _checks


def learning_rate(step: int, peak: float, warmup: int, total: int, floor: float = 0.1) -> float:
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
