"""Sharding the model state: ZeRO's stages and FSDP, counted in one process (chapter 7).

:mod:`trainscale.memory` counts the bytes a GPU holds at each ZeRO stage. This
module adds what chapter 7 needs on top of that:

* bytes per parameter and communication of each stage, per run of each
  collective and per step of ``k`` micro-batches (with sharded or whole gradients
  accumulated), relative to plain data parallelism (:data:`ZERO_COLLECTIVES`,
  :func:`bytes_per_param`, :func:`zero_collective_bytes`, :func:`zero_traffic`); the
  planner of chapter 16 takes its data-parallel bytes from here;
* how FSDP2 (``torch.distributed.fsdp.fully_shard``) really cuts each tensor:
  along its first dimension, in ``ceil(rows / N)``-row chunks, the last ranks
  getting fewer rows or none (:func:`fsdp_shard_rows`, :func:`fsdp_state_bytes`);
* the layer-by-layer order in which FSDP gathers, frees and reduce-scatters,
  as a list of moments (:func:`fsdp_moments`) and as the sequence of
  collectives it issues (:func:`fsdp_collectives`), which the chapter compares
  with a real run;
* the bytes a rank holds at each moment of an FSDP2 step: its shards plus the
  units alive whole at once, with prefetching (:func:`fsdp_memory_moments`,
  :func:`fsdp_peak`, for a decoder wrapped as torchtitan wraps it
  :func:`decoder_units`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from trainscale import _checks
from trainscale.collectives import ring_factor
from trainscale.memory import (
    BYTES_PER_PARAM,
    FP32_WEIGHTS_AND_GRADIENTS,
    SHARDED_FROM_STAGE,
    state_bytes_per_param,
)

STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3 / FSDP"}
"""What each ZeRO stage is called; stage 0 is plain data parallelism (DDP)."""

FP32_ADAM_BYTES_PER_PARAM: dict[str, int] = state_bytes_per_param(FP32_WEIGHTS_AND_GRADIENTS)
"""Bytes per parameter of plain fp32 training with Adam, as :mod:`trainscale.memory`
counts its ``FP32_WEIGHTS_AND_GRADIENTS`` recipe: 16, like bf16 mixed precision
(:data:`trainscale.memory.BYTES_PER_PARAM`), but with no separate master copy (the fp32
weights are the optimiser's copy) and gradients twice as large."""


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
    ``"backward"``, which the planner of chapter 16 uses)."""

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

    Ring algorithms (chapter 6) over ``gpus`` GPUs on ``params`` values sharded into
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
    keep_unsharded_gradients: bool = False,
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

    ``keep_unsharded_gradients=True`` accumulates whole gradients over the micro-batches
    and reduces them once, after the last one (FSDP2's ``set_requires_gradient_sync(False)``
    on the others, FSDP1's ``no_sync``): every gradient collective then runs once per
    step, at the price of a whole gradient per GPU (ZeRO-2's saving is gone). Stages 0
    and 1 already do so; stage 3 still gathers the weights twice per micro-batch.
    """
    runs = zero_collective_bytes(params, gpus, zero_stage, bytes_per_value, bytes_per_gradient)
    k = _checks.count("micro_batches", micro_batches, minimum=1)
    whole = _checks.boolean("keep_unsharded_gradients", keep_unsharded_gradients)
    return {
        c.name: runs[c.name]
        * (k if c.per_micro_batch and not (whole and c.carries == "gradients") else 1)
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
    gradients so each rank keeps the summed slice it owns. Last, each rank updates
    its own shards. ``2 * layers + 1`` moments in all.

    With ``prefetch`` the all-gather of the layer that comes next is in flight
    while the current one computes, so two layers are whole at once, in both
    passes: FSDP2's default on a GPU. In backward it prefetches explicitly (the
    layer's pre-backward issues the next layer's all-gather); in forward implicitly
    (the CPU issues the next all-gather after this layer's kernels, and it runs on
    its own stream while they do). The order of the collectives is the same either
    way. A CPU finishes each operation before issuing the next, so there forward
    overlaps only with ``set_modules_to_forward_prefetch`` (explicit prefetching).
    """
    n = _checks.count("layers", layers, minimum=1)
    _checks.boolean("prefetch", prefetch)
    moments = []
    for i in range(n):
        ahead = (i + 1,) if prefetch and i < n - 1 else ()
        # With prefetch, only the first layer is gathered at its own turn; every
        # other one arrived during the moment before.
        gathers = ((i,) if not prefetch or i == 0 else ()) + ahead
        moments.append(FsdpMoment("forward", i, frozenset({i, *ahead}), gathers, ()))
    for i in reversed(range(n)):
        ahead = (i - 1,) if prefetch and i > 0 else ()
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


# --- What one rank holds at each moment of an FSDP2 step -------------------------------


@dataclass(frozen=True)
class FsdpMemory:
    """Bytes one rank holds at one moment of an FSDP2 step, by what they are.

    ``phase`` is ``"forward"``, ``"backward"`` or ``"optimiser"`` and ``unit`` the
    unit computing (``None`` for the optimiser step). The sharded state:
    ``sharded_weights`` (the rank's padded shards), ``gradient_shards`` (the summed
    gradient slices reduce-scattered so far) and ``optimizer_state`` (Adam's moments of
    the rank's elements). The working memory, whole units: ``whole_weights`` (gathered
    weights and all-gather buffers) and ``whole_gradients`` (gradients of a whole unit
    and reduce-scatter buffers).
    """

    phase: str
    unit: int | None
    sharded_weights: int
    gradient_shards: int
    optimizer_state: int
    whole_weights: int
    whole_gradients: int

    @property
    def sharded(self) -> int:
        """Bytes of sharded state: weights, gradient shards and optimiser state."""
        return self.sharded_weights + self.gradient_shards + self.optimizer_state

    @property
    def whole(self) -> int:
        """Bytes of whole (unsharded) units: weights and gradients."""
        return self.whole_weights + self.whole_gradients

    @property
    def total(self) -> int:
        """Every byte counted at this moment (activations are not)."""
        return self.sharded + self.whole


@dataclass(frozen=True)
class _Unit:
    """One FSDP unit's sizes, in elements, on ``world_size`` ranks."""

    numel: int  # all its parameters, unpadded
    padded_shard: int  # what every rank allocates for its shards
    local: int  # what this rank holds, unpadded

    def whole(self, world_size: int) -> int:
        """Elements of the unit gathered whole: ``world_size`` padded shards."""
        return world_size * self.padded_shard


