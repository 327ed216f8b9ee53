"""Argument checks shared by every module.

Each check returns the value in a clean form (an ``int`` or a ``float``) or
raises ``ValueError`` naming the argument and the range it must lie in, so a
reader who passes a wrong value learns at once what the function expects.
"""

from __future__ import annotations

import math
import numbers


def count(name: str, value: object, minimum: int = 0) -> int:
    """Return ``value`` as an ``int`` if it is a whole number ``>= minimum``.

    Floats with no fractional part (``7e9``) are accepted because readers
    write large counts that way; ``True``/``False`` are not counts.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    if isinstance(value, numbers.Integral):
        number = int(value)
    else:
        as_float = float(value)
        if not math.isfinite(as_float) or not as_float.is_integer():
            raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
        number = int(as_float)
    if number < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return number


def positive(name: str, value: object, *, maximum: float | None = None) -> float:
    """Return ``value`` as a finite ``float`` in ``(0, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    number = float(value)
    upper = "" if maximum is None else f" and <= {maximum:g}"
    if not math.isfinite(number) or number <= 0 or (maximum is not None and number > maximum):
        raise ValueError(f"{name} must be a finite number > 0{upper}, got {value!r}")
    return number


def fraction(name: str, value: object) -> float:
    """Return ``value`` as a ``float`` in ``[0, 1]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    number = float(value)
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return number


def choice(name: str, value: object, allowed: tuple[object, ...]) -> object:
    """Return ``value`` if it is one of ``allowed``."""
    if isinstance(value, bool) or value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def boolean(name: str, value: object) -> bool:
    """Return ``value`` if it is ``True`` or ``False`` (not ``0``, ``1`` or ``None``)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def non_negative(name: str, value: object) -> float:
    """Return ``value`` as a finite ``float`` ``>= 0``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number
