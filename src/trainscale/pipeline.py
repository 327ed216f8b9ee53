"""Pipeline schedules simulated in one process (chapter 9).

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

Five schedules:

* ``"gpipe"``: every forward, then every backward, both in micro-batch order
  (GPipe, arXiv 1811.06965; the order of PyTorch's ``ScheduleGPipe``);
* ``"1f1b"``: stage ``s`` runs ``K - s`` forwards, then alternates one backward
  and one forward, then finishes the backwards (the order of PyTorch's
  ``Schedule1F1B``); the same length as GPipe, fewer activations held;
* ``"interleaved"``: each device holds ``chunks`` non-consecutive pieces of the
  model (device ``d`` holds virtual stages ``d, d + K, d + 2K, ...``) and runs
  them in Megatron-LM's interleaved 1F1B order (arXiv 2104.04473);
  the idle time shrinks ``chunks`` times, at the price of more sends;
* ``"zb-h1"``: the backward of each micro-batch is split into the gradient of
  the stage's input (``"input"``, what the stage before waits for) and the
  gradient of its weights (``"weight"``, which nobody waits for), and the
  weight passes are put off to fill the idle time: ZB-H1 of Qi et al.,
  "Zero Bubble Pipeline Parallelism" (arXiv 2401.10241), in the order of
  PyTorch's ``ScheduleInterleavedZeroBubble`` with one stage per device;
* ``"zb-v"``: the same split, with two chunks per device placed in a V (device
  ``d`` holds virtual stages ``d`` and ``2K - 1 - d``, so the first device also
  computes the loss): ZB-V of the same paper, in the order of PyTorch's
  ``ScheduleZBVZeroBubble``.

With the split, a micro-batch's activations are counted as held until its
weight pass has run (an upper bound: the input pass frees part of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from trainscale import _checks

FORWARD, BACKWARD = "forward", "backward"
INPUT, WEIGHT = "input", "weight"
"""The two halves of a split backward: the input gradient (B) and the weight gradient (W)."""
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
ZERO_BUBBLE = ("zb-h1", "zb-v")
"""The schedules that split each backward into an input and a weight pass."""
V_SHAPED = ("zb-v", "dualpipev")
"""Schedules whose device ``d`` holds virtual stages ``d`` and ``2K - 1 - d``: ZB-V, and
DeepSeek's DualPipeV (arXiv 2412.19437), which :func:`replay` can play from its order."""


class Op(NamedTuple):
    """One operation of a stage: the ``kind`` (``"forward"``, ``"backward"``, or
    the two halves of a split backward, ``"input"`` and ``"weight"``) of
    ``micro_batch``, running from ``start`` to ``end``, on the device's model
    chunk ``chunk`` (always ``0`` unless the device holds several chunks)."""

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
        the end of its backward (of its weight pass, when the backward is
        split). With several chunks per device, each chunk
        holds ``1 / chunks`` of the device's layers, so a (chunk, micro-batch)
        pair counts as ``1 / chunks`` of a micro-batch. Whole counts are ``int``.
        """
        peaks = []
        for stage in self.ops:
            held = peak = 0
            for op in stage:
                if op.kind == FORWARD:
                    held += 1
                elif op.kind in (BACKWARD, WEIGHT):
                    held -= 1
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
    planner of chapter 16 and the real pipeline of chapter 9 use it.
    """
    p = _checks.count("stages", stages, minimum=1)
    m = _checks.count("micro_batches", micro_batches, minimum=1)
    v = _checks.count("virtual_stages", virtual_stages, minimum=1)
    return (p - 1) / (v * m + p - 1)


