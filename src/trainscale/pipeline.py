"""Pipeline schedules simulated in one process (chapter 07).

A pipeline cuts a model into ``K`` consecutive *stages*, one per device, and a
batch into ``M`` *micro-batches*. Each stage runs a forward pass of every
micro-batch, then (the order depends on the schedule) a backward pass of every
micro-batch. :func:`simulate` plays a schedule out with fixed times per
operation and returns the :class:`Timeline`: what each stage did and when, the
idle share (the *bubble*), and how many micro-batches' activations each stage
had to hold at once.

The rules of the simulation, which are those of a real pipeline whose sends
do not block the sender and whose receives block the receiver:

* each stage runs its operations one at a time, in the order its schedule gives;
* the forward of micro-batch ``m`` on stage ``s`` starts only when stage
  ``s - 1`` has finished its forward of ``m`` (and sent the activations, which
  takes ``send`` time units);
* the backward of ``m`` on stage ``s`` starts only when stage ``s + 1`` has
  finished its backward of ``m`` (and sent the gradient); on the last stage it
  starts after that stage's own forward of ``m``, which computed the loss;
* otherwise an operation starts as soon as its stage is free.

Three schedules:

* ``"gpipe"``: every forward, then every backward, both in micro-batch order
  (GPipe, arXiv 1811.06965; the order of PyTorch's ``ScheduleGPipe``);
* ``"1f1b"``: stage ``s`` runs ``K - s`` forwards, then alternates one backward
  and one forward, then finishes the backwards (the order of PyTorch's
  ``Schedule1F1B``); the same length as GPipe, fewer activations held;
* ``"interleaved"``: each device holds ``chunks`` non-consecutive pieces of the
  model (device ``d`` holds virtual stages ``d, d + K, d + 2K, ...``) and runs
  them in Megatron-LM's interleaved 1F1B order (arXiv 2104.04473);
  the idle time shrinks ``chunks`` times, at the price of more sends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from trainscale import _checks

FORWARD, BACKWARD = "forward", "backward"
SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Op(NamedTuple):
    """One operation of a stage: the ``kind`` (``"forward"`` or ``"backward"``) of
    ``micro_batch``, running from ``start`` to ``end``, on the device's model
    chunk ``chunk`` (always ``0`` unless the schedule is interleaved)."""

    kind: str
    micro_batch: int
    start: float
    end: float
    chunk: int = 0


@dataclass(frozen=True)
class Timeline:
    """What every stage of a pipeline did during one training step.

    ``ops[s]`` lists stage ``s``'s operations in the order they ran. Time starts
    at ``0`` and the step ends when the last operation does (:attr:`makespan`).
    """

    schedule: str
    stages: int
    micro_batches: int
    ops: tuple[tuple[Op, ...], ...]
    chunks: int = 1

    @property
    def makespan(self) -> float:
        """Length of the step: the end of the last operation on any stage."""
        return max((op.end for stage in self.ops for op in stage), default=0.0)

    @property
    def busy(self) -> tuple[float, ...]:
        """Time each stage spent computing."""
        return tuple(math.fsum(op.end - op.start for op in stage) for stage in self.ops)

    @property
    def idle(self) -> tuple[float, ...]:
        """Time each stage spent waiting, within the step."""
        return tuple(self.makespan - busy for busy in self.busy)

    @property
    def bubble(self) -> float:
        """The idle share of the step: idle time of all stages over ``stages x makespan``."""
        total = self.stages * self.makespan
        return math.fsum(self.idle) / total if total > 0 else 0.0

    @property
    def peak_activations(self) -> tuple[float, ...]:
        """Most micro-batches whose activations each stage held at one time.

        A micro-batch's activations are held from the start of its forward to
        the end of its backward. With several chunks per device, each chunk
        holds ``1 / chunks`` of the device's layers, so a (chunk, micro-batch)
        pair counts as ``1 / chunks`` of a micro-batch. Whole counts are ``int``.
        """
        peaks = []
        for stage in self.ops:
            held = peak = 0
            for op in stage:
                held += 1 if op.kind == FORWARD else -1
                peak = max(peak, held)
            peaks.append(peak // self.chunks if peak % self.chunks == 0 else peak / self.chunks)
        return tuple(peaks)


def bubble(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of a pipeline step: ``(p - 1) / (v m + p - 1)``.

    With ``p`` stages and ``m`` micro-batches, GPipe and 1F1B need ``m + p - 1``
    time slots of one micro-batch each, of which every stage is busy in ``m``:
    ``(p - 1) / (m + p - 1)`` of the step is idle. With ``v`` virtual stages (model
    chunks) per device, Megatron-LM's interleaved schedule (arXiv 2104.04473), each
    chunk takes ``1 / v`` of the time, so filling and draining the pipeline costs
    ``v`` times less: ``(p - 1) / (v m + p - 1)``. ``virtual_stages`` is what
    :func:`simulate` calls ``chunks``. The one home of the bubble formula: the
    planner of chapter 13 and the real pipeline of chapter 07 use it.
    """
    p = _checks.count("stages", stages, minimum=1)
    m = _checks.count("micro_batches", micro_batches, minimum=1)
    v = _checks.count("virtual_stages", virtual_stages, minimum=1)
    return (p - 1) / (v * m + p - 1)


