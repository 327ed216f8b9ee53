"""The parallelisms simulated in one process (chapters 03, 06, 07 and 09).

Each function computes, on one CPU, what a group of GPUs would compute
together, so its result can be compared with the plain single-device answer.
Gradients are returned as a dict ``{parameter name: gradient}`` and computed
with ``torch.autograd.grad``: the model's ``.grad`` fields are left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from trainscale import _checks
from trainscale.memory import run_checkpointed

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A loss that averages over the batch, such as ``nn.functional.mse_loss``."""


def _gradient(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, forward=None
) -> dict[str, torch.Tensor]:
    """Gradient of ``loss_fn(model(x), y)`` for every trainable parameter."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    output = forward(model, x) if forward else model(x)
    grads = torch.autograd.grad(loss_fn(output, y), [p for _, p in named])
    return {name: g for (name, _), g in zip(named, grads, strict=True)}


def full_batch_gradient(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The reference: the gradient of the mean loss over the whole batch on one device."""
    return _gradient(model, loss_fn, x, y)


def _sliced_gradient(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, slices: int, name: str
) -> dict[str, torch.Tensor]:
    """Sum of per-slice gradients, each weighted by its share of the batch."""
    n = _checks.count(name, slices, minimum=1)
    batch = x.shape[0]
    if n > batch:
        raise ValueError(f"{name} must be between 1 and the batch size {batch}, got {slices}")
    total: dict[str, torch.Tensor] = {}
    for xs, ys in zip(torch.tensor_split(x, n), torch.tensor_split(y, n), strict=True):
        weight = xs.shape[0] / batch
        for key, grad in _gradient(model, loss_fn, xs, ys).items():
            total[key] = total[key] + weight * grad if key in total else weight * grad
    return total


def data_parallel_gradient(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    replicas: int,
    weighted: bool = True,
) -> dict[str, torch.Tensor]:
    """What ``replicas`` data-parallel GPUs agree on after their all-reduce.

    The batch is cut into ``replicas`` slices (unequal when the batch size is
    not divisible); each replica computes the gradient of the mean loss on its
    slice. ``weighted=True`` weights each slice by its share of the batch,
    which equals the full-batch gradient for any slicing. ``weighted=False``
    takes the plain mean, as DDP's all-reduce does: correct only for equal slices.
    """
    if weighted:
        return _sliced_gradient(model, loss_fn, x, y, replicas, "replicas")
    n = _checks.count("replicas", replicas, minimum=1)
    if n > x.shape[0]:
        raise ValueError(f"replicas must be between 1 and the batch size {x.shape[0]}, got {n}")
    per_replica = [
        _gradient(model, loss_fn, xs, ys)
        for xs, ys in zip(torch.tensor_split(x, n), torch.tensor_split(y, n), strict=True)
    ]
    return {key: sum(g[key] for g in per_replica) / n for key in per_replica[0]}


def accumulated_gradient(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, micro_batches: int
) -> dict[str, torch.Tensor]:
    """Gradient accumulation on one device: ``micro_batches`` passes, one step.

    Each micro-batch's loss is scaled by its share of the batch (``1 / micro_batches``
    when they are equal) before its gradient is added, so the sum equals the
    full-batch gradient while only one micro-batch's activations are alive at a time.
    """
    return _sliced_gradient(model, loss_fn, x, y, micro_batches, "micro_batches")


def checkpointed_gradient(
    model: nn.Sequential, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, segment: int = 1
) -> dict[str, torch.Tensor]:
    """The full-batch gradient with activation checkpointing every ``segment`` blocks."""
    return _gradient(model, loss_fn, x, y, lambda m, inp: run_checkpointed(m, inp, segment))


def tensor_parallel_mlp(
    x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, shards: int
) -> torch.Tensor:
    """Megatron's MLP ``gelu(x @ w1) @ w2`` split over ``shards`` devices.

    ``w1`` (``d x h``) is split by columns and ``w2`` (``h x d``) by the
    matching rows. Device ``i`` computes ``gelu(x @ w1[:, cols_i]) @ w2[cols_i, :]``
    with no communication: GELU acts element by element, so each device can
    apply it to its own slice of the hidden layer. The partial outputs are then
    summed, which is the one all-reduce of the forward pass.
    """
    n = _checks.count("shards", shards, minimum=1)
    if x.shape[-1] != w1.shape[0] or w1.shape[1] != w2.shape[0]:
        raise ValueError(
            f"shapes do not chain: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}"
        )
    column_blocks = torch.tensor_split(w1, n, dim=1)
    row_blocks = torch.tensor_split(w2, n, dim=0)
    partials = [
        nn.functional.gelu(x @ a) @ b for a, b in zip(column_blocks, row_blocks, strict=True)
    ]
    return torch.stack(partials).sum(dim=0)


def pipeline_bubble(stages: int, micro_batches: int) -> float:
    """Idle share of a GPipe schedule: ``(K - 1) / (M + K - 1)``.

    With ``K`` stages and ``M`` micro-batches the pipeline needs ``M + K - 1``
    time slots per pass; each stage is busy in ``M`` of them.
    """
    k = _checks.count("stages", stages, minimum=1)
    m = _checks.count("micro_batches", micro_batches, minimum=1)
    return (k - 1) / (m + k - 1)
