"""Sharding the model state: ZeRO's stages and FSDP, counted in one process (chapter 05).

:mod:`trainscale.memory` counts the bytes a GPU holds at each ZeRO stage. This
module adds what chapter 05 needs on top of that:

* bytes per parameter and communication of each stage, per run of each
  collective and per step of ``k`` micro-batches, relative to plain data
  parallelism (:data:`ZERO_COLLECTIVES`, :func:`bytes_per_param`,
  :func:`zero_collective_bytes`, :func:`zero_traffic`); the planner of chapter 13
  takes its data-parallel bytes from here;
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
from trainscale.collectives import ring_factor
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


@dataclass(frozen=True)
class ZeroCollective:
    """One collective a ZeRO stage runs: its ``name``, ring ``kind`` (``"all-reduce"``,
    ``"reduce-scatter"`` or ``"all-gather"``), whether it carries ``"gradients"`` or
    ``"weights"``, whether it runs after every micro-batch (``per_micro_batch``) or once
    per step, and the compute it can hide under (``hides_under``: ``"forward"`` or
    ``"backward"``, which the planner of chapter 13 uses)."""

    name: str
    kind: str
    carries: str
    per_micro_batch: bool
    hides_under: str


ZERO_COLLECTIVES: dict[int, tuple[ZeroCollective, ...]] = {
    0: (ZeroCollective("all-reduce of gradients", "all-reduce", "gradients", False, "backward"),),
    1: (
        ZeroCollective(
            "reduce-scatter of gradients", "reduce-scatter", "gradients", False, "backward"
        ),
        ZeroCollective("all-gather of updated weights", "all-gather", "weights", False, "forward"),
    ),
    2: (
        ZeroCollective(
            "reduce-scatter of gradients", "reduce-scatter", "gradients", True, "backward"
        ),
        ZeroCollective("all-gather of updated weights", "all-gather", "weights", False, "forward"),
    ),
    3: (
        ZeroCollective("all-gather of weights, forward", "all-gather", "weights", True, "forward"),
        ZeroCollective(
            "all-gather of weights, backward", "all-gather", "weights", True, "backward"
        ),
        ZeroCollective(
            "reduce-scatter of gradients", "reduce-scatter", "gradients", True, "backward"
        ),
    ),
}
"""The collectives of one training step at each ZeRO stage, with ``k`` micro-batches
(gradient accumulation):

* DDP (stage 0, with ``no_sync`` while accumulating) all-reduces the summed gradients
  once per step;
* ZeRO-1 keeps whole gradients until the last micro-batch, then reduce-scatters them
  and all-gathers the updated weights: once per step, the same volume as DDP;
* ZeRO-2 keeps only its shard of the gradients, so it must reduce-scatter after
  *every* micro-batch: ``k`` reduce-scatters and one all-gather;
* ZeRO-3 keeps only shards of the weights too: it all-gathers them before every
  forward and every backward and reduce-scatters the gradients, every micro-batch:
  ``k x (2 all-gathers + 1 reduce-scatter)``."""


def _stage(zero_stage: object) -> int:
    return int(_checks.choice("zero_stage", zero_stage, tuple(STAGE_NAMES)))  # type: ignore[call-overload]


def zero_collective_bytes(
    params: float,
    gpus: int,
    zero_stage: int,
    bytes_per_value: int = 2,
    bytes_per_gradient: int | None = None,
) -> dict[str, int]:
    """Bytes one GPU sends in ONE run of each collective of a ZeRO stage.

    Ring algorithms (chapter 04) over ``gpus`` GPUs on ``params`` values sharded into
    ``gpus`` equal shards of ``ceil(params / gpus)`` (padded, as ZeRO and FSDP pad):
    each GPU sends :func:`trainscale.collectives.ring_factor` of the padded tensor,
    ``gpus - 1`` shards per pass. ``bytes_per_value`` is the size of a weight (2 for
    bf16); ``bytes_per_gradient`` that of a gradient element as communicated (defaults
    to ``bytes_per_value``; 4 if gradients are reduced in fp32). Keys: the names of
    :data:`ZERO_COLLECTIVES` for the stage.
    """
    n = _checks.count("params", params)
    n_gpus = _checks.count("gpus", gpus, minimum=1)
    stage = _stage(zero_stage)
    weight_size = _checks.count("bytes_per_value", bytes_per_value, minimum=1)
    gradient_size = (
        weight_size
        if bytes_per_gradient is None
        else _checks.count("bytes_per_gradient", bytes_per_gradient, minimum=1)
    )
    padded = n_gpus * math.ceil(n / n_gpus)
    sizes = {"weights": weight_size, "gradients": gradient_size}
    return {
        c.name: round(ring_factor(n_gpus, c.kind) * padded * sizes[c.carries])
        for c in ZERO_COLLECTIVES[stage]
    }


def zero_traffic(
    params: float,
    gpus: int,
    zero_stage: int,
    bytes_per_value: int = 2,
    micro_batches: int = 1,
    bytes_per_gradient: int | None = None,
) -> dict[str, int]:
    """Bytes one GPU sends in one training step of ``micro_batches`` micro-batches.

    Each collective of :data:`ZERO_COLLECTIVES` costs what :func:`zero_collective_bytes`
    says per run, times ``micro_batches`` if it runs after every micro-batch. With
    one micro-batch, stage 0 (DDP) all-reduces the gradients; stages 1 and 2
    reduce-scatter them and all-gather the updated weights (the same volume); stage 3
    all-gathers the weights twice (forward and backward) and reduce-scatters the
    gradients: one pass more, 1.5 times DDP. With ``k`` micro-batches DDP and ZeRO-1
    still send that once per step, ZeRO-2 sends ``k`` reduce-scatters and ZeRO-3
    ``k`` times everything.
    """
    runs = zero_collective_bytes(params, gpus, zero_stage, bytes_per_value, bytes_per_gradient)
    k = _checks.count("micro_batches", micro_batches, minimum=1)
    return {
        c.name: runs[c.name] * (k if c.per_micro_batch else 1)
        for c in ZERO_COLLECTIVES[_stage(zero_stage)]
    }


def _passes(stage: int, micro_batches: int) -> int:
    """Ring passes over the whole tensor in one step: 1 for RS or AG, 2 for an all-reduce."""
    return sum(
        (2 if c.kind == "all-reduce" else 1) * (micro_batches if c.per_micro_batch else 1)
        for c in ZERO_COLLECTIVES[stage]
    )


def traffic_relative_to_ddp(zero_stage: int, micro_batches: int = 1) -> float:
    """A stage's communication per step divided by DDP's.

    With one micro-batch: 1, 1, 1 and 1.5. With ``k`` micro-batches: 1, 1,
    ``(k + 1) / 2`` and ``3 k / 2``. The ratio of ring passes, the same for any model
    size and number of GPUs (with one GPU nothing is sent at all, but the ratio of
    the work is the same).
    """
    stage = _stage(zero_stage)
    k = _checks.count("micro_batches", micro_batches, minimum=1)
    return _passes(stage, k) / _passes(0, k)


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
    _checks.boolean("prefetch", prefetch)
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
