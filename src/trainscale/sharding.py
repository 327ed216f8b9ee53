"""Sharding the model state: ZeRO's stages and FSDP, counted in one process (chapter 05).

:mod:`trainscale.memory` counts the bytes a GPU holds at each ZeRO stage. This
module adds what chapter 05 needs on top of that:

* bytes per parameter and communication per step of each stage, relative to
  plain data parallelism (:func:`bytes_per_param`, :func:`zero_traffic`);
* how FSDP2 (``torch.distributed.fsdp.fully_shard``) really cuts each tensor:
  along its first dimension, in ``ceil(rows / N)``-row chunks, the last ranks
  getting fewer rows or none (:func:`fsdp_shard_rows`, :func:`fsdp_state_bytes`);
* the layer-by-layer order in which FSDP gathers, frees and reduce-scatters,
  as a list of moments (:func:`fsdp_moments`) and as the sequence of
  collectives it issues (:func:`fsdp_collectives`), which the chapter compares
  with a real run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from trainscale import _checks
from trainscale.memory import BYTES_PER_PARAM, SHARDED_FROM_STAGE

STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 / FSDP"}
"""What each ZeRO stage is called; stage 0 is plain data parallelism (DDP)."""

FP32_ADAM_BYTES_PER_PARAM: dict[str, int] = {
    "weights": 4,  # fp32: forward, backward and the optimiser all use this copy
    "gradients": 4,
    "Adam momentum": 4,
    "Adam variance": 4,
}
"""Bytes per parameter of plain fp32 training with Adam: 16, like bf16 mixed precision
(:data:`trainscale.memory.BYTES_PER_PARAM`), but with no separate master copy and
gradients twice as large."""

_PASSES: dict[int, dict[str, int]] = {
    0: {"all-reduce of gradients": 2},
    1: {"reduce-scatter of gradients": 1, "all-gather of updated weights": 1},
    2: {"reduce-scatter of gradients": 1, "all-gather of updated weights": 1},
    3: {
        "all-gather of weights, forward": 1,
        "all-gather of weights, backward": 1,
        "reduce-scatter of gradients": 1,
    },
}
"""The collectives of one step at each stage, counted in ring passes: a reduce-scatter
or an all-gather is one pass over the tensor, an all-reduce is both (two passes)."""


def bytes_per_param(gpus: int, zero_stage: int) -> float:
    """Model-state bytes per parameter on each GPU (bf16 mixed precision with Adam).

    A part sharded at this stage costs its bytes divided by ``gpus``; the others
    cost their full bytes. On 8 GPUs: 16, 5.5, 3.75 and 2 for stages 0 to 3.
    Unlike :func:`trainscale.memory.model_state_bytes` this ignores the rounding
    of shards to whole parameters, so it is exact for counts divisible by ``gpus``.
    """
    n = _checks.count("gpus", gpus, minimum=1)
    stage = _checks.choice("zero_stage", zero_stage, tuple(STAGE_NAMES))
    return sum(
        size / n if stage >= SHARDED_FROM_STAGE[part] else size
        for part, size in BYTES_PER_PARAM.items()
    )


def zero_traffic(
    params: float, gpus: int, zero_stage: int, bytes_per_value: int = 2
) -> dict[str, int]:
    """Bytes one GPU sends in one training step, collective by collective.

    Ring algorithms (chapter 4): a reduce-scatter or an all-gather of ``params``
    values over ``gpus`` GPUs moves ``gpus - 1`` shards of ``ceil(params / gpus)``
    values out of each GPU; an all-reduce is one of each. ``bytes_per_value`` is 2
    for bf16 gradients and weights. Stage 0 (DDP) all-reduces the gradients;
    stages 1 and 2 reduce-scatter them and all-gather the updated weights (the same
    volume); stage 3 all-gathers the weights twice (forward and backward) and
    reduce-scatters the gradients: one pass more, 1.5 times DDP.
    """
    n = _checks.count("params", params)
    n_gpus = _checks.count("gpus", gpus, minimum=1)
    stage = _checks.choice("zero_stage", zero_stage, tuple(STAGE_NAMES))
    size = _checks.count("bytes_per_value", bytes_per_value, minimum=1)
    per_pass = (n_gpus - 1) * math.ceil(n / n_gpus) * size
    return {name: passes * per_pass for name, passes in _PASSES[stage].items()}


def traffic_relative_to_ddp(zero_stage: int) -> float:
    """A stage's communication per step divided by DDP's: 1, 1, 1 and 1.5.

    The ratio of ring passes, the same for any model size and number of GPUs
    (with one GPU nothing is sent at all, but the ratio of the work is the same).
    """
    stage = _checks.choice("zero_stage", zero_stage, tuple(STAGE_NAMES))
    return sum(_PASSES[stage].values()) / sum(_PASSES[0].values())


# --- How FSDP2 cuts a tensor -------------------------------------------------------


def fsdp_shard_rows(rows: int, world_size: int) -> list[int]:
    """Rows of a tensor's first dimension each rank holds under FSDP2.

    FSDP2 cuts dimension 0 the way ``torch.chunk`` does: chunks of
    ``ceil(rows / world_size)`` rows, so the last ranks get fewer rows, or none
    (10 rows on 4 ranks: 3, 3, 3, 1; 5 rows: 2, 2, 1, 0). Every rank still
    allocates a full chunk: the rest is padding.
    """
    r = _checks.count("rows", rows)
    n = _checks.count("world_size", world_size, minimum=1)
    chunk = math.ceil(r / n)
    return [max(0, min(chunk, r - rank * chunk)) for rank in range(n)]


def _shape(shape: Sequence[int]) -> tuple[int, ...]:
    if isinstance(shape, str | bytes) or not isinstance(shape, Sequence):
        raise ValueError(f"shape must be a sequence of whole numbers >= 0, got {shape!r}")
    return tuple(_checks.count("shape", d) for d in shape)


def fsdp_shard_numels(shape: Sequence[int], world_size: int) -> list[int]:
    """Elements of a tensor of ``shape`` that each rank holds under FSDP2 (no padding).

    A 0-dimensional tensor is treated as one row.
    """
    dims = _shape(shape) or (1,)
    rest = math.prod(dims[1:])
    return [rows * rest for rows in fsdp_shard_rows(dims[0], world_size)]


def fsdp_padded_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements every rank allocates for its shard of ``shape``: a full chunk of rows."""
    dims = _shape(shape) or (1,)
    n = _checks.count("world_size", world_size, minimum=1)
    return math.ceil(dims[0] / n) * math.prod(dims[1:])


