"""What 16- and 8-bit numbers can and cannot hold (chapter 12).

fp16 has 10 stored mantissa bits but only 5 exponent bits: small gradients
round to zero and large ones to infinity. bf16 keeps fp32's 8 exponent bits
but only 7 mantissa bits: it has the range but not the precision. The two fp8
formats (e4m3 and e5m2) have neither, so a tensor is multiplied by a scale before
it is cast (:func:`scaled_cast`, :func:`amax_scale`, :func:`delayed_scales`).
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

    For the 8-, 16- and 32-bit formats (and float64): e.g. ``bit_string(1.0,
    torch.bfloat16)`` is ``"0 01111111 0000000"``.
    """
    integer = {8: torch.int8, 16: torch.int16, 32: torch.int32, 64: torch.int64}
    fmt = float_format(dtype)
    if fmt.bits not in integer:
        raise ValueError(f"dtype must be an 8-, 16-, 32- or 64-bit format, got {dtype!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"value must be a number, got {value!r}")
    raw = int(torch.tensor(value, dtype=dtype).view(integer[fmt.bits]))
    bits = format(raw & ((1 << fmt.bits) - 1), f"0{fmt.bits}b")
    return f"{bits[0]} {bits[1 : 1 + fmt.exponent_bits]} {bits[1 + fmt.exponent_bits :]}"


# --- fp8: casting with a scale ---------------------------------------------------------

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""The two fp8 formats of H100-class GPUs (Micikevicius et al., 2022): e4m3 (4 exponent
bits, 3 mantissa bits, no infinities: the ``fn`` is for finite) and e5m2 (IEEE-like)."""


def _fp8_dtype(dtype: object) -> torch.dtype:
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype!r}")
    return dtype  # type: ignore[return-value]


def _float64_values(values: Iterable[float] | torch.Tensor) -> torch.Tensor:
    """``values`` as a flat float64 tensor of finite numbers, at least one."""
    if isinstance(values, torch.Tensor):
        flat = values.detach().to(torch.float64).cpu().flatten()
    else:
        flat = torch.tensor(list(values), dtype=torch.float64)
    if flat.numel() == 0:
        raise ValueError("values must hold at least one number, got none")
    if not np.isfinite(flat.numpy()).all():
        raise ValueError("values must all be finite")
    return flat


def _scaled_fp32(exact: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 ``exact * scale``, rounded once to fp32."""
    return (exact * scale).float()


def quantize(
    values: Iterable[float] | torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> torch.Tensor:
    """``values * scale`` stored in the fp8 ``dtype``, as an fp8 tensor (flattened).

    The product is formed in float64 and rounded once to fp32 (what a GPU kernel holds
    before the cast), then clipped to the format's largest magnitude (saturated, as
    Transformer Engine does; PyTorch's own cast clips e4m3, which has no infinity, but
    sends e5m2 to infinity) and rounded to nearest, ties to even, by PyTorch's cast.
    Divide by ``scale`` to read the values back (:func:`scaled_cast`).
    """
    fp8 = _fp8_dtype(dtype)
    factor = _checks.positive("scale", scale)
    largest = float(torch.finfo(fp8).max)
    return _scaled_fp32(_float64_values(values), factor).clamp(-largest, largest).to(fp8)


@dataclass(frozen=True)
class ScaledCast:
    """What storing a tensor in fp8 with a scale loses.

    ``underflowed``: share of all values that were non-zero and became 0;
    ``saturated``: share whose scaled magnitude exceeded the largest fp8 number and
    was clipped to it; ``relative_error``: ``||x' - x|| / ||x||`` (2-norms), ``x'``
    the values read back (the fp8 values divided by the scale).
    """

    underflowed: float
    saturated: float
    relative_error: float


def scaled_cast(
    values: Iterable[float] | torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> ScaledCast:
    """Store ``values * scale`` in ``dtype`` (:func:`quantize`) and count what was lost."""
    fp8 = _fp8_dtype(dtype)
    factor = _checks.positive("scale", scale)
    exact = _float64_values(values)
    scaled = _scaled_fp32(exact, factor)
    largest = float(torch.finfo(fp8).max)
    stored = scaled.clamp(-largest, largest).to(fp8).to(torch.float64)
    underflowed = int(((exact != 0) & (stored == 0)).sum())
    saturated = int((scaled.abs() > largest).sum())
    return ScaledCast(
        underflowed=underflowed / exact.numel(),
        saturated=saturated / exact.numel(),
        relative_error=relative_error(stored / factor, exact),
    )


def _norm(values: torch.Tensor) -> float:
    """The 2-norm of float64 ``values``, its sum of squares correctly rounded
    (``math.fsum``), so that the result does not depend on the CPU's summation order."""
    return math.sqrt(math.fsum((values * values).tolist()))


def relative_error(approximate: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approximate - exact|| / ||exact||`` (2-norms, in float64); 0 if ``exact`` is 0.

    Both tensors are read as float64 and must have the same number of elements.
    """
    rough = approximate.detach().to(torch.float64).cpu().flatten()
    true = exact.detach().to(torch.float64).cpu().flatten()
    if rough.numel() != true.numel():
        raise ValueError(
            f"approximate must have as many elements as exact ({true.numel()}), got {rough.numel()}"
        )
    norm = _norm(true)
    return _norm(rough - true) / norm if norm > 0 else 0.0


def amax_scale(amax: float, dtype: torch.dtype, margin: int = 0) -> float:
    """The per-tensor scale that maps ``amax`` (the largest magnitude) to the format's
    largest number, divided by ``2**margin``: ``largest / amax / 2**margin``.

    Transformer Engine's rule for its scaling factor; with ``margin`` 0 nothing
    saturates, a larger margin leaves headroom for values that grow before the scale
    is next updated.
    """
    fp8 = _fp8_dtype(dtype)
    peak = _checks.positive("amax", amax)
    headroom = _checks.count("margin", margin)
    return float(torch.finfo(fp8).max) / peak / 2.0**headroom


AMAX_HISTORY_LEN = 1024
"""Transformer Engine's default ``amax_history_len`` for ``DelayedScaling``: the steps
whose amaxes a delayed scale is computed from."""


def delayed_scales(
    amaxes: Iterable[float],
    dtype: torch.dtype,
    history_len: int = AMAX_HISTORY_LEN,
    margin: int = 0,
) -> list[float]:
    """The scale each step of a run uses under delayed scaling.

    ``amaxes`` is the largest magnitude a tensor has at each step. Delayed scaling does
    not read the tensor before casting it: step ``t`` uses :func:`amax_scale` of the
    largest amax recorded in the previous ``history_len`` steps (Transformer Engine's
    ``DelayedScaling`` with ``amax_compute_algo="max"``; its defaults are a history of
    1024 steps and margin 0), and records its own amax afterwards. The first step,
    with no history yet, uses a scale of 1.
    """
    fp8 = _fp8_dtype(dtype)
    history = [_checks.positive("amaxes", a) for a in amaxes]
    window = _checks.count("history_len", history_len, minimum=1)
    headroom = _checks.count("margin", margin)
    scales = []
    for step in range(len(history)):
        seen = history[max(0, step - window) : step]
        scales.append(amax_scale(max(seen), fp8, headroom) if seen else 1.0)
    return scales