def bubble_zb_h1(
    stages: int,
    micro_batches: int,
    forward: float = 1.0,
    backward: float = 2.0,
    weight: float = 1.0,
) -> float:
    """Idle share of a ZB-H1 step (Qi et al., arXiv 2401.10241):
    ``(p - 1)(F + B - W) / (m (F + B + W) + (p - 1)(F + B - W))``.

    ``F`` is ``forward``, ``W`` is ``weight`` (the weight-gradient pass) and
    ``B = backward - weight`` the input-gradient pass, all times of one
    micro-batch on one stage, as :func:`simulate` takes them. 1F1B leaves each
    stage ``(p - 1)(F + B + W)`` idle; ZB-H1 starts each input pass sooner, with
    no weight pass in its way, and puts the weight passes off into the tail,
    where 1F1B idles, so each stage idles ``(p - 1)(F + B - W)``: a third of
    1F1B's when the three passes take equally long. It holds when ``m >= p`` and ``W <= F``,
    ``W <= B`` (checked against :func:`simulate`); other arguments raise
    ``ValueError``.
    """
    p = _checks.count("stages", stages, minimum=1)
    m = _checks.count("micro_batches", micro_batches, minimum=1)
    f = _checks.positive("forward", forward)
    w = _checks.positive("weight", weight)
    b = _checks.positive("backward", backward) - w
    if m < p:
        raise ValueError(f"micro_batches must be at least stages ({p}) for ZB-H1, got {m}")
    if w > f or w > b:
        raise ValueError(
            f"weight must be at most forward ({f:g}) and backward - weight ({b:g}), got {w:g}"
        )
    idle = (p - 1) * (f + b - w)
    return idle / (m * (f + b + w) + idle)


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


def _zb_h1_order(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int, int]]:
    """ZB-H1 for device ``stage``, as PyTorch's ``ScheduleInterleavedZeroBubble`` orders it
    with one stage per device.

    Like 1F1B, ``K - 1 - s`` forwards fill the pipeline, then each step runs a
    forward and an input pass; the weight passes trail the input passes by ``s``
    steps, so that every stage holds ``K`` micro-batches at most and the weight
    passes left at the end fill the time the later stages would otherwise wait.
    """
    warmup = min(stages - 1 - stage, micro_batches)
    order = [(FORWARD, 0, m) for m in range(warmup)]
    for i in range(micro_batches):
        if warmup + i < micro_batches:
            order.append((FORWARD, 0, warmup + i))
        order.append((INPUT, 0, i))
        if i >= stage:
            order.append((WEIGHT, 0, i - stage))
    order += [(WEIGHT, 0, m) for m in range(max(0, micro_batches - stage), micro_batches)]
    return order