def _units(units: Sequence[Sequence[Sequence[int]]], world_size: int, rank: int) -> list[_Unit]:
    if isinstance(units, str | bytes) or not isinstance(units, Sequence) or not units:
        raise ValueError(f"units must be a non-empty sequence of lists of shapes, got {units!r}")
    sized = []
    for unit in units:
        if isinstance(unit, str | bytes) or not isinstance(unit, Sequence):
            raise ValueError(f"units must hold lists of parameter shapes, got {unit!r}")
        sized.append(
            _Unit(
                numel=sum(math.prod(_shape(shape)) for shape in unit),
                padded_shard=sum(fsdp_padded_numel(shape, world_size) for shape in unit),
                local=sum(fsdp_shard_numels(shape, world_size)[rank] for shape in unit),
            )
        )
    return sized


def fsdp_memory_moments(
    units: Sequence[Sequence[Sequence[int]]],
    world_size: int,
    rank: int = 0,
    *,
    forward_prefetch: int = 0,
    backward_prefetch: int = 1,
    shard_bytes: int = 4,
    compute_bytes: int | None = None,
    reduce_bytes: int | None = None,
    optimizer_bytes: int = 8,
) -> list[FsdpMemory]:
    """Bytes ``rank`` holds at each moment of one FSDP2 training step (model state only).

    ``units`` are the FSDP units in forward order, each given as the shapes of its
    parameters (a ``(n,)`` shape stands for ``n`` parameters). Every unit is
    ``fully_shard``-ed with ``reshard_after_forward=True`` under a root that holds no
    parameters; the step is not the first (Adam's state exists) and the previous
    step's gradients were freed (``zero_grad()``). The moments are those of
    :func:`fsdp_moments`: each unit's forward, each unit's backward at the instant its
    gradients are complete (before its reduce-scatter), then the optimiser step.

    Sharded state: ``shard_bytes`` per element of the padded shards (the fp32 master
    weights), the same per element of the gradient slices reduce-scattered so far
    (padded: one flat buffer per unit), and ``optimizer_bytes`` per element the rank
    holds (Adam: 8). Whole units, as FSDP2 allocates them (``world_size`` padded
    shards each), in ``compute_bytes`` (the ``param_dtype``, default ``shard_bytes``):

    * forward of unit ``i``: its gathered weights, *and* the flat buffer the
      all-gather wrote into, which FSDP2 keeps until the next unit has been gathered
      (two all-gather outputs alive at once: its implicit forward prefetch), plus the
      buffers of the ``forward_prefetch`` next units (``set_modules_to_forward_prefetch``);
    * backward of unit ``i``: its gathered weights and the all-gather buffers of the
      ``backward_prefetch`` units below (FSDP2's default: 1); its gradients (unpadded,
      in ``compute_bytes``), and the reduce-scatter input of the unit above (padded, in
      ``reduce_bytes``, default ``compute_bytes``), which FSDP2 keeps until this
      unit's reduce-scatter is issued (on a GPU it is still in flight).

    These are the exact bytes of the tensors FSDP2 holds on a CPU (chapter 7 checks
    them rank by rank). On a GPU the CPU runs ahead of the kernels, so the next
    forward all-gather can be allocated while a unit still computes: count it with
    ``forward_prefetch=1``. Transient buffers (the copy into the all-gather input,
    the reduce-scatter output before it becomes the gradient shard) and activations
    are not counted.
    """
    n_ranks = _checks.count("world_size", world_size, minimum=1)
    r = _checks.count("rank", rank)
    if r >= n_ranks:
        raise ValueError(f"rank must be between 0 and world_size - 1 = {n_ranks - 1}, got {rank}")
    ahead = _checks.count("forward_prefetch", forward_prefetch)
    behind = _checks.count("backward_prefetch", backward_prefetch)
    shard = _checks.count("shard_bytes", shard_bytes, minimum=1)
    compute = (
        shard if compute_bytes is None else _checks.count("compute_bytes", compute_bytes, minimum=1)
    )
    reduce = (
        compute if reduce_bytes is None else _checks.count("reduce_bytes", reduce_bytes, minimum=1)
    )
    optimizer = _checks.count("optimizer_bytes", optimizer_bytes)
    sized = _units(units, n_ranks, r)
    n = len(sized)

    def whole(indices: range) -> int:
        return sum(sized[j].whole(n_ranks) for j in indices if 0 <= j < n)

    def moment(phase: str, unit: int | None, shards: range, weights: int, grads: int):
        return FsdpMemory(
            phase=phase,
            unit=unit,
            sharded_weights=shard * sum(u.padded_shard for u in sized),
            gradient_shards=shard * sum(sized[j].padded_shard for j in shards),
            optimizer_state=optimizer * sum(u.local for u in sized),
            whole_weights=compute * weights,
            whole_gradients=grads,
        )

    moments = [
        moment(
            "forward",
            i,
            range(0),
            2 * whole(range(i, i + 1)) + whole(range(i + 1, i + 1 + ahead)),
            0,
        )
        for i in range(n)
    ]
    for i in reversed(range(n)):
        weights = whole(range(i, i + 1)) + whole(range(i - behind, i))
        grads = compute * sized[i].numel + reduce * whole(range(i + 1, i + 2))
        moments.append(moment("backward", i, range(i + 1, n), weights, grads))
    moments.append(moment("optimiser", None, range(n), 0, 0))
    return moments


