"""Collective operations simulated in one process (chapter 04).

``tensors[r]`` is what rank ``r`` holds. The ring algorithm is written out step
by step, exactly as the ranks would run it, so the book can count what each
rank sends and draw every intermediate state. Chapter 04 runs the same
algorithm with real ``send``/``recv`` between processes.

Each tensor is cut into one chunk per rank with ``torch.tensor_split``, which
handles lengths not divisible by the number of ranks (the first chunks get one
element more) and lengths shorter than it (the last chunks are empty).
Inputs are never modified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainscale import _checks


def _check_ranks(tensors: Sequence[torch.Tensor], name: str = "tensors") -> int:
    """Number of ranks; every rank must hold a 1-D tensor of the same length and dtype."""
    if len(tensors) < 1:
        raise ValueError(f"{name} must hold one tensor per rank (at least 1), got 0")
    first = tensors[0]
    for rank, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
            raise ValueError(f"{name}[{rank}] must be a 1-D torch.Tensor")
        if tensor.shape != first.shape or tensor.dtype != first.dtype:
            raise ValueError(
                f"{name}[{rank}] has shape {tuple(tensor.shape)} and dtype {tensor.dtype}; "
                f"every rank must match {name}[0] ({tuple(first.shape)}, {first.dtype})"
            )
    return len(tensors)


def chunks_of(tensor: torch.Tensor, ranks: int) -> list[torch.Tensor]:
    """Cut ``tensor`` into ``ranks`` contiguous chunks (copies, never views)."""
    return [c.clone() for c in torch.tensor_split(tensor, _checks.count("ranks", ranks, 1))]


@dataclass
class RingStep:
    """The state of a ring collective after one step.

    ``phase`` is ``"start"``, ``"reduce-scatter"`` or ``"all-gather"``;
    ``step`` counts from 1 within the phase. ``contributions[r][k]`` is the set
    of ranks whose chunk ``k`` is summed into rank ``r``'s chunk ``k``;
    ``sent[r]`` is the chunk rank ``r`` sent in this step (``None`` at start).
    """

    phase: str
    step: int
    contributions: list[list[frozenset[int]]]
    sent: list[int | None]


def ring_all_reduce_trace(ranks: int) -> list[RingStep]:
    """Every state of a ring all-reduce over ``ranks`` ranks, start included.

    This follows :func:`ring_all_reduce` chunk by chunk but records *whose*
    data each chunk holds instead of the numbers, which is what the chapter's
    figure draws. ``2 * (ranks - 1)`` steps follow the start.
    """
    n = _checks.count("ranks", ranks, minimum=1)
    held = [[frozenset([rank])] * n for rank in range(n)]
    trace = [RingStep("start", 0, [row[:] for row in held], [None] * n)]
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(n - 1):
            sent = [_chunk_sent(phase, r, step, n) for r in range(n)]
            incoming = [held[rank][sent[rank]] for rank in range(n)]
            for r in range(n):
                k, receiver = sent[r], (r + 1) % n
                if phase == "reduce-scatter":
                    held[receiver][k] = held[receiver][k] | incoming[r]
                else:
                    held[receiver][k] = incoming[r]
            trace.append(RingStep(phase, step + 1, [row[:] for row in held], sent))
    return trace


def _chunk_sent(phase: str, rank: int, step: int, ranks: int) -> int:
    """Which chunk ``rank`` sends to ``rank + 1`` at ``step`` (0-based) of ``phase``.

    Reduce-scatter: rank ``r`` starts with its own chunk ``r`` and then passes on
    the chunk it has just added to, so after ``ranks - 1`` steps it owns the
    complete sum of chunk ``(r + 1) % ranks``. All-gather: rank ``r`` starts with
    that complete chunk and then passes on the one it has just received.
    """
    if phase == "reduce-scatter":
        return (rank - step) % ranks
    return (rank + 1 - step) % ranks


@dataclass(frozen=True)
class RingTransfer:
    """What one rank does at one step of the ring all-reduce.

    At step ``step`` (from 1) of ``phase`` (``"reduce-scatter"`` or
    ``"all-gather"``) the rank sends its chunk ``send_chunk`` to rank
    ``rank + 1`` and receives chunk ``recv_chunk`` from rank ``rank - 1``
    (modulo the ring), which it adds to its own copy (reduce-scatter) or stores
    in place of it (all-gather).
    """

    phase: str
    step: int
    send_chunk: int
    recv_chunk: int


def ring_schedule(rank: int, ranks: int) -> list[RingTransfer]:
    """Every transfer ``rank`` makes in a ring all-reduce over ``ranks`` ranks, in order.

    The same schedule as :func:`ring_all_reduce` (which chapter 04 runs on real
    processes with ``send``/``recv``): ``2 * (ranks - 1)`` steps, after the
    first ``ranks - 1`` of which the rank owns the complete sum of chunk
    ``(rank + 1) % ranks``. What a rank receives is what its left neighbour
    sends in the same step. One rank alone makes no transfer.
    """
    n = _checks.count("ranks", ranks, minimum=1)
    r = _checks.count("rank", rank)
    if r >= n:
        raise ValueError(f"rank must be between 0 and ranks - 1 = {n - 1}, got {rank}")
    left = (r - 1) % n
    return [
        RingTransfer(
            phase, step + 1, _chunk_sent(phase, r, step, n), _chunk_sent(phase, left, step, n)
        )
        for phase in ("reduce-scatter", "all-gather")
        for step in range(n - 1)
    ]


def _ring_phase(held: list[list[torch.Tensor]], phase: str) -> list[int]:
    """Run one phase of the ring on ``held[rank][chunk]`` in place; return elements sent."""
    n = len(held)
    sent_elements = [0] * n
    for step in range(n - 1):
        # All sends of a step happen at once: read every message before writing any.
        messages = [(r, _chunk_sent(phase, r, step, n)) for r in range(n)]
        payloads = [held[r][k].clone() for r, k in messages]
        for (r, k), payload in zip(messages, payloads, strict=True):
            receiver = (r + 1) % n
            if phase == "reduce-scatter":
                held[receiver][k] = held[receiver][k] + payload
            else:
                held[receiver][k] = payload
            sent_elements[r] += payload.numel()
    return sent_elements


def ring_reduce_scatter(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Ring reduce-scatter: afterwards rank ``r`` holds chunk ``(r + 1) % N`` of the sum.

    Returns ``(owned, sent)``: ``owned[r]`` is the fully summed chunk rank ``r``
    ends with, and ``sent[r]`` how many elements rank ``r`` sent in the
    ``N - 1`` steps.
    """
    n = _check_ranks(tensors)
    held = [chunks_of(t, n) for t in tensors]
    sent = _ring_phase(held, "reduce-scatter")
    return [held[r][(r + 1) % n] for r in range(n)], sent


