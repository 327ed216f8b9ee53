"""Pipeline parallelism on real processes (chapter 9).

Rank ``s`` of ``K`` holds stage ``s``: two consecutive blocks of the book's
reference model (:func:`trainscale.memory.mlp_stack`, ``2K`` blocks). PyTorch's
``torch.distributed.pipelining`` moves activations forward and gradients
backward between the ranks with point-to-point sends, under the GPipe or the
1F1B schedule.

The blocks compute in microseconds, and on a small CPU machine four processes
computing at once would slow each other down, which would hide the pipeline's
own idle time behind contention. So each stage ends with a
:class:`SimulatedCompute` layer that passes its input through unchanged but
takes a fixed time, ``forward_s`` in forward and ``backward_s`` in backward,
by sleeping (a sleeping process leaves the CPU to the others). It also records
when each of its passes ran: that record is the stage's timeline.

For PyTorch's zero-bubble schedules, which split each backward into the
gradient of the stage's input and the gradient of its weights, the layer takes
``weight_s`` of its backward time on a path that only the weight gradient
follows (:func:`zero_bubble_worker`).

A :class:`SavedTensorMeter` counts, with ``torch.autograd.graph.saved_tensors_hooks``,
the bytes autograd keeps for backward on each stage (saved minus released), so the
activations a stage holds are measured, not inferred from the order of its passes.

Start it on a GPU node with ``torchrun --nproc-per-node=4 -m trainscale.workers.pipeline``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from types import TracebackType

import torch
import torch.distributed as dist
from torch import nn

from trainscale import _checks
from trainscale.distributed import device, torchrun_main
from trainscale.memory import mlp_stack
from trainscale.pipeline import BACKWARD, FORWARD, INPUT, WEIGHT, Op, Timeline, bubble

WIDTH = 32
"""Features of the reference model used here (small: the real work is simulated)."""
BLOCKS_PER_STAGE = 2
EXAMPLES_PER_MICRO_BATCH = 2
FLOAT32_BYTES = 4
HIDDEN_PER_WIDTH = 4
"""Each block widens to ``4 * WIDTH`` features (:func:`trainscale.memory.mlp_stack`)."""


def saved_bytes_per_micro_batch(stage: int, stages: int) -> int:
    """Bytes autograd saves on stage ``stage`` of ``stages`` for one micro-batch.

    Per block of the reference model, for ``e`` examples of width ``w`` in float32:
    the first ``Linear`` saves its input (``e w``), the first GELU its input
    (``e 4w``), the second ``Linear`` its input (``e 4w``) and the second GELU its
    input (``e w``): ``10 e w`` values. Weights are not activations and are not
    counted. The last stage also computes the loss, whose backward keeps the
    stage's output and the target (``2 e w``). With ``e = 2``, ``w = 32``: 2,560
    bytes per block, 5,120 per stage of two blocks, 5,632 on the last stage.
    """
    k = _checks.count("stages", stages, minimum=1)
    s = _checks.count("stage", stage)
    if s >= k:
        raise ValueError(f"stage must be between 0 and {k - 1}, got {stage}")
    values_per_block = 2 * (1 + HIDDEN_PER_WIDTH) * EXAMPLES_PER_MICRO_BATCH * WIDTH
    loss_values = 2 * EXAMPLES_PER_MICRO_BATCH * WIDTH if s == k - 1 else 0
    return (BLOCKS_PER_STAGE * values_per_block + loss_values) * FLOAT32_BYTES


class _Held:
    """A tensor saved for backward; tells its meter when autograd releases it."""

    __slots__ = ("meter", "nbytes", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: SavedTensorMeter) -> None:
        self.tensor = tensor
        self.meter = meter
        self.nbytes = tensor.numel() * tensor.element_size()
        meter._change(self.nbytes)

    def __del__(self) -> None:
        self.meter._change(-self.nbytes)


class SavedTensorMeter:
    """Bytes autograd holds for backward while the meter is entered: saved minus released.

    Inside ``with meter:`` every tensor an operation saves for its backward is
    counted at its own size (``numel * element_size``, a view at its own size)
    until autograd releases it, after that tensor's backward has run. Tensors
    sharing storage with one of ``exclude`` (the weights: state, not activations)
    and shape-only ``meta`` tensors are not counted. ``held`` is the count now,
    ``peak`` the largest since the last :meth:`reset`, both in bytes.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.held = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _change(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def _pack(self, tensor: torch.Tensor) -> object:
        if tensor.device.type == "meta":
            return tensor
        if tensor.untyped_storage().data_ptr() in self._excluded:
            return tensor
        return _Held(tensor, self)

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed  # type: ignore[return-value]

    def reset(self) -> None:
        """Start a new peak from what is held now."""
        self.peak = self.held

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._hooks.__exit__(kind, error, trace)


class _Sleep(torch.autograd.Function):
    """Identity that takes a fixed time in forward and in backward, and logs both."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: SimulatedCompute) -> torch.Tensor:
        ctx.layer = layer
        layer._run(FORWARD, layer.forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        layer = ctx.layer
        kind = INPUT if layer.split else BACKWARD
        layer._run(kind, layer.backward_s - layer.weight_s)
        return grad, None


class _WeightSleep(torch.autograd.Function):
    """Identity on the layer's clock weight; its backward, the weight gradient, takes
    ``weight_s`` and logs it."""

    @staticmethod
    def forward(ctx, clock: torch.Tensor, layer: SimulatedCompute) -> torch.Tensor:
        ctx.layer = layer
        return clock.view_as(clock)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.layer._run(WEIGHT, ctx.layer.weight_s)
        return grad, None


class SimulatedCompute(nn.Module):
    """A layer that returns its input unchanged after ``forward_s`` seconds, and
    passes the gradient back after ``backward_s`` seconds.

    With ``weight_s > 0`` (or ``split=True``) the layer also holds a weight,
    ``clock`` (a zero that the output adds times zero, so the output is unchanged),
    and ``weight_s`` of the ``backward_s`` is spent computing its gradient, on a path
    of the graph that only the weight gradient follows: a schedule that splits the
    backward runs ``backward_s - weight_s`` in the input pass and ``weight_s`` in the
    weight pass. ``events`` lists ``(kind, start, end)`` for every pass, in
    ``time.perf_counter()`` seconds (kinds ``"input"`` and ``"weight"`` for the
    two halves of the backward when split); :meth:`clear` empties it.
    :meth:`set_times` changes the three times between steps (to zero for a step
    of empty passes, say); the graph's shape, split or not, stays.
    """

    def __init__(
        self,
        forward_s: float = 0.0,
        backward_s: float = 0.0,
        weight_s: float = 0.0,
        split: bool | None = None,
    ):
        super().__init__()
        self.split = bool(weight_s) if split is None else _checks.boolean("split", split)
        self.set_times(forward_s, backward_s, weight_s)
        if self.split:
            self.clock = nn.Parameter(torch.zeros(()))
        self.events: list[tuple[str, float, float]] = []

    def set_times(self, forward_s: float, backward_s: float, weight_s: float = 0.0) -> None:
        """Take ``forward_s`` in forward and ``backward_s`` in backward, ``weight_s`` of
        it in the weight pass (only if the layer is split), all in seconds."""
        forward_s = _checks.non_negative("forward_s", forward_s)
        backward_s = _checks.non_negative("backward_s", backward_s)
        weight_s = _checks.non_negative("weight_s", weight_s)
        if weight_s > backward_s:
            raise ValueError(
                f"weight_s must be at most backward_s ({backward_s:g}), got {weight_s}"
            )
        if weight_s and not self.split:
            raise ValueError(f"weight_s must be 0 for a layer that is not split, got {weight_s}")
        self.forward_s, self.backward_s, self.weight_s = forward_s, backward_s, weight_s

    def _run(self, kind: str, seconds: float) -> None:
        start = time.perf_counter()
        if seconds:
            time.sleep(seconds)
        self.events.append((kind, start, time.perf_counter()))

    def clear(self) -> None:
        self.events.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return _Sleep.apply(x, self)
        # the weight's branch first, so that a full backward runs the input half first
        weight_branch = 0 * _WeightSleep.apply(self.clock.to(x.dtype), self)
        return _Sleep.apply(x, self) + weight_branch

    def extra_repr(self) -> str:
        weight = f", weight_s={self.weight_s:g}" if self.split else ""
        return f"forward_s={self.forward_s:g}, backward_s={self.backward_s:g}{weight}"


def reference_model(stages: int, seed: int = 0) -> nn.Sequential:
    """The whole model on one process: ``2 * stages`` blocks of width :data:`WIDTH`."""
    k = _checks.count("stages", stages, minimum=1)
    return mlp_stack(width=WIDTH, blocks=BLOCKS_PER_STAGE * k, seed=seed)


def stage_module(
    model: nn.Sequential, stage: int, stages: int, forward_s: float, backward_s: float
) -> nn.Sequential:
    """Stage ``stage`` of ``model``: its blocks, then the simulated compute time."""
    k = _checks.count("stages", stages, minimum=1)
    s = _checks.count("stage", stage)
    if s >= k:
        raise ValueError(f"stage must be between 0 and {k - 1}, got {stage}")
    if len(model) != BLOCKS_PER_STAGE * k:
        raise ValueError(f"model must have {BLOCKS_PER_STAGE * k} blocks, got {len(model)}")
    blocks = list(model)[BLOCKS_PER_STAGE * s : BLOCKS_PER_STAGE * (s + 1)]
    return nn.Sequential(*blocks, SimulatedCompute(forward_s, backward_s))


def piece_module(
    model: nn.Sequential,
    piece: int,
    pieces: int,
    forward_s: float,
    backward_s: float,
    weight_s: float = 0.0,
) -> nn.Sequential:
    """Piece ``piece`` of ``model`` cut into ``pieces`` equal runs of blocks, then the
    simulated compute (see :class:`SimulatedCompute` for the three times)."""
    n = _checks.count("pieces", pieces, minimum=1)
    i = _checks.count("piece", piece)
    if i >= n:
        raise ValueError(f"piece must be between 0 and {n - 1}, got {piece}")
    if len(model) % n:
        raise ValueError(f"pieces must divide the model's {len(model)} blocks, got {pieces}")
    size = len(model) // n
    blocks = list(model)[size * i : size * (i + 1)]
    return nn.Sequential(*blocks, SimulatedCompute(forward_s, backward_s, weight_s))


ZERO_BUBBLE_SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zb-v": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""The schedules :func:`zero_bubble_worker` runs, by the class of
``torch.distributed.pipelining`` that runs each (1F1B for comparison)."""


def pieces_of_rank(schedule: str, rank: int, world_size: int) -> list[int]:
    """Which pieces of the model rank ``rank`` holds, and into how many it is cut.

    One piece per rank for 1F1B and ZB-H1; for the V schedules (ZB-V, DualPipeV)
    ``2K`` pieces, rank ``r`` holding pieces ``r`` and ``2K - 1 - r``: the V.
    Returns ``[pieces held..., number of pieces]``.
    """
    name = _checks.choice("schedule", schedule, tuple(ZERO_BUBBLE_SCHEDULES))
    k = _checks.count("world_size", world_size, minimum=1)
    r = _checks.count("rank", rank)
    if r >= k:
        raise ValueError(f"rank must be between 0 and {k - 1}, got {rank}")
    if name in ("1f1b", "zb-h1"):
        return [r, k]
    return [r, 2 * k - 1 - r, 2 * k]


def zero_bubble_worker(
    rank: int,
    world_size: int,
    schedules: Sequence[str] = ("1f1b", "zb-h1", "zb-v", "dualpipev"),
    micro_batches: int = 8,
    forward_s: float = 0.04,
    backward_s: float = 0.08,
    weight_s: float = 0.04,
    repeats: int = 2,
    seed: int = 0,
) -> list[dict]:
    """Time ``repeats`` steps of each schedule on rank ``rank``, in float64, with
    their passes and with empty ones.

    The model is :func:`reference_model` in float64, cut as :func:`pieces_of_rank`
    says; each piece of a V schedule takes half a stage's times. The zero-bubble
    schedules split each backward into an input pass (``backward_s - weight_s``)
    and a weight pass (``weight_s``); 1F1B runs whole backwards. Every schedule is
    built first and runs one untimed step of empty passes (it opens the
    connections). Then come ``repeats`` rounds in which each schedule in turn runs
    one step of *empty* passes (every simulated time zero: what the step costs
    beyond its compute) and one step with its passes; taking turns, the schedules
    meet the same load on the machine. A schedule that PyTorch refuses to build is
    reported, not run: its dict holds ``error``, the exception in one line.
    Otherwise, as :func:`worker`: ``schedule``, ``micro_batches``, ``chunks``,
    ``steps`` and ``empty_steps`` (per timed step with passes, and per empty one,
    this rank's passes as ``(kind, micro_batch, start, end, chunk)``), ``cpu_s``
    (per empty step, the CPU seconds this rank's process used), ``peak_saved_bytes``
    and ``left_saved_bytes`` (per timed step with passes, the most bytes autograd
    held for backward on this rank's pieces at one time, and what it still held at
    the end, measured with a :class:`SavedTensorMeter`; the output gradients a
    weight pass waits for are not saved tensors and are not counted), ``losses`` (on
    the rank that computes the loss) and ``grads`` (named as in :func:`reference`).
    """
    m = _checks.count("micro_batches", micro_batches, minimum=1)
    timed = _checks.count("repeats", repeats, minimum=1)
    dev = device()
    x, y = (t.to(dev, torch.float64) for t in batch(m, seed))
    times = (forward_s, backward_s, weight_s)
    runs = [_zero_bubble_run(name, rank, world_size, m, times, seed, dev) for name in schedules]
    ready = [run for run in runs if "error" not in run]
    for run in ready:  # the warm-up
        _timed_step(run, x, y, empty=True)
    for _ in range(timed):
        for run in ready:
            ops, cpu, _ = _timed_step(run, x, y, empty=True)
            run["empty_steps"].append(ops)
            run["cpu_s"].append(cpu)
            ops, _, losses = _timed_step(run, x, y, empty=False)
            run["steps"].append(ops)
            run["peak_saved_bytes"].append(run["meter"].peak)
            run["left_saved_bytes"].append(run["meter"].held)
            run["losses"] = [value.detach().item() for value in losses]
    for run in ready:
        size = BLOCKS_PER_STAGE * world_size // run["pieces"]
        run["grads"] = {}
        for mod, p in zip(run["modules"], run["held"], strict=True):
            for n, param in mod.named_parameters():
                index, rest = n.split(".", 1)
                if int(index) < size:  # the blocks, not the simulated compute's clock
                    run["grads"][f"{size * p + int(index)}.{rest}"] = param.grad.detach().cpu()
    dist.barrier()
    private = ("modules", "held", "pieces", "runner", "meter", "times")
    return [{k: v for k, v in run.items() if k not in private} for run in runs]


def _zero_bubble_run(
    name: str, rank: int, world_size: int, m: int, times: tuple, seed: int, dev: torch.device
) -> dict:
    """One schedule of :func:`zero_bubble_worker`, built: its pieces, stages and schedule."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as torch_schedules

    forward_s, backward_s, weight_s = times
    *held, pieces = pieces_of_rank(name, rank, world_size)
    chunks = pieces // world_size
    split = weight_s if name != "1f1b" else 0.0
    per_piece = (forward_s / chunks, backward_s / chunks, split / chunks)
    model = reference_model(world_size, seed).to(torch.float64)
    modules = [piece_module(model, p, pieces, *per_piece).to(dev).to(torch.float64) for p in held]
    stages = [PipelineStage(mod, p, pieces, dev) for mod, p in zip(modules, held, strict=True)]
    kind = getattr(torch_schedules, ZERO_BUBBLE_SCHEDULES[name])
    try:
        schedule = kind(
            stages[0] if name == "1f1b" else stages,
            n_microbatches=m,
            loss_fn=nn.functional.mse_loss,
        )
    except (ValueError, NotImplementedError) as error:
        return {"schedule": name, "micro_batches": m, "error": _one_line(error)}
    meter = SavedTensorMeter(exclude=[p for mod in modules for p in mod.parameters()])
    return {
        "schedule": name,
        "micro_batches": m,
        "chunks": chunks,
        "seed": seed,
        "steps": [],
        "empty_steps": [],
        "cpu_s": [],
        "peak_saved_bytes": [],
        "left_saved_bytes": [],
        "losses": [],
        "modules": modules,
        "held": held,
        "pieces": pieces,
        "runner": schedule,
        "meter": meter,
        "times": per_piece,
    }


def _timed_step(
    run: dict, x: torch.Tensor, y: torch.Tensor, empty: bool
) -> tuple[list[tuple], float, list[torch.Tensor]]:
    """One step of ``run``'s schedule after a barrier: this rank's passes (times from
    the step's start), the CPU seconds its process used, and the losses it computed."""
    modules, held, pieces = run["modules"], run["held"], run["pieces"]
    for mod in modules:
        mod.zero_grad(set_to_none=True)
        mod[-1].clear()
        mod[-1].set_times(*((0.0, 0.0, 0.0) if empty else run["times"]))
    losses: list[torch.Tensor] = []
    inputs = (x,) if 0 in held else ()
    last = {"target": y, "losses": losses} if pieces - 1 in held else {}
    dist.barrier()
    t0, cpu = time.perf_counter(), time.process_time()
    run["meter"].reset()
    with run["meter"]:
        run["runner"].step(*inputs, **last)
    return _chunk_ops(modules, t0), time.process_time() - cpu, losses


def hop_latency(rank: int, world_size: int, hops: int = 100) -> float | None:
    """Seconds one micro-batch's activation (float64, as in :func:`zero_bubble_worker`)
    takes from rank 0 to rank 1, one way: half the mean round trip of ``hops`` round
    trips, each way a ``batch_isend_irecv`` as the schedules post theirs, after 10
    untimed ones. Ranks 0 and 1 return it; the others wait and return ``None``."""
    n = _checks.count("hops", hops, minimum=1)
    if world_size < 2:
        raise ValueError(f"world_size must be at least 2 to time a hop, got {world_size}")
    buffer = torch.zeros(EXAMPLES_PER_MICRO_BATCH, WIDTH, dtype=torch.float64, device=device())
    dist.barrier()
    elapsed = None
    if rank < 2:
        peer = 1 - rank
        send = [dist.P2POp(dist.isend, buffer, peer)]
        receive = [dist.P2POp(dist.irecv, buffer, peer)]
        order = (send, receive) if rank == 0 else (receive, send)
        for trip in range(10 + n):
            if trip == 10:
                start = time.perf_counter()
            for ops in order:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        elapsed = (time.perf_counter() - start) / (2 * n)
    dist.barrier()
    return elapsed


def chapter_worker(
    rank: int,
    world_size: int,
    runs: Sequence = (),
    zero_bubble_runs: Sequence = (),
    hops: int = 100,
) -> tuple[list[dict], list[dict], float | None]:
    """Chapter 9's real run, in one start of the ranks: :func:`worker` with the
    arguments ``runs``, :func:`zero_bubble_worker` with ``zero_bubble_runs``, then
    :func:`hop_latency` with ``hops``."""
    return (
        worker(rank, world_size, *runs),
        zero_bubble_worker(rank, world_size, *zero_bubble_runs),
        hop_latency(rank, world_size, hops),
    )


def _one_line(error: BaseException) -> str:
    """``Kind: message`` on one line."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _chunk_ops(modules: Sequence[nn.Sequential], t0: float) -> list[tuple]:
    """This rank's passes on all its pieces, ``(kind, micro_batch, start, end, chunk)``,
    in the order they started; each piece numbers its passes of each kind in turn."""
    ops = []
    for chunk, module in enumerate(modules):
        seen: dict[str, int] = {}
        for kind, start, end in module[-1].events:
            ops.append((kind, seen.get(kind, 0), start - t0, end - t0, chunk))
            seen[kind] = seen.get(kind, 0) + 1
    return sorted(ops, key=lambda op: op[2])


def batch(micro_batches: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for one step: :data:`EXAMPLES_PER_MICRO_BATCH` per micro-batch."""
    m = _checks.count("micro_batches", micro_batches, minimum=1)
    g = torch.Generator().manual_seed(_checks.count("seed", seed))
    size = (m * EXAMPLES_PER_MICRO_BATCH, WIDTH)
    return torch.randn(size, generator=g), torch.randn(size, generator=g)


def reference(model: nn.Module, micro_batches: int, seed: int = 0) -> dict:
    """The single-process answer: full-batch loss and gradients (named ``block.layer.param``).

    It runs on one thread: a model this small gains nothing from more, and on a
    busy machine every operation would wait for the second thread to be scheduled.
    """
    x, y = batch(micro_batches, seed)
    named = list(model.named_parameters())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loss = nn.functional.mse_loss(model(x), y)
        grads = torch.autograd.grad(loss, [p for _, p in named])
    finally:
        torch.set_num_threads(threads)
    return {"loss": loss.item(), "grads": {n: g for (n, _), g in zip(named, grads, strict=True)}}


def _schedule(name: str):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]


def worker(
    rank: int,
    world_size: int,
    schedules: Sequence[str] = ("gpipe", "1f1b"),
    micro_batch_counts: Sequence[int] = (4, 12),
    forward_s: float = 0.02,
    backward_s: float = 0.04,
    repeats: int = 2,
    seed: int = 0,
) -> list[dict]:
    """Time ``repeats`` training steps per (schedule, micro-batch count) on stage ``rank``.

    Each configuration runs a warm-up step of empty passes first (it opens the
    connections between neighbours; the simulated compute takes no time in it), then
    the timed steps. Returns one dict per
    configuration: ``schedule``, ``micro_batches``, ``seed``, ``steps`` (for each timed
    step, this stage's passes as ``(kind, micro_batch, start, end)`` in seconds
    from a common start after a barrier), ``peak_saved_bytes`` and ``left_saved_bytes``
    (for each timed step, the most bytes autograd held for backward on this stage
    at one time, and what it still held when the step ended, measured with a
    :class:`SavedTensorMeter`), ``losses`` (each micro-batch's loss,
    on the last stage only) and ``grads`` (this stage's gradients, named as in
    :func:`reference`). No optimiser step runs, so every step computes the same.
    """
    from torch.distributed.pipelining import PipelineStage

    for name in schedules:
        _checks.choice("schedules", name, ("gpipe", "1f1b"))
    counts = [_checks.count("micro_batch_counts", m, minimum=1) for m in micro_batch_counts]
    timed = _checks.count("repeats", repeats, minimum=1)
    dev = device()
    model = reference_model(world_size, seed)
    module = stage_module(model, rank, world_size, forward_s, backward_s).to(dev)
    clock = module[-1]
    meter = SavedTensorMeter(exclude=module.parameters())
    offset = BLOCKS_PER_STAGE * rank
    results = []
    for name in schedules:
        for micro_batches in counts:
            x, y = (t.to(dev) for t in batch(micro_batches, seed))
            stage = PipelineStage(module, rank, world_size, dev)
            schedule = _schedule(name)(
                stage, n_microbatches=micro_batches, loss_fn=nn.functional.mse_loss
            )
            steps, peaks, left = [], [], []
            for step in range(1 + timed):  # the first step, of empty passes, is the warm-up
                module.zero_grad(set_to_none=True)
                clock.clear()
                clock.set_times(*((forward_s, backward_s) if step else (0.0, 0.0)))
                losses: list[torch.Tensor] = []
                inputs = (x,) if rank == 0 else ()  # the first stage reads the batch
                last = {"target": y, "losses": losses} if rank == world_size - 1 else {}
                dist.barrier()
                t0 = time.perf_counter()
                meter.reset()
                with meter:
                    schedule.step(*inputs, **last)
                if step:
                    steps.append(_numbered(clock.events, t0))
                    peaks.append(meter.peak)
                    left.append(meter.held)
            grads = {
                f"{offset + int(n.split('.')[0])}.{n.split('.', 1)[1]}": p.grad.detach().cpu()
                for n, p in module.named_parameters()
            }
            results.append(
                {
                    "schedule": name,
                    "micro_batches": micro_batches,
                    "seed": seed,
                    "steps": steps,
                    "peak_saved_bytes": peaks,
                    "left_saved_bytes": left,
                    "losses": [value.detach().item() for value in losses],
                    "grads": grads,
                }
            )
    dist.barrier()
    return results


def _numbered(events: list[tuple[str, float, float]], t0: float) -> list[tuple]:
    """``(kind, micro_batch, start, end)`` for each pass, times counted from ``t0``.

    Both schedules run the forwards, and the backwards, in micro-batch order, so
    the n-th forward (or backward) of a stage is micro-batch n.
    """
    seen = {FORWARD: 0, BACKWARD: 0}
    ops = []
    for kind, start, end in events:
        ops.append((kind, seen[kind], start - t0, end - t0))
        seen[kind] += 1
    return ops


def timelines(per_rank: Sequence[dict], key: str = "steps") -> list[Timeline]:
    """The measured :class:`~trainscale.pipeline.Timeline` of each timed step of one
    configuration (of :func:`worker` or :func:`zero_bubble_worker`), from each rank's
    result dict for it (in rank order); ``key="empty_steps"``: of each step of empty
    passes (:func:`zero_bubble_worker`)."""
    if not per_rank:
        raise ValueError("per_rank must hold one result per rank, got none")
    first = per_rank[0]
    if key not in first:
        raise ValueError(f"key must be one of 'steps', 'empty_steps' in the results, got {key!r}")
    return [
        Timeline(
            first["schedule"],
            len(per_rank),
            first["micro_batches"],
            tuple(tuple(Op(*op) for op in result[key][step]) for result in per_rank),
            first.get("chunks", 1),  # model chunks per rank: 2 in a V schedule
        )
        for step in range(len(first[key]))
    ]


def timeline(per_rank: Sequence[dict]) -> Timeline:
    """The least disturbed timed step of one configuration: the one with the smallest
    bubble. Other programs on the machine delay some steps more than others; the
    pipeline's own idle time is in every step."""
    return min(timelines(per_rank), key=lambda t: t.bubble)


def main(rank: int, world_size: int, *args) -> list[dict]:
    """``torchrun`` entry: run :func:`worker` (same arguments); rank 0 reports.

    Rank 0 gathers every stage's passes and prints, per schedule and number of
    micro-batches, the measured bubble next to the formula's, and whether the
    loss equals the single-process loss. Returns this rank's own results.
    """
    results = worker(rank, world_size, *args)
    everyone: list = [None] * world_size
    dist.all_gather_object(
        everyone, [{k: v for k, v in r.items() if k != "grads"} for r in results]
    )
    if rank == 0:
        for index, result in enumerate(results):
            model = reference_model(world_size, result["seed"])
            measured = timeline([ranks[index] for ranks in everyone])
            losses = everyone[-1][index]["losses"]
            expected = reference(model, result["micro_batches"], result["seed"])["loss"]
            same = math.isclose(sum(losses) / len(losses), expected, rel_tol=1e-5)
            formula = bubble(world_size, result["micro_batches"])
            print(
                f"{result['schedule']:5s} {result['micro_batches']:>3} micro-batches:"
                f" loss equals one process {same}, bubble formula {formula:.3f},"
                f" bubble {measured.bubble:.3f} (measured)"
            )
    return results


if __name__ == "__main__":
    torchrun_main(main)