def fsdp_state_bytes(
    shapes: Sequence[Sequence[int]],
    world_size: int,
    rank: int,
    bytes_per_param: dict[str, int] | None = None,
) -> dict[str, int]:
    """Bytes of each part of the model state that ``rank`` holds under FSDP2.

    ``shapes`` are the shapes of the model's parameters; each is sharded on its
    own, along dimension 0 (:func:`fsdp_shard_numels`). ``bytes_per_param``
    defaults to fp32 training with Adam (:data:`FP32_ADAM_BYTES_PER_PARAM`).
    The shards are counted without padding, as ``DTensor.to_local()`` shows them.
    """
    n = _checks.count("world_size", world_size, minimum=1)
    r = _checks.count("rank", rank)
    if r >= n:
        raise ValueError(f"rank must be between 0 and world_size - 1 = {n - 1}, got {rank}")
    sizes = FP32_ADAM_BYTES_PER_PARAM if bytes_per_param is None else bytes_per_param
    local = sum(fsdp_shard_numels(shape, n)[r] for shape in shapes)
    return {part: size * local for part, size in sizes.items()}


# --- One FSDP step, layer by layer ---------------------------------------------------


@dataclass(frozen=True)
class FsdpMoment:
    """One moment of an FSDP step: one layer computing, or the optimiser step.

    ``phase`` is ``"forward"``, ``"backward"`` or ``"optimiser"``; ``layer`` is
    the layer computing (``None`` for the optimiser step, where each rank updates
    its own shards and no layer is whole). ``whole`` holds the layers whose full
    weights are in memory during the moment (the computing one, plus in backward
    the one being prefetched). ``all_gathers`` are the layers whose all-gather is
    issued at this moment, before or during the compute; ``reduce_scatters`` the
    layers whose gradients are reduce-scattered right after it.
    """

    phase: str
    layer: int | None
    whole: frozenset[int]
    all_gathers: tuple[int, ...]
    reduce_scatters: tuple[int, ...]


def fsdp_moments(layers: int, prefetch: bool = True) -> list[FsdpMoment]:
    """The moments of one FSDP training step over ``layers`` sharded layers.

    Forward, layer by layer: all-gather the layer's shards, compute, free the
    gathered weights (the activations stay). Backward, from the last layer down:
    all-gather the layer again, compute its gradients, free it, reduce-scatter the
    gradients so each rank keeps the summed slice it owns. With ``prefetch``
    (FSDP2's default in backward) the all-gather of the next layer down is issued
    while the current one computes, so two layers are whole at once. Last, each
    rank updates its own shards. ``2 * layers + 1`` moments in all.
    """
    n = _checks.count("layers", layers, minimum=1)
    if not isinstance(prefetch, bool):
        raise ValueError(f"prefetch must be True or False, got {prefetch!r}")
    moments = [FsdpMoment("forward", i, frozenset({i}), (i,), ()) for i in range(n)]
    for i in reversed(range(n)):
        ahead = (i - 1,) if prefetch and i > 0 else ()
        # Without prefetch each layer is gathered when its turn comes; with it, only
        # the first layer of backward is, the others arrived during the previous moment.
        gathers = ((i,) if not prefetch or i == n - 1 else ()) + ahead
        moments.append(FsdpMoment("backward", i, frozenset({i, *ahead}), gathers, (i,)))
    moments.append(FsdpMoment("optimiser", None, frozenset(), (), ()))
    return moments


def fsdp_collectives(moments: Sequence[FsdpMoment]) -> list[tuple[str, int]]:
    """The collectives the moments issue, in order: ``("all-gather", layer)`` and
    ``("reduce-scatter", layer)``. Each moment issues its all-gathers first."""
    order: list[tuple[str, int]] = []
    for moment in moments:
        order += [("all-gather", layer) for layer in moment.all_gathers]
        order += [("reduce-scatter", layer) for layer in moment.reduce_scatters]
    return order
