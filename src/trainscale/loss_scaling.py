"""Dynamic loss scaling for fp16 training (chapter 12).

fp16 stores nothing below 2**-24: a gradient smaller than half of that is
rounded to zero. Multiplying the loss by a *scale* multiplies every gradient by
the same factor (the chain rule is linear), which lifts small gradients into
range; the optimiser divides the factor out again, in fp32, before it updates
the weights. Too large a factor pushes the largest gradients past 65504, where
fp16 overflows to infinity.

:class:`DynamicLossScaler` finds a good factor by itself, with the rule of
:func:`next_scale`: start high; when any gradient is ``inf`` or ``nan``, skip
the step and halve the factor; after ``growth_interval`` good steps in a row,
double it. It has the same methods as ``torch.amp.GradScaler`` (``scale``,
``unscale_``, ``step``, ``update``, ``get_scale``), so one training loop,
:func:`fp16_train_step`, drives either, and chapter 12 checks that they agree
step by step.

:func:`fp16_forward` runs a model as fp16 mixed precision does, emulated so
that every CPU gets the same bits: fp16 inputs, weights and outputs, with the
products added up in float64. What PyTorch's own fp16 kernels compute on a CPU
depends on its instruction set (fp16 GELU, for one, differs between torch's
AVX2 and default kernels), which moves a few gradients across the underflow
threshold.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainscale import _checks

FP32_MAX = float(torch.finfo(torch.float32).max)
"""The largest finite fp32 number: the scale is an fp32 number in GradScaler too."""


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 number (``inf`` beyond fp32's range)."""
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def _check_rule(growth_factor: float, backoff_factor: float, growth_interval: int) -> int:
    """Validate the rule's constants as ``GradScaler`` does; return the interval."""
    if _checks.positive("growth_factor", growth_factor) <= 1.0:
        raise ValueError(f"growth_factor must be a finite number > 1, got {growth_factor!r}")
    if _checks.positive("backoff_factor", backoff_factor) >= 1.0:
        raise ValueError(f"backoff_factor must be a number in (0, 1), got {backoff_factor!r}")
    return _checks.count("growth_interval", growth_interval, minimum=1)


