"""What 16-bit numbers can and cannot hold (chapter 08).

fp16 has 10 stored mantissa bits but only 5 exponent bits: small gradients
round to zero and large ones to infinity. bf16 keeps fp32's 8 exponent bits
but only 7 mantissa bits: it has the range but not the precision.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from trainscale import _checks


def fp16_cast_losses(
    values: Iterable[float] | torch.Tensor, scale: float = 1.0
) -> tuple[float, float]:
    """Share of ``values`` lost when ``values * scale`` is stored in fp16.

    Returns ``(underflowed, overflowed)``: the share of all values that were
    non-zero but round to 0, and the share that were finite but round to
    infinity. The product is formed in float64 and rounded once, correctly,
    to fp16, so the boundaries are exact: values below half the smallest
    subnormal (2**-25) vanish and values from 65520 up become inf.
    """
    if isinstance(values, torch.Tensor):
        array = values.detach().to(torch.float64).cpu().numpy().ravel()
    else:
        array = np.asarray(list(values), dtype=np.float64)
    if array.size == 0:
        raise ValueError("values must hold at least one number, got none")
    if not np.all(np.isfinite(array)):
        raise ValueError("values must all be finite")
    factor = _checks.positive("scale", scale)
    scaled = array * factor
    with np.errstate(over="ignore"):
        stored = scaled.astype(np.float16)
    underflowed = np.count_nonzero((scaled != 0) & (stored == 0))
    overflowed = np.count_nonzero(np.isfinite(scaled) & np.isinf(stored)) + np.count_nonzero(
        np.isinf(scaled)
    )
    return float(underflowed / array.size), float(overflowed / array.size)


def accumulate_updates(dtype: torch.dtype, steps: int = 1000, update: float = 1e-4) -> float:
    """Start a weight at 1.0 and add ``update`` to it ``steps`` times, stored in ``dtype``.

    In fp32 the weight ends near ``1 + steps * update``. In bf16 the neighbours
    of 1.0 are 2**-7 apart, so an update much smaller than half of that rounds
    away every time and the weight never moves: why optimisers keep an fp32
    master copy.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    n = _checks.count("steps", steps)
    step = torch.tensor(_checks.positive("update", update), dtype=dtype)
    weight = torch.tensor(1.0, dtype=dtype)
    for _ in range(n):
        weight = weight + step
    return float(weight)
