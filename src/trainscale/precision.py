"""What 16-bit numbers can and cannot hold (chapter 08).

fp16 has 10 stored mantissa bits but only 5 exponent bits: small gradients
round to zero and large ones to infinity. bf16 keeps fp32's 8 exponent bits
but only 7 mantissa bits: it has the range but not the precision.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

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


def accumulate_updates(dtype: torch.dtype, steps: int = 1_000, update: float = 0.0001) -> float:
    """Start a weight at 1.0 and add ``update`` to it ``steps`` times, stored in ``dtype``.

    In fp32 the weight ends near ``1 + steps * update``. In bf16 the neighbours
    of 1.0 are 2**-7 apart, so an update much smaller than half of that rounds
    away every time and the weight never moves: why optimisers keep an fp32
    master copy.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    n = _checks.count("steps", steps)
    increment = torch.full((), _checks.positive("update", update), dtype=dtype)
    weight = torch.ones((), dtype=dtype)
    for _ in range(n):
        weight = weight + increment  # rounded to dtype after every addition
    return float(weight)


@dataclass(frozen=True)
class FloatFormat:
    """The layout and limits of a binary floating-point format.

    ``bits = 1 (sign) + exponent_bits + mantissa_bits`` (stored mantissa bits;
    normal numbers carry one more, implicit, leading 1). ``eps`` is the gap
    between 1.0 and the next number up, ``2**-mantissa_bits``.
    """

    name: str
    bits: int
    exponent_bits: int
    mantissa_bits: int
    largest: float
    smallest_normal: float
    smallest_subnormal: float
    eps: float


def _exact_log2(name: str, value: float) -> int:
    exponent = math.log2(value)
    if not exponent.is_integer():
        raise ValueError(f"{name} must be a power of two, got {value!r}")
    return int(exponent)


def float_format(dtype: torch.dtype) -> FloatFormat:
    """Read a format's layout from ``torch.finfo(dtype)``; nothing is typed in.

    The stored mantissa bits come from ``eps = 2**-mantissa_bits``. The exponent
    bits come from the smallest normal number ``tiny = 2**(1 - bias)`` with
    ``bias = 2**(exponent_bits - 1) - 1``. The smallest positive subnormal
    number is ``tiny * eps``: the smallest exponent with only the last mantissa
    bit set. The result is checked against ``finfo.bits``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    info = torch.finfo(dtype)
    mantissa = -_exact_log2("eps", info.eps)
    bias = 1 - _exact_log2("tiny", info.tiny)
    exponent = _exact_log2("bias + 1", bias + 1) + 1
    if 1 + exponent + mantissa != info.bits:
        raise ValueError(f"dtype must be a binary format finfo describes fully, got {dtype!r}")
    return FloatFormat(
        name=str(dtype).removeprefix("torch."),
        bits=info.bits,
        exponent_bits=exponent,
        mantissa_bits=mantissa,
        largest=float(info.max),
        smallest_normal=float(info.tiny),
        smallest_subnormal=float(info.tiny) * float(info.eps),
        eps=float(info.eps),
    )


def spacing(dtype: torch.dtype, value: float = 1.0) -> float:
    """The gap between ``value`` (rounded to ``dtype``) and the next ``dtype`` number up."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"value must be a finite number, got {value!r}")
    here = torch.tensor(value, dtype=dtype)
    if not torch.isfinite(here):
        raise ValueError(f"value must be finite once stored as {dtype}, got {value!r}")
    up = torch.nextafter(here, torch.tensor(math.inf, dtype=dtype))
    return float(up.double() - here.double())


def accumulation_trace(
    dtype: torch.dtype, steps: int = 1_000, update: float = 0.0001, master: bool = False
) -> list[float]:
    """A weight after each of ``steps`` additions of ``update``, starting at 1.0.

    With ``master=False`` the weight lives in ``dtype`` and every sum is rounded
    to it (the last value equals :func:`accumulate_updates`). With ``master=True``
    the additions go to an fp32 master copy and the weight the model uses is
    that copy rounded to ``dtype`` after each step, as mixed-precision
    optimisers do. Returns ``steps + 1`` values, the start included.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    n = _checks.count("steps", steps)
    size = _checks.positive("update", update)
    _checks.boolean("master", master)
    held = torch.float32 if master else dtype
    step = torch.tensor(size, dtype=held)
    weight = torch.tensor(1.0, dtype=held)
    values = [float(weight.to(dtype))]
    for _ in range(n):
        weight = weight + step
        values.append(float(weight.to(dtype)))
    return values


def bit_string(value: float, dtype: torch.dtype) -> str:
    """``value`` stored in ``dtype``, as its bits: ``sign exponent mantissa``.

    For the 16- and 32-bit formats (and float64): e.g. ``bit_string(1.0,
    torch.bfloat16)`` is ``"0 01111111 0000000"``.
    """
    integer = {16: torch.int16, 32: torch.int32, 64: torch.int64}
    fmt = float_format(dtype)
    if fmt.bits not in integer:
        raise ValueError(f"dtype must be a 16-, 32- or 64-bit format, got {dtype!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"value must be a number, got {value!r}")
    raw = int(torch.tensor(value, dtype=dtype).view(integer[fmt.bits]))
    bits = format(raw & ((1 << fmt.bits) - 1), f"0{fmt.bits}b")
    return f"{bits[0]} {bits[1 : 1 + fmt.exponent_bits]} {bits[1 + fmt.exponent_bits :]}"