def next_scale(
    scale: float,
    good_steps: int,
    found_inf: bool,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> tuple[float, int]:
    """One update of the loss scale: returns ``(new scale, new count of good steps)``.

    ``found_inf`` says whether this step's gradients held an ``inf`` or ``nan``
    (the step was then skipped). If so the scale is multiplied by
    ``backoff_factor`` and the count restarts at 0. Otherwise the count grows by
    one; when it reaches ``growth_interval`` the scale is multiplied by
    ``growth_factor`` and the count restarts. The scale is an fp32 number, as in
    ``torch.amp.GradScaler``: each product is rounded to fp32, and a growth that
    would overflow fp32 is dropped (the count still restarts).
    """
    current = _checks.positive("scale", scale)
    count = _checks.count("good_steps", good_steps)
    interval = _check_rule(growth_factor, backoff_factor, growth_interval)
    found = _checks.boolean(
        "found_inf", bool(found_inf) if isinstance(found_inf, np.bool_) else found_inf
    )
    if found:
        return _fp32(current * backoff_factor), 0
    if count + 1 < interval:
        return current, count + 1
    grown = _fp32(current * growth_factor)
    return (grown if math.isfinite(grown) else current), 0


class DynamicLossScaler:
    """A dynamic loss scaler with the methods of ``torch.amp.GradScaler``.

    Per step: ``scaler.scale(loss).backward()``, then ``scaler.step(optimizer)``
    (divides the gradients by the scale, in place, and runs the optimiser
    unless a gradient is ``inf`` or ``nan``), then ``scaler.update()``
    (applies :func:`next_scale`). GradScaler's defaults: start at 2**16, double
    after 2000 good steps, halve on every overflow.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
    ) -> None:
        self.growth_interval = _check_rule(growth_factor, backoff_factor, growth_interval)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        start = _fp32(_checks.positive("init_scale", init_scale, maximum=FP32_MAX))
        if start == 0.0:
            raise ValueError(
                f"init_scale must be at least fp32's smallest number, got {init_scale!r}"
            )
        self._scale = start
        self.good_steps = 0
        self._found_inf: bool | None = None  # set by unscale_, consumed by update

    def get_scale(self) -> float:
        """The current loss scale."""
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the scale (an fp32 multiplication, as GradScaler's)."""
        return loss * torch.tensor(self._scale, dtype=torch.float32, device=loss.device)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide every gradient of ``optimizer``'s parameters by the scale, in place.

        Returns whether any gradient holds an ``inf`` or ``nan``; the step
        must then be skipped. Call it at most once per step (``step`` calls it
        if you did not, e.g. to clip the unscaled gradients first).
        """
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called since the last update()")
        inverse = torch.tensor(1.0 / self._scale, dtype=torch.float64).float()
        found = False
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    found = found or not bool(torch.isfinite(param.grad).all())
                    param.grad.mul_(inverse.to(param.grad.device))
        self._found_inf = found
        return found

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale (if not done yet) and run ``optimizer.step()`` unless a gradient
        overflowed. Returns whether the optimiser stepped."""
        found = self._found_inf if self._found_inf is not None else self.unscale_(optimizer)
        if not found:
            optimizer.step()
        return not found

    def update(self) -> None:
        """Apply :func:`next_scale` with what ``unscale_`` found; ready the next step."""
        if self._found_inf is None:
            raise RuntimeError("update() needs a step() or unscale_() first")
        scale, self.good_steps = next_scale(
            self._scale,
            self.good_steps,
            self._found_inf,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
        )
        self._found_inf = None
        if scale == 0.0:
            raise RuntimeError(
                "the loss scale fell to 0: every recent step overflowed, so the loss"
                " itself is probably inf or nan"
            )
        self._scale = scale


@dataclass(frozen=True)
class StepRecord:
    """One step of fp16 training: the ``scale`` it used, whether the optimiser
    was ``skipped``, the (unscaled) ``loss``, and ``zero_share``, the share of
    all gradient entries that came out exactly 0 (underflowed, in practice)."""

    scale: float
    skipped: bool
    loss: float
    zero_share: float


def _fp16_linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` on fp16-rounded input, weight and bias, the products added up
    in float64, the result rounded to fp16."""
    bias = None if layer.bias is None else layer.bias.half().double()
    return F.linear(x.half().double(), layer.weight.half().double(), bias).half()


def _fp16_gelu(layer: nn.GELU, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` computed in float64 and rounded to fp16."""
    return F.gelu(x.double(), approximate=layer.approximate).half()


def fp16_forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model(x)`` as fp16 mixed precision computes it, the same on every CPU.

    An exact emulation of fp16 storage with higher-precision accumulation, which
    is what GPU tensor cores do (they add up fp16 products in fp32): each
    ``nn.Linear`` takes its input, weight and bias rounded to fp16, adds up the
    products in float64 and rounds its output to fp16; each ``nn.GELU`` is
    computed in float64 and rounded to fp16. The products of two fp16 numbers
    are exact in float64 and their sums very nearly so, so rounding to fp16
    gives the same bits on every CPU, whereas the gradients of
    ``torch.autocast``'s fp16 CPU kernels differ between torch's AVX2 and
    default kernels (a few more or fewer underflow to 0).

    Backward goes through the same casts, so every gradient is rounded to fp16
    at every layer boundary (where it can underflow to 0 or overflow to
    ``inf``), and the weights' gradients arrive in the weights' dtype holding
    fp16 values. ``model`` may hold ``nn.Sequential``, ``nn.Linear`` and
    ``nn.GELU`` modules (the book's :func:`trainscale.memory.mlp_stack`);
    anything else raises ``ValueError``.
    """
    if isinstance(model, nn.Sequential):
        for layer in model:
            x = fp16_forward(layer, x)
        return x
    if isinstance(model, nn.Linear):
        return _fp16_linear(model, x)
    if isinstance(model, nn.GELU):
        return _fp16_gelu(model, x)
    raise ValueError(
        "model must be built of nn.Sequential, nn.Linear and nn.GELU modules,"
        f" got {type(model).__name__}"
    )


def fp16_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: DynamicLossScaler | torch.amp.GradScaler,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.mse_loss,
) -> StepRecord:
    """One mixed-precision step with loss scaling, the recipe of ``torch.amp``.

    The model keeps its weights in fp32 (they are the master copy); the forward
    pass is :func:`fp16_forward`, so activations and the gradients flowing back
    through them are fp16 and can underflow or overflow, and each weight
    gradient arrives in fp32 holding an fp16 value. The loss is computed in
    fp32. ``scaler`` is a :class:`DynamicLossScaler` or a ``torch.amp.GradScaler``.
    """
    output = fp16_forward(model, x)
    loss = loss_fn(output.float(), y)
    optimizer.zero_grad(set_to_none=True)
    used = float(scaler.get_scale())
    scaler.scale(loss).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    zeros = sum(int((g == 0).sum()) for g in grads) / max(1, sum(g.numel() for g in grads))
    scaler.step(optimizer)
    scaler.update()
    skipped = float(scaler.get_scale()) < used  # a skipped step always lowers the scale
    return StepRecord(scale=used, skipped=skipped, loss=float(loss.detach()), zero_share=zeros)


def fp16_gradients(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    scale: float = 1.0,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.mse_loss,
) -> dict[str, torch.Tensor]:
    """The gradient of ``scale * loss``, computed as fp16 mixed precision computes it.

    The forward pass is :func:`fp16_forward`; the gradients are returned still
    multiplied by ``scale``, as backward left them: an entry that is 0
    underflowed somewhere in fp16, one that is ``inf`` or ``nan`` overflowed.
    Uses ``torch.autograd.grad``: ``.grad`` is left alone.
    """
    factor = _checks.positive("scale", scale)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    output = fp16_forward(model, x)
    loss = loss_fn(output.float(), y) * torch.tensor(factor, dtype=torch.float32)
    grads = torch.autograd.grad(loss, [p for _, p in named])
    return {name: g for (name, _), g in zip(named, grads, strict=True)}


def synthetic_gradients(
    count: int = 100_000, mean_log10: float = -7.0, std_log10: float = 1.5, seed: int = 0
) -> torch.Tensor:
    """``count`` seeded gradient magnitudes whose base-10 logarithm is normal.

    A stand-in for the spread of gradients in a deep network: with the
    defaults, the middle 95 % lie between 10**-10 and 10**-4. Returned in
    float64, so that no rounding happens before the fp16 cast being studied.
    The global random state is left alone.
    """
    n = _checks.count("count", count, minimum=1)
    spread = _checks.positive("std_log10", std_log10)
    if isinstance(mean_log10, bool) or not isinstance(mean_log10, int | float):
        raise ValueError(f"mean_log10 must be a number, got {mean_log10!r}")
    if not -300.0 <= float(mean_log10) <= 300.0:
        raise ValueError(f"mean_log10 must be a number in [-300, 300], got {mean_log10!r}")
    generator = torch.Generator().manual_seed(_checks.count("seed", seed))
    logs = torch.randn(n, generator=generator, dtype=torch.float64) * spread + float(mean_log10)
    return torch.pow(10.0, logs)