def micro_batches_for_bubble(stages: int, bubble_share: float) -> int:
    """The fewest micro-batches that keep the bubble strictly below ``bubble_share``.

    ``(K - 1) / (M + K - 1) < b`` means ``M > (K - 1)(1 - b) / b``; the answer is
    checked against :func:`bubble` so that rounding cannot move it by one.
    """
    k = _checks.count("stages", stages, minimum=1)
    target = _checks.positive("bubble_share", bubble_share, maximum=1.0)
    m = max(1, math.floor((k - 1) * (1 - target) / target))
    while m > 1 and bubble(k, m - 1) < target:
        m -= 1
    while bubble(k, m) >= target:
        m += 1
    return m


def _gpipe_order(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int, int]]:
    return [(FORWARD, 0, m) for m in range(micro_batches)] + [
        (BACKWARD, 0, m) for m in range(micro_batches)
    ]


def _one_f_one_b_order(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int, int]]:
    warmup = min(stages - stage, micro_batches)
    order = [(FORWARD, 0, m) for m in range(warmup)]
    for i in range(micro_batches - warmup):
        order += [(BACKWARD, 0, i), (FORWARD, 0, warmup + i)]
    order += [(BACKWARD, 0, m) for m in range(micro_batches - warmup, micro_batches)]
    return order


def _interleaved_order(
    stages: int, micro_batches: int, stage: int, chunks: int
) -> list[tuple[str, int, int]]:
    """Megatron-LM's interleaved 1F1B order for device ``stage``.

    Micro-batches go through in groups of ``stages``: the group's forwards on
    chunk 0, then on chunk 1, and so on; backwards visit the chunks in reverse.
    """
    total = micro_batches * chunks
    if micro_batches == stages:
        warmup = total
    else:
        warmup = min(total, (stages - stage - 1) * 2 + (chunks - 1) * stages)

    def unit(k: int, kind: str) -> tuple[str, int, int]:
        in_group = k % (stages * chunks)
        chunk = in_group // stages
        if kind == BACKWARD:
            chunk = chunks - 1 - chunk
        micro_batch = (k // (stages * chunks)) * stages + k % stages
        return kind, chunk, micro_batch

    order = [unit(k, FORWARD) for k in range(warmup)]
    for i in range(total - warmup):
        order += [unit(warmup + i, FORWARD), unit(i, BACKWARD)]
    order += [unit(k, BACKWARD) for k in range(total - warmup, total)]
    return order


def simulate(
    schedule: str,
    stages: int,
    micro_batches: int,
    forward: float = 1.0,
    backward: float | None = None,
    *,
    chunks: int = 1,
    send: float = 0.0,
) -> Timeline:
    """Play one training step of a pipeline schedule and return its :class:`Timeline`.

    ``schedule`` is one of :data:`SCHEDULES`. ``forward`` and ``backward`` are
    the times one stage takes for one micro-batch (``backward`` defaults to
    ``2 * forward``, chapter 1); with ``chunks`` pieces per device each piece
    takes ``1 / chunks`` of them. ``send`` is the time an activation or a
    gradient takes to reach the next device (``0``: free, as the formula
    assumes). ``"interleaved"`` needs ``chunks >= 2`` and ``micro_batches`` a
    multiple of ``stages``; the other schedules take ``chunks = 1``.
    """
    name = _checks.choice("schedule", schedule, SCHEDULES)
    k = _checks.count("stages", stages, minimum=1)
    m = _checks.count("micro_batches", micro_batches, minimum=1)
    f = _checks.positive("forward", forward)
    b = 2 * f if backward is None else _checks.positive("backward", backward)
    latency = _checks.non_negative("send", send)
    if name == "interleaved":
        v = _checks.count("chunks", chunks, minimum=2)
        if m % k:
            raise ValueError(
                f"micro_batches must be a multiple of stages ({k}) for the interleaved"
                f" schedule, got {m}"
            )
        orders = [_interleaved_order(k, m, s, v) for s in range(k)]
    else:
        v = _checks.count("chunks", chunks, minimum=1)
        if v != 1:
            raise ValueError(f"chunks must be 1 for the {name} schedule, got {chunks}")
        make = _gpipe_order if name == "gpipe" else _one_f_one_b_order
        orders = [make(k, m, s) for s in range(k)]
    return Timeline(name, k, m, _play(orders, k, v, f / v, b / v, latency), v)


def _play(
    orders: list[list[tuple[str, int, int]]],
    stages: int,
    chunks: int,
    forward: float,
    backward: float,
    send: float,
) -> tuple[tuple[Op, ...], ...]:
    """Run each device's ``orders`` as early as the dependencies allow."""
    last = stages * chunks - 1  # the virtual stage that computes the loss
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, micro-batch) -> end
    free = [0.0] * stages
    position = [0] * stages
    ops: list[list[Op]] = [[] for _ in range(stages)]
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for device, order in enumerate(orders):
            while position[device] < len(order):
                kind, chunk, micro_batch = order[position[device]]
                virtual = chunk * stages + device
                if kind == FORWARD:
                    before, neighbour = (FORWARD, virtual - 1, micro_batch), virtual > 0
                elif virtual < last:
                    before, neighbour = (BACKWARD, virtual + 1, micro_batch), True
                else:
                    before, neighbour = (FORWARD, virtual, micro_batch), False
                ready = 0.0
                if neighbour or kind == BACKWARD:
                    if before not in done:
                        break
                    other_device = before[1] % stages != device
                    ready = done[before] + (send if neighbour and other_device else 0.0)
                start = max(free[device], ready)
                end = start + (forward if kind == FORWARD else backward)
                done[(kind, virtual, micro_batch)] = end
                free[device] = end
                ops[device].append(Op(kind, micro_batch, start, end, chunk))
                position[device] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - every schedule above is deadlock-free
            raise RuntimeError("the schedule deadlocked: every stage waits for another")
    return tuple(tuple(stage) for stage in ops)