def fsdp_peak(
    units: Sequence[Sequence[Sequence[int]]], world_size: int, rank: int = 0, **sizes: int
) -> FsdpMemory:
    """The moment of :func:`fsdp_memory_moments` at which ``rank`` holds the most bytes
    (the first such moment); ``sizes`` are its keyword arguments.

    Its ``total`` is the sharded state so far plus the largest set of whole units alive
    at once: the peak a GPU must fit, activations aside.
    """
    return max(fsdp_memory_moments(units, world_size, rank, **sizes), key=lambda m: m.total)


def decoder_units(params: float, layers: int, d_model: int, vocab: int) -> list[list[tuple[int]]]:
    """FSDP units of a decoder of ``params`` parameters, wrapped as torchtitan wraps it.

    The token embedding (``vocab x d_model``), then ``layers`` blocks, then the output
    head (``vocab x d_model``, untied), each its own unit; the blocks share equally what
    the embedding and the head leave (the head takes the remainder of the division,
    fewer than ``layers`` parameters). Each unit is one flat ``(n,)`` shape, for
    :func:`fsdp_memory_moments`.
    """
    total = _checks.count("params", params)
    n_layers = _checks.count("layers", layers, minimum=1)
    table = _checks.count("vocab", vocab, minimum=1) * _checks.count("d_model", d_model, minimum=1)
    if 2 * table > total:
        raise ValueError(
            f"params must be at least the embedding and head, 2 x vocab x d_model = "
            f"{2 * table:,}, got {params!r}"
        )
    block, rest = divmod(total - 2 * table, n_layers)
    return [[(table,)], *([(block,)] for _ in range(n_layers)), [(table + rest,)]]