def _zb_v_order(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int, int]]:
    """ZB-V for device ``stage``, as PyTorch's ``ScheduleZBVZeroBubble`` orders it.

    Chunk 0 is virtual stage ``s``, chunk 1 virtual stage ``2K - 1 - s``. The order
    is built for at least ``2K - 1`` micro-batches; passes of micro-batches beyond
    ``micro_batches`` are then left out, as PyTorch leaves them out.
    """
    k, s = stages, stage
    count = max(2 * k - 1, micro_batches)
    order: list[tuple[str, int, int]] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (k - s) - 1):  # warm-up: chunk 0 forwards
        order.append((FORWARD, 0, f0))
        f0 += 1
    for _ in range(s):  # then both chunks' forwards, alternating
        order += [(FORWARD, 1, f1), (FORWARD, 0, f0)]
        f0, f1 = f0 + 1, f1 + 1
    for _ in range(k - s):  # the V's bottom: chunk 1 starts its backwards
        order += [(FORWARD, 1, f1), (INPUT, 1, b1), (WEIGHT, 1, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < count:  # steady state
        if f0 < count:
            order.append((FORWARD, 0, f0))
            f0 += 1
        order += [(INPUT, 0, b0), (WEIGHT, 0, b0), (FORWARD, 1, f1)]
        order += [(INPUT, 1, b1), (WEIGHT, 1, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(s):  # cool-down: input passes first, weight passes after
        order += [(INPUT, 0, b0), (INPUT, 1, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(k - s):
        order += [(INPUT, 0, b0), (WEIGHT, 0, w0)]
        b0, w0 = b0 + 1, w0 + 1
    order += [(WEIGHT, 1, m) for m in range(w1, b1)]
    order += [(WEIGHT, 0, m) for m in range(w0, b0)]
    return [op for op in order if op[2] < micro_batches]


def _virtual_stage(schedule: str, stages: int, device: int, chunk: int) -> int:
    """Which piece of the model (counted from the input) a device's chunk holds."""
    if schedule in V_SHAPED and chunk == 1:
        return 2 * stages - 1 - device
    return chunk * stages + device


def simulate(
    schedule: str,
    stages: int,
    micro_batches: int,
    forward: float = 1.0,
    backward: float | None = None,
    *,
    chunks: int = 1,
    send: float = 0.0,
    weight: float | None = None,
    overhead: float = 0.0,
) -> Timeline:
    """Play one training step of a pipeline schedule and return its :class:`Timeline`.

    ``schedule`` is one of :data:`SCHEDULES`. ``forward`` and ``backward`` are
    the times one stage takes for one micro-batch (``backward`` defaults to
    ``2 * forward``, chapter 1); with ``chunks`` pieces per device each piece
    takes ``1 / chunks`` of them. The zero-bubble schedules split ``backward``
    into a weight pass of ``weight`` (default: half of ``backward``) and an
    input pass of the rest; the other schedules ignore ``weight``. ``send`` is
    the time an activation or a gradient takes to reach the next device (``0``:
    free, as the formula assumes). ``overhead`` is what every pass costs beyond its
    compute (a runtime's bookkeeping, posting its sends and receives): the pass
    starts that long after it could, whatever its length, so a chunk's half-size pass
    pays it in full. ``"interleaved"`` needs ``chunks >= 2`` and
    ``micro_batches`` a multiple of ``stages``; ``"zb-v"`` has 2 chunks per device
    (``chunks`` may be left at 1); the others take ``chunks = 1``.
    """
    name = _checks.choice("schedule", schedule, SCHEDULES)
    k = _checks.count("stages", stages, minimum=1)
    m = _checks.count("micro_batches", micro_batches, minimum=1)
    f = _checks.positive("forward", forward)
    b = 2 * f if backward is None else _checks.positive("backward", backward)
    w = b / 2 if weight is None else _checks.positive("weight", weight)
    if name in ZERO_BUBBLE and w >= b:
        raise ValueError(f"weight must be below backward ({b:g}) to leave an input pass, got {w:g}")
    latency = _checks.non_negative("send", send)
    cost = _checks.non_negative("overhead", overhead)
    if name == "interleaved":
        v = _checks.count("chunks", chunks, minimum=2)
        if m % k:
            raise ValueError(
                f"micro_batches must be a multiple of stages ({k}) for the interleaved"
                f" schedule, got {m}"
            )
        orders = [_interleaved_order(k, m, s, v) for s in range(k)]
    elif name == "zb-v":
        v = _checks.count("chunks", chunks, minimum=1)
        if v not in (1, 2):
            raise ValueError(f"chunks must be 2 (or 1, read as 2) for zb-v, got {chunks}")
        v = 2
        orders = [_zb_v_order(k, m, s) for s in range(k)]
    else:
        v = _checks.count("chunks", chunks, minimum=1)
        if v != 1:
            raise ValueError(f"chunks must be 1 for the {name} schedule, got {chunks}")
        make = {"gpipe": _gpipe_order, "1f1b": _one_f_one_b_order, "zb-h1": _zb_h1_order}[name]
        orders = [make(k, m, s) for s in range(k)]
    times = {FORWARD: f / v, BACKWARD: b / v, INPUT: (b - w) / v, WEIGHT: w / v}
    placement = [[_virtual_stage(name, k, d, c) for c in range(v)] for d in range(k)]
    return Timeline(name, k, m, _play(orders, placement, times, latency, cost), v)


def replay(
    timeline: Timeline,
    forward: float = 1.0,
    backward: float | None = None,
    *,
    weight: float | None = None,
    send: float = 0.0,
    overhead: float = 0.0,
) -> Timeline:
    """Play the order of ``timeline`` (measured, say) again with fixed times.

    Each device runs exactly the passes ``timeline`` lists for it, in that
    order, as early as the dependencies of :func:`simulate` allow, with the
    times of :func:`simulate` (``weight`` splits the backward of ``"input"`` and
    ``"weight"`` passes; ``send`` and ``overhead`` as there). Chunks are placed as in
    an interleaved schedule, or in a V if ``timeline.schedule`` is one of
    :data:`V_SHAPED`. This is how the book simulates a schedule it has no order of
    its own for, such as DualPipeV: from the order PyTorch ran.
    """
    times = _pass_times(forward, backward, weight)
    latency = _checks.non_negative("send", send)
    return _replay(timeline, times, latency, _checks.non_negative("overhead", overhead))


def _pass_times(forward: float, backward: float | None, weight: float | None) -> dict[str, float]:
    """Checked times of each kind of pass on one stage (see :func:`replay`)."""
    f = _checks.positive("forward", forward)
    b = 2 * f if backward is None else _checks.positive("backward", backward)
    w = b / 2 if weight is None else _checks.positive("weight", weight)
    if w >= b:
        raise ValueError(f"weight must be below backward ({b:g}) to leave an input pass, got {w:g}")
    return {FORWARD: f, BACKWARD: b, INPUT: b - w, WEIGHT: w}


def _replay(timeline: Timeline, times: dict[str, float], send: float, overhead: float) -> Timeline:
    """:func:`replay` with checked arguments; ``times`` per stage, divided by the chunks here."""
    k, v = timeline.stages, timeline.chunks
    orders = [[(op.kind, op.chunk, op.micro_batch) for op in ops] for ops in timeline.ops]
    per_chunk = {kind: t / v for kind, t in times.items()}
    placement = [[_virtual_stage(timeline.schedule, k, d, c) for c in range(v)] for d in range(k)]
    played = _play(orders, placement, per_chunk, send, overhead)
    return Timeline(timeline.schedule, k, timeline.micro_batches, played, v)


def chain_length(timeline: Timeline) -> int:
    """The most passes on one chain of dependencies in the order ``timeline`` ran.

    A chain links each pass to the one before it on its device and to the pass it
    waits for on another (:func:`simulate`'s rules). With passes of no length and a
    cost of 1 each (``overhead``), the step lasts exactly this long: a step of empty
    passes measures the overhead per pass times this count. 1F1B with ``K`` stages and
    ``M`` micro-batches: ``2 (M + K - 1)``.
    """
    times = dict.fromkeys((FORWARD, BACKWARD, INPUT, WEIGHT), 0.0)
    return round(_replay(timeline, times, 0.0, 1.0).makespan)


def overhead_for_step(
    timeline: Timeline,
    step: float,
    forward: float,
    backward: float | None = None,
    *,
    weight: float | None = None,
) -> float:
    """The overhead per pass at which :func:`replay` of ``timeline``'s order, with these
    pass times, lasts ``step``: what each pass of a measured step cost beyond its compute.

    The replayed step grows with the overhead, by at least one overhead per unit, so
    the answer is unique; found by bisection, to a billionth of ``step``. A ``step``
    shorter than the replay with no overhead raises ``ValueError``.
    """
    target = _checks.positive("step", step)
    times = _pass_times(forward, backward, weight)
    shortest = _replay(timeline, times, 0.0, 0.0).makespan
    if target < shortest:
        raise ValueError(f"step must be at least the replay with no overhead ({shortest:g})")
    low, high = 0.0, target - shortest
    while high - low > 1e-9 * target:
        middle = (low + high) / 2
        if _replay(timeline, times, 0.0, middle).makespan < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def break_even_overhead(
    timeline: Timeline,
    baseline: Timeline,
    forward: float = 1.0,
    backward: float | None = None,
    *,
    weight: float | None = None,
) -> float:
    """The smallest overhead per pass at which ``timeline``'s order stops being faster
    than ``baseline``'s, both replayed with these pass times (:func:`replay`).

    A schedule that runs more, shorter passes gains less from the same idle time as
    the overhead grows: below the answer it is faster, above it slower. ``math.inf``
    if its longest chain has no more passes than the baseline's (it never falls
    behind); ``ValueError`` if it is not faster with no overhead. Both steps are
    piecewise linear in the overhead: a grid of 64 finds the first crossing, and
    bisection places it to a billionth of the baseline's step.
    """
    times = _pass_times(forward, backward, weight)

    def lead(overhead: float) -> float:  # how much sooner timeline ends than baseline
        return (
            _replay(baseline, times, 0.0, overhead).makespan
            - _replay(timeline, times, 0.0, overhead).makespan
        )

    base = _replay(baseline, times, 0.0, 0.0).makespan
    if lead(0.0) <= 0:
        raise ValueError("timeline must be faster than baseline with no overhead")
    extra = chain_length(timeline) - chain_length(baseline)
    if extra <= 0:
        return math.inf
    # past base / extra the timeline is slower: its step is at least chain x overhead,
    # the baseline's at most its step with none plus its chain x overhead
    grid = [base / extra * i / 64 for i in range(65)]
    high = next(o for o in grid if lead(o) <= 0)
    low = grid[grid.index(high) - 1]
    while high - low > 1e-9 * base:
        middle = (low + high) / 2
        if lead(middle) > 0:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def _play(
    orders: list[list[tuple[str, int, int]]],
    placement: list[list[int]],
    times: dict[str, float],
    send: float,
    overhead: float = 0.0,
) -> tuple[tuple[Op, ...], ...]:
    """Run each device's ``orders`` as early as the dependencies allow.

    ``placement[d][c]`` is the virtual stage that chunk ``c`` of device ``d``
    holds; ``times`` the duration of each kind of pass; each pass starts
    ``overhead`` after it could (its device free and its input arrived).
    """
    device_of = {v: d for d, chunks in enumerate(placement) for v in chunks}
    last = len(device_of) - 1  # the virtual stage that computes the loss
    done: dict[tuple[str, int, int], float] = {}  # (F, B or W, virtual stage, micro-batch) -> end
    free = [0.0] * len(orders)
    position = [0] * len(orders)
    ops: list[list[Op]] = [[] for _ in orders]
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for device, order in enumerate(orders):
            while position[device] < len(order):
                kind, chunk, micro_batch = order[position[device]]
                virtual = placement[device][chunk]
                before = _dependency(kind, virtual, micro_batch, last)
                ready = 0.0
                if before is not None:
                    if before not in done:
                        break
                    crosses = device_of[before[1]] != device
                    ready = done[before] + (send if crosses else 0.0)
                start = max(free[device], ready) + overhead
                end = start + times[kind]
                done[(_STEP[kind], virtual, micro_batch)] = end
                free[device] = end
                ops[device].append(Op(kind, micro_batch, start, end, chunk))
                position[device] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # every schedule above is deadlock-free; a replayed order may not be
            raise ValueError("the order deadlocks: every stage waits for another")
    return tuple(tuple(stage) for stage in ops)


_STEP = {FORWARD: "F", BACKWARD: "B", INPUT: "B", WEIGHT: "W"}
"""What a pass makes available: an activation (F), an input gradient (B), or neither (W)."""


def _dependency(kind: str, virtual: int, micro_batch: int, last: int) -> tuple | None:
    """The pass that must end before ``kind`` of ``micro_batch`` on ``virtual`` starts."""
    if kind == FORWARD:
        return ("F", virtual - 1, micro_batch) if virtual > 0 else None
    if kind == WEIGHT:
        return ("B", virtual, micro_batch)  # the stage's own input pass
    if virtual < last:
        return ("B", virtual + 1, micro_batch)
    return ("F", virtual, micro_batch)  # the loss: after the stage's own forward


# --- the chapter's exercise: write the 1F1B order of one stage -------------------------------

EXERCISE_SIZES = ((2, 2), (2, 5), (3, 7), (4, 4), (4, 8), (8, 8), (8, 12))
"""Pipelines ``(p, m)`` the exercise is checked on: ``m >= p``, as ``Schedule1F1B`` asks."""


def one_f_one_b_order(stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """The 1F1B order of ``stage`` of ``stages`` with ``micro_batches`` micro-batches, as the
    exercise asks for it: ``("F", i)`` is the forward of micro-batch ``i``, ``("B", i)`` its
    backward. The order :func:`simulate` plays for ``"1f1b"``."""
    p = _checks.count("stages", stages, minimum=1)
    m = _checks.count("micro_batches", micro_batches, minimum=1)
    s = _checks.count("stage", stage)
    if s >= p:
        raise ValueError(f"stage must be below stages ({p}), got {s}")
    return [(_STEP[kind], i) for kind, _, i in _one_f_one_b_order(p, m, s)]


def torch_1f1b_orders(stages: int, micro_batches: int) -> list[list[tuple[str, int]]]:
    """What PyTorch's ``Schedule1F1B.pipeline_order`` lists for each rank, as
    :func:`one_f_one_b_order` writes an order (its idle slots and its final
    ``REDUCE_GRAD`` left out). The schedule is built without processes, around a stage
    that knows only its place; ``Schedule1F1B`` refuses fewer micro-batches than stages."""
    from torch.distributed.pipelining import Schedule1F1B
    from torch.distributed.pipelining.stage import _PipelineStageBase

    p = _checks.count("stages", stages, minimum=1)
    m = _checks.count("micro_batches", micro_batches, minimum=1)

    class _Placed(_PipelineStageBase):  # skips the real stage's set-up: no process group
        def __init__(self) -> None:
            self.stage_index, self.num_stages, self.group_size, self.group_rank = 0, p, p, 0
            self.submod, self.has_backward, self.dw_builder = None, True, None
            self.stage_index_to_group_rank = {}

        def _create_grad_recv_info(self, *args: object, **kwargs: object) -> None: ...
        def _prepare_backward_infra(self, *args: object, **kwargs: object) -> None: ...
        def _prepare_forward_infra(self, *args: object, **kwargs: object) -> None: ...

    order = Schedule1F1B(_Placed(), m).pipeline_order or {}
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}  # REDUCE_GRAD is left out
    return [
        [
            (kinds[a.computation_type.name], a.microbatch_index)
            for a in order[rank]
            if a is not None and a.computation_type.name in kinds
        ]
        for rank in range(p)
    ]


@dataclass(frozen=True)
class OrderCheck:
    """The verdict on a reader's order: ``passed``, and what to tell them (``str``)."""

    passed: bool
    lines: tuple[str, ...]

    def __str__(self) -> str:
        return "\n".join(self.lines)


def _order_problem(order: object, p: int, m: int, r: int) -> str | None:
    """What is wrong with one stage's order on its own (its form and its micro-batches)."""
    where = f"stage {r} of p = {p}, m = {m}"
    if not isinstance(order, list | tuple) or not all(
        isinstance(a, tuple) and len(a) == 2 and a[0] in ("F", "B") and isinstance(a[1], int)
        for a in order
    ):
        return f"{where}: return a list of ('F', i) and ('B', i) pairs, got {order!r:.80}"
    for kind in ("F", "B"):
        seen = sorted(i for k, i in order if k == kind)
        if seen != list(range(m)):
            wanted = f"not each of 0..{m - 1} once"
            return f"{where}: the {kind} actions name micro-batches {seen}, {wanted}"
    first = {}
    for position, (kind, i) in enumerate(order):
        first.setdefault((kind, i), position)
    late = [i for i in range(m) if first["B", i] < first["F", i]]
    if late:
        return f"{where}: the backward of micro-batch {late[0]} comes before its forward"
    return None


def _stuck(orders: list[list[tuple[str, int]]]) -> str:
    """Where an order that deadlocks stops: each stage's next action and what it waits for."""
    p, done, position = len(orders), set(), [0] * len(orders)
    moved = True
    while moved:
        moved = False
        for r, order in enumerate(orders):
            while position[r] < len(order):
                kind, i = order[position[r]]
                need = (("F", r - 1, i) if r else None) if kind == "F" else ("B", r + 1, i)
                if kind == "B" and r == p - 1:
                    need = ("F", r, i)  # the loss: after the last stage's own forward
                if need is not None and need not in done:
                    break
                done.add((kind, r, i))
                position[r] += 1
                moved = True
    names = {"F": "forward", "B": "backward"}
    waits = []
    for r, order in enumerate(orders):
        if position[r] < len(order):
            kind, i = order[position[r]]
            if kind == "B" and r == p - 1:
                what = f"its own forward of micro-batch {i}"
            elif kind == "B":
                what = f"stage {r + 1}'s backward of micro-batch {i}"
            else:
                what = f"stage {r - 1}'s forward of micro-batch {i}"
            waits.append(f"stage {r} waits to run {names[kind]} {i}, which needs {what}")
    return "; ".join(waits)


def _differs(order: list, expected: list, p: int, m: int, r: int) -> str:
    """Why a valid order is not 1F1B's: its warm-up, its peak, or its first difference."""
    where = f"stage {r} of p = {p}, m = {m}"
    warmup = next(j for j, (kind, _) in enumerate(order) if kind == "B")
    right = min(p - r, m)
    if warmup != right:
        return (
            f"{where}: runs {warmup} forwards before its first backward; 1F1B runs p - r ="
            f" {right}, just enough to keep the stages after it busy"
        )
    held = peak = 0
    for kind, _ in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    if peak != right:
        return (
            f"{where}: holds {peak} micro-batches at once, 1F1B at most p - r = {right}:"
            " after the warm-up, run a backward before each next forward"
        )
    j = next(j for j, (a, b) in enumerate(zip(order, expected, strict=True)) if a != b)
    return f"{where}: action {j} is {order[j]}, 1F1B runs {expected[j]} there"


def check_1f1b(order_fn: object, sizes: tuple[tuple[int, int], ...] = EXERCISE_SIZES) -> OrderCheck:
    """Check a reader's ``order_fn(p, m, r)``, the 1F1B order of stage ``r`` of ``p`` with
    ``m`` micro-batches, as a course's test suite would, on each pipeline of ``sizes``.

    On every stage the order must be a list of ``("F", i)`` and ``("B", i)`` naming each
    micro-batch once each, forward first; all stages' orders together must run (played by
    :func:`simulate`'s rules, they must not wait on one another for ever); and they must be
    1F1B's, :func:`one_f_one_b_order`. The first failure is reported, with what to change.
    A right order is also compared with PyTorch's ``Schedule1F1B.pipeline_order``
    (:func:`torch_1f1b_orders`), stage by stage, where PyTorch lists an order of ``m``
    micro-batches; stages where it does not are named in the verdict.
    """
    if not callable(order_fn):
        raise ValueError(f"order_fn must be a function of (p, m, r), got {order_fn!r}")
    checked = _checks.count("sizes", len(sizes), minimum=1)
    name = getattr(order_fn, "__name__", "your function")
    stages = torch_equal = 0
    torch_odd: list[tuple[int, int, int, list]] = []
    for p, m in sizes:
        orders = []
        for r in range(p):
            try:
                order = order_fn(p, m, r)
            except Exception as error:  # the reader's code: report it, do not raise
                message = f"{name}({p}, {m}, {r}) raised {type(error).__name__}: {error}"
                return OrderCheck(False, (f"Not yet. {message}",))
            problem = _order_problem(order, p, m, r)
            if problem:
                return OrderCheck(False, (f"Not yet. {problem}",))
            orders.append(list(order))
        played = [[(FORWARD if k == "F" else BACKWARD, 0, i) for k, i in o] for o in orders]
        try:
            _play(played, [[r] for r in range(p)], {FORWARD: 1.0, BACKWARD: 2.0}, 0.0)
        except ValueError:
            message = f"p = {p}, m = {m}: the stages wait on one another for ever: {_stuck(orders)}"
            return OrderCheck(False, (f"Not yet. {message}",))
        for r, order in enumerate(orders):
            expected = one_f_one_b_order(p, m, r)
            if order != expected:
                return OrderCheck(False, (f"Not yet. {_differs(order, expected, p, m, r)}",))
        stages += p
        for r, listed in enumerate(torch_1f1b_orders(p, m)):
            if _order_problem(listed, p, m, r) is None:
                torch_equal += listed == orders[r]
            else:
                torch_odd.append((p, m, r, listed))
    lines = [
        f"Right: {name} gives 1F1B's order on all {stages} stages of {checked} pipelines",
        f"(p = {min(p for p, _ in sizes)} to {max(p for p, _ in sizes)},"
        f" m = {min(m for _, m in sizes)} to {max(m for _, m in sizes)}),"
        " and the stages' orders run together.",
        f"PyTorch's Schedule1F1B.pipeline_order lists the same order on {torch_equal} of them.",
    ]
    if torch_odd:
        last = all(r == p - 1 for p, _, r, _ in torch_odd)
        which = ", each pipeline's last stage," if last else ""
        p, m, r, listed = torch_odd[0]
        lines[-1] = lines[-1][:-1] + ";"
        lines.append(f"on the other {len(torch_odd)}{which} it lists no order of m micro-batches,")
        lines.append(f"e.g. p = {p}, m = {m}, stage {r}: {listed}")
    return OrderCheck(True, tuple(lines))