def ring_all_gather(shards: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Ring all-gather: rank ``r`` contributes ``shards[r]``; every rank ends with all of them.

    The shards may have different lengths (as the chunks of a length that is not
    divisible by ``N`` do). Returns ``(gathered, sent)``: ``gathered[r]`` is
    ``torch.cat(shards)`` as rank ``r`` assembled it, ``sent[r]`` the elements
    rank ``r`` sent in the ``N - 1`` steps.
    """
    if len(shards) < 1:
        raise ValueError("shards must hold one tensor per rank (at least 1), got 0")
    for rank, shard in enumerate(shards):
        if not isinstance(shard, torch.Tensor) or shard.dim() != 1:
            raise ValueError(f"shards[{rank}] must be a 1-D torch.Tensor")
        if shard.dtype != shards[0].dtype:
            raise ValueError(f"shards[{rank}] has dtype {shard.dtype}, shards[0] {shards[0].dtype}")
    n = len(shards)
    # Rank r starts owning shard r, stored at the position the ring expects: (r + 1) % n.
    order = [(k - 1) % n for k in range(n)]
    held = [
        [shards[order[k]].clone() if order[k] == r else None for k in range(n)] for r in range(n)
    ]
    sent = _ring_phase(held, "all-gather")  # type: ignore[arg-type]
    return [torch.cat([row[(k + 1) % n] for k in range(n)]) for row in held], sent


def ring_all_reduce(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Ring all-reduce: reduce-scatter, then all-gather; every rank ends with the sum.

    Returns ``(results, sent)``: ``results[r]`` is rank ``r``'s copy of
    ``sum(tensors)``, ``sent[r]`` how many elements rank ``r`` sent in all
    ``2 * (N - 1)`` steps. When the length ``L`` is divisible by ``N`` that is
    ``2 * (N - 1) * L / N`` for every rank: about twice the tensor, whatever ``N``.
    Integer tensors are summed exactly.
    """
    n = _check_ranks(tensors)
    held = [chunks_of(t, n) for t in tensors]
    sent_rs = _ring_phase(held, "reduce-scatter")
    sent_ag = _ring_phase(held, "all-gather")
    results = [torch.cat(row) for row in held]
    return results, [a + b for a, b in zip(sent_rs, sent_ag, strict=True)]


RING_COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather")
"""The ring collectives whose traffic :func:`ring_factor` counts."""


def ring_factor(ranks: int, collective: str = "all-reduce") -> float:
    """Bytes each rank sends, per byte of the tensor, in a ring collective over ``ranks``.

    A reduce-scatter or an all-gather is one pass around the ring: ``N - 1`` steps,
    each sending one ``1/N`` chunk, so ``(N-1)/N`` of the tensor. An all-reduce is
    both passes: ``2 (N-1)/N``. One rank alone sends nothing. This is the one home
    of the ring's cost; every other module (sharding, the planner) calls it.
    """
    n = _checks.count("ranks", ranks, minimum=1)
    kind = _checks.choice("collective", collective, RING_COLLECTIVES)
    return (2 if kind == "all-reduce" else 1) * (n - 1) / n


def ring_bytes_per_rank(tensor_bytes: float, ranks: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``tensor_bytes``: ``2(N-1)/N`` of it."""
    size = _checks.count("tensor_bytes", tensor_bytes)
    return ring_factor(ranks) * size


def bus_bandwidth(algorithm_bandwidth: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth for all-reduce: ``algbw * 2(N-1)/N``.

    ``algbw`` is tensor bytes divided by the time the all-reduce took; busbw
    rescales it by what each rank really sent, so it can be compared with the
    link's speed whatever the number of ranks.
    """
    algbw = _checks.positive("algorithm_bandwidth", algorithm_bandwidth)
    return algbw * ring_factor(ranks)
