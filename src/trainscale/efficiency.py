"""Measuring efficiency on the machine in front of you (chapter 15).

Model FLOPs utilisation (:func:`trainscale.compute.mfu`) divides two numbers
that must be measured: how fast the training loop really gets through the
model's ``6N`` FLOPs per token, and how fast the hardware can do arithmetic at
best. This module measures both, on the CPU or on an accelerator:

- :func:`matmul_rates` times square matrix products, the best case of the
  hardware, which gives the peak MFU divides by;
- :func:`measure_training` times every step of a small training loop, and
  how long each step waited for its batch; :class:`StepTimes` leaves the
  warmup steps out of its averages;
- :class:`SlowLoader` and :func:`prefetch` build a data pipeline whose speed
  you control, and :func:`loader_timeline` models when the accelerator has to
  wait for it.

Only the timings vary from run to run. Everything else (FLOP counts, the
loader's order, the timeline model, the warmup arithmetic) is exact, and the
clock and the sleep can be passed in, so it is tested without timing anything.
"""

from __future__ import annotations

import argparse
import math
import queue
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.flop_counter import FlopCounterMode

from trainscale import _checks, memory
from trainscale.compute import mfu as model_flops_utilisation

T = TypeVar("T")
Batch = tuple[torch.Tensor, torch.Tensor]

MAX_CALLS = 10_000
"""Most calls :func:`best_seconds` makes in one timed repeat."""


# --- FLOPs ---------------------------------------------------------------------------


def matmul_flops(m: int, k: int, n: int) -> int:
    """FLOPs of one ``(m, k) @ (k, n)`` product: ``2 * m * k * n``.

    Each of the ``m * n`` outputs needs ``k`` multiplications and ``k`` additions
    (a fused multiply-add counts as two FLOPs, as peak figures count it).
    """
    return 2 * _checks.count("m", m) * _checks.count("k", k) * _checks.count("n", n)


def mlp_stack_params(width: int = 256, blocks: int = 8) -> int:
    """Parameters of :func:`trainscale.memory.mlp_stack`: ``blocks * (8 w^2 + 5 w)``.

    Each block holds two ``w x 4w`` weight matrices (``8 w^2``) and the two
    layers' biases (``4w + w``).
    """
    w = _checks.count("width", width, minimum=1)
    return _checks.count("blocks", blocks, minimum=1) * (8 * w * w + 5 * w)


def counted_step_flops(
    model: nn.Sequential, batch: Batch, *, checkpointed: bool = False
) -> dict[str, int]:
    """FLOPs of one forward and backward pass, counted by ``FlopCounterMode``.

    Returns ``{"forward": ..., "backward": ...}``. The counter sees only matrix
    products, the work MFU is about. With ``checkpointed=True`` the model runs
    through :func:`trainscale.memory.run_checkpointed` (one block per segment),
    so backward also recomputes every block's forward: the hardware does more
    FLOPs for the same model FLOPs. Gradients are taken with
    ``torch.autograd.grad``, so the model's ``.grad`` fields are left untouched.
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"model must be an nn.Sequential, got {type(model).__name__}")
    x, target = batch
    params = [p for p in model.parameters() if p.requires_grad]
    with FlopCounterMode(display=False) as forward:
        out = memory.run_checkpointed(model, x) if checkpointed else model(x)
        loss = nn.functional.mse_loss(out, target)
    with FlopCounterMode(display=False) as backward:
        torch.autograd.grad(loss, params)
    return {"forward": forward.get_total_flops(), "backward": backward.get_total_flops()}


# --- timing ----------------------------------------------------------------------------


def synchronizer(device: str | torch.device) -> Callable[[], None] | None:
    """A function that waits until ``device`` has finished its queued work.

    ``None`` on the CPU, where every operation has finished when it returns.
    A GPU runs kernels asynchronously: Python gets control back as soon as a
    kernel is *queued*, so a clock read without waiting measures how fast
    work was launched, not how fast it ran.
    """
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return lambda: torch.accelerator.synchronize(dev)


def best_seconds(
    fn: Callable[[], object],
    *,
    repeats: int = 5,
    min_seconds: float = 0.05,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """The fastest time per call of ``fn()``, in seconds, over ``repeats`` timed runs.

    The first call is warmup and not counted. A second call sizes the runs:
    each run makes enough calls (at most :data:`MAX_CALLS`) to last about
    ``min_seconds``, so the clock's resolution does not matter, then waits for
    the device (``sync``) before reading the clock. The *best* run is kept:
    anything else running on the machine can only make a run slower.
    """
    n_repeats = _checks.count("repeats", repeats, minimum=1)
    floor = _checks.positive("min_seconds", min_seconds)

    def run(calls: int) -> float:
        start = clock()
        for _ in range(calls):
            fn()
        if sync is not None:
            sync()
        return clock() - start

    run(1)  # warmup: first-call allocations, lazy initialisation, caches
    one = run(1)
    calls = MAX_CALLS if one <= 0 else max(1, min(MAX_CALLS, math.ceil(floor / one)))
    return min(run(calls) / calls for _ in range(n_repeats))


def matmul_rate(
    size: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    repeats: int = 5,
    min_seconds: float = 0.05,
) -> float:
    """FLOP/s of a ``size x size`` by ``size x size`` matrix product on ``device``.

    The best of ``repeats`` timed runs (:func:`best_seconds`); the matrices are
    random, drawn from a fixed seed without touching the global random state,
    and the product is written into a preallocated output.
    """
    n = _checks.count("size", size, minimum=1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    dev = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator).to(dev, dtype)
    b = torch.randn(n, n, generator=generator).to(dev, dtype)
    out = torch.empty(n, n, dtype=dtype, device=dev)
    seconds = best_seconds(
        lambda: torch.mm(a, b, out=out),
        repeats=repeats,
        min_seconds=min_seconds,
        sync=synchronizer(dev),
    )
    return matmul_flops(n, n, n) / seconds


def matmul_rates(sizes: Iterable[int], **kwargs) -> dict[int, float]:
    """:func:`matmul_rate` for each of ``sizes``: ``{size: FLOP/s}``.

    The largest value is the machine's *measured* peak: what its matrix
    library achieves at best, a little below the vendor's figure.
    """
    chosen = list(sizes)
    if not chosen:
        raise ValueError("sizes must hold at least one matrix size, got none")
    return {int(size): matmul_rate(size, **kwargs) for size in chosen}


def time_steps(
    step: Callable[[T], object],
    batches: Iterable[T],
    *,
    warmup: int = 0,
    sync: Callable[[], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> StepTimes:
    """Run ``step(batch)`` for every batch and time each step and its wait for data.

    A step lasts from the end of the previous one to the end of its own, so it
    includes waiting for its batch: a slow loader shows up in the step time,
    as it does in a real job. The wait (until the loader handed the batch
    over) is recorded on its own too. ``sync`` (see :func:`synchronizer`)
    waits for the device before the clock is read. The first ``warmup`` steps
    are left out of the result's averages.
    """
    seconds, waiting = [], []
    source = iter(batches)
    start = clock()
    while True:
        try:
            batch = next(source)
        except StopIteration:
            break
        arrived = clock()
        step(batch)
        if sync is not None:
            sync()
        end = clock()
        seconds.append(end - start)
        waiting.append(arrived - start)
        start = end
    if not seconds:
        raise ValueError("batches must yield at least one batch, got none")
    return StepTimes(tuple(seconds), warmup, tuple(waiting))


@dataclass(frozen=True)
class StepTimes:
    """The measured duration of every step of a loop, the first ``warmup`` excluded from
    its averages by default.

    Early steps are slower for reasons that do not recur: optimiser state is
    created on the first step, loader workers start, and on a GPU kernels are
    compiled, autotuned and graphs captured. Averages over a window that
    includes them describe the start-up, not the run.

    ``waiting``, if recorded, holds the part of each step spent waiting for
    its batch to arrive: the time a GPU would sit idle because of the loader.
    """

    seconds: tuple[float, ...]
    warmup: int
    waiting: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        values = tuple(_checks.non_negative("seconds", s) for s in self.seconds)
        object.__setattr__(self, "seconds", values)
        waits = tuple(_checks.non_negative("waiting", w) for w in self.waiting)
        object.__setattr__(self, "waiting", waits)
        skipped = _checks.count("warmup", self.warmup)
        if skipped >= len(values):
            raise ValueError(
                f"warmup must be in [0, {len(values)}) to leave at least one step, "
                f"got {self.warmup!r}"
            )
        if waits and (
            len(waits) != len(values) or any(w > s for w, s in zip(waits, values, strict=True))
        ):
            raise ValueError(
                "waiting must hold one time per step, each at most that step's seconds"
            )

    @property
    def steady(self) -> tuple[float, ...]:
        """The steps after warmup."""
        return self.seconds[self.warmup :]

    def seconds_per_step(self, *, include_warmup: bool = False, statistic: str = "mean") -> float:
        """Mean or median seconds per step, over the steady steps or over all of them.

        The mean is what a long run's throughput is made of (total time over
        total steps); the median ignores the odd step slowed by another program.
        """
        how = _checks.choice("statistic", statistic, ("mean", "median"))
        values = self.seconds if include_warmup else self.steady
        return statistics.fmean(values) if how == "mean" else statistics.median(values)

    def waiting_share(self, *, include_warmup: bool = False) -> float:
        """Share of the time spent waiting for data: total wait over total step time.

        Both come from the same steps, so the share does not drift when other
        programs speed the machine up or slow it down between two runs.
        """
        if not self.waiting:
            raise ValueError("waiting must have been recorded (see time_steps), got none")
        first = 0 if include_warmup else self.warmup
        total = sum(self.seconds[first:])
        if total == 0:
            raise ValueError("seconds must not all be 0: a step cannot take no time")
        return sum(self.waiting[first:]) / total

    def per_second(
        self, items_per_step: float, *, include_warmup: bool = False, statistic: str = "mean"
    ) -> float:
        """Items (examples or tokens) per second: ``items_per_step / seconds_per_step``."""
        items = _checks.positive("items_per_step", items_per_step)
        seconds = self.seconds_per_step(include_warmup=include_warmup, statistic=statistic)
        if seconds == 0:
            raise ValueError("seconds must not all be 0: a step cannot take no time")
        return items / seconds

    def mfu(
        self,
        items_per_step: float,
        params: float,
        peak_flops: float,
        *,
        include_warmup: bool = False,
        statistic: str = "mean",
    ) -> float:
        """MFU of the loop on one device: ``6 * params * items/s / peak_flops``
        (:func:`trainscale.compute.mfu`), items being tokens, or examples for an MLP."""
        rate = self.per_second(items_per_step, include_warmup=include_warmup, statistic=statistic)
        return model_flops_utilisation(rate, params, gpus=1, peak_flops=peak_flops)


# --- a training loop to measure --------------------------------------------------------


def synthetic_batches(count: int, batch: int, width: int = 256, seed: int = 0) -> list[Batch]:
    """``count`` random ``(input, target)`` pairs of shape ``(batch, width)``, in fp32.

    Drawn from their own generator, so making them leaves the global random
    state alone. Synthetic data costs nothing to load: a loop fed from it runs
    as fast as the model and the hardware allow, the baseline to compare a
    real data pipeline with.
    """
    n = _checks.count("count", count)
    b = _checks.count("batch", batch, minimum=1)
    w = _checks.count("width", width, minimum=1)
    generator = torch.Generator().manual_seed(_checks.count("seed", seed))
    return [
        (torch.randn(b, w, generator=generator), torch.randn(b, w, generator=generator))
        for _ in range(n)
    ]


class BatchList(Dataset):
    """Ready-made batches as a map-style dataset: item ``i`` is batch ``i``.

    It lives in this module (not in a notebook) so that a ``DataLoader``'s
    worker processes, started with ``spawn``, can import it.
    """

    def __init__(self, batches: Sequence[Batch]) -> None:
        self.batches = list(batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Batch:
        return self.batches[index]


def worker_loader(batches: Sequence[Batch], workers: int) -> DataLoader:
    """A PyTorch ``DataLoader`` that hands out ``batches`` in order from ``workers`` processes.

    Each worker is a fresh interpreter (``spawn``: forking a process that has
    already run torch maths can hang) that must import torch before it
    produces its first batch, and the loader starts its workers when iteration
    begins, every epoch unless ``persistent_workers`` is set: a start-up cost
    the first step of a loop pays. With ``workers = 0`` the batches are
    handed out by the calling process, with no start-up and no prefetching.
    """
    n = _checks.count("workers", workers)
    return DataLoader(
        BatchList(batches),
        batch_size=None,  # the items are whole batches already
        shuffle=False,
        num_workers=n,
        multiprocessing_context="spawn" if n else None,
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.mse_loss,
) -> Callable[[Batch], torch.Tensor]:
    """One full training step as a function of the batch: forward, backward, optimiser.

    The returned function gives back the loss as a tensor (``.item()`` would
    wait for a GPU at every step).
    """

    def step(batch: Batch) -> torch.Tensor:
        x, target = batch
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), target)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def measure_training(
    batch: int,
    *,
    steps: int = 15,
    warmup: int = 3,
    width: int = 256,
    blocks: int = 8,
    delay: float = 0.0,
    depth: int = 0,
    workers: int = 0,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> StepTimes:
    """Time ``steps`` training steps of a fresh ``mlp_stack(width, blocks)`` with AdamW.

    Every step gets its own synthetic batch of ``batch`` examples. With
    ``delay`` > 0 each batch is handed over by a :class:`SlowLoader` that
    takes ``delay`` seconds per batch; with ``depth`` > 0 the batches come
    through :func:`prefetch`, loaded up to ``depth`` ahead by a background
    thread. With ``workers`` > 0 (and no delay) they come from a
    :func:`worker_loader` with that many worker processes, whose start-up the
    first step waits for. The first ``warmup`` steps are kept in the result but
    left out of its averages.
    """
    n_steps = _checks.count("steps", steps, minimum=1)
    wait = _checks.non_negative("delay", delay)
    ahead = _checks.count("depth", depth)
    processes = _checks.count("workers", workers)
    if processes and (wait or ahead):
        raise ValueError(
            "workers must be 0 when delay or depth is set (one kind of loader at a time)"
        )
    dev = torch.device(device)
    model = memory.mlp_stack(width, blocks, seed).to(dev, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [
        (x.to(dev, dtype), y.to(dev, dtype))
        for x, y in synthetic_batches(n_steps, batch, width, seed)
    ]
    source: Iterable[Batch] = SlowLoader(data, wait) if wait else data
    if processes:
        source = _to_device(worker_loader([(x.cpu(), y.cpu()) for x, y in data], processes), dev)
    if ahead:
        source = prefetch(source, ahead)
    return time_steps(train_step(model, optimizer), source, warmup=warmup, sync=synchronizer(dev))


def _to_device(batches: Iterable[Batch], device: torch.device) -> Iterator[Batch]:
    """Move each batch to ``device`` as it is taken (iteration starts at the first ``next``)."""
    for x, y in batches:
        yield x.to(device), y.to(device)


# --- a data pipeline of known speed ----------------------------------------------------


class SlowLoader(Generic[T]):
    """Hands out the items of ``source`` in order, each after ``delay`` seconds.

    A stand-in for reading and decoding a batch: the delay is a ``sleep``,
    like waiting for storage or the network, which releases Python's GIL so a
    background thread can overlap it with computation. (Decoding written in
    Python holds the GIL; real loaders therefore use worker *processes*.)
    ``sleep`` can be replaced, e.g. by a recorder in tests. Each iteration
    goes through ``source`` again from the start.
    """

    def __init__(
        self,
        source: Sequence[T],
        delay: float,
        *,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.source = source
        self.delay = _checks.non_negative("delay", delay)
        self._sleep = sleep

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Iterator[T]:
        for item in self.source:
            if self.delay:
                self._sleep(self.delay)
            yield item


_DONE = object()


def prefetch(source: Iterable[T], depth: int = 2) -> Iterator[T]:
    """Yield the items of ``source`` in order, loaded ahead by a background thread.

    The thread takes items from ``source`` and puts them in a queue of
    ``depth`` places; the caller takes them out. While the caller computes on
    one batch, the thread is already loading the next ones, so a loader that
    is faster than a step on average costs nothing. An exception raised by
    ``source`` is raised in the caller, at the position where it happened.
    The thread starts on the first ``next()`` and is stopped and joined when
    the iterator is exhausted or closed.
    """
    size = _checks.count("depth", depth, minimum=1)
    return _prefetched(source, size)


def _prefetched(source: Iterable[T], size: int) -> Iterator[T]:
    items: queue.Queue = queue.Queue(maxsize=size)
    stop = threading.Event()

    def put(entry: tuple[bool, object]) -> bool:
        """Put ``entry`` in the queue unless the consumer has gone; say whether it did."""
        while not stop.is_set():
            try:
                items.put(entry, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def fill() -> None:
        try:
            for item in source:
                if not put((True, item)):
                    return
            put((False, _DONE))
        except BaseException as error:  # raised again in the consumer
            put((False, error))

    thread = threading.Thread(target=fill, name="trainscale-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            is_item, value = items.get()
            if is_item:
                yield value
            elif value is _DONE:
                return
            else:
                raise value
    finally:
        stop.set()
        thread.join()


# --- a model of loading and computing --------------------------------------------------


@dataclass(frozen=True)
class Span:
    """One bar of a loader timeline: ``lane`` ("load" or "compute") works on batch
    ``step`` from ``start`` to ``end`` (seconds)."""

    lane: str
    step: int
    start: float
    end: float


def loader_timeline(compute: float, loads: Sequence[float], depth: int) -> list[Span]:
    """When each batch is loaded and computed on, for a loader that takes ``loads[i]``
    seconds for batch ``i`` and a step that computes for ``compute`` seconds.

    ``depth = 0``: no prefetching. Batch ``i`` is loaded only when step
    ``i - 1`` has finished, so loading and computing take turns.

    ``depth >= 1``: the :func:`prefetch` model. A background loader works
    through the batches one after another; a finished batch waits for a free
    place in a queue of ``depth`` places (one frees up when the step takes
    batch ``i - depth`` out), and the loader starts on the next batch only
    once it has handed this one over. Step ``i`` starts when its batch is
    ready and step ``i - 1`` is done.
    """
    c = _checks.positive("compute", compute)
    durations = [_checks.non_negative("loads", load) for load in loads]
    ahead = _checks.count("depth", depth)
    spans: list[Span] = []
    taken: list[float] = []  # when each step took its batch (= started computing)
    load_start = compute_end = 0.0
    for i, load in enumerate(durations):
        if ahead == 0:
            load_start = compute_end
        load_end = load_start + load
        handed_over = max(load_end, taken[i - ahead]) if 0 < ahead <= i else load_end
        start = max(handed_over, compute_end)
        spans.append(Span("load", i, load_start, load_end))
        spans.append(Span("compute", i, start, start + c))
        taken.append(start)
        compute_end = start + c
        load_start = handed_over
    return spans


def busy_share(spans: Sequence[Span]) -> float:
    """Share of the time, from 0 to the end of the last step, spent computing."""
    work = [s for s in spans if s.lane == "compute"]
    if not work:
        raise ValueError("spans must hold at least one compute span, got none")
    return sum(s.end - s.start for s in work) / max(s.end for s in work)


def steady_step_seconds(compute: float, load: float, prefetched: bool) -> float:
    """Seconds per step once a loop with a constant ``load`` time per batch settles.

    Without prefetching the two take turns, ``compute + load``; with it they
    overlap and the slower one sets the pace, ``max(compute, load)``.
    """
    c = _checks.positive("compute", compute)
    ld = _checks.non_negative("load", load)
    return max(c, ld) if prefetched else c + ld


# --- command line: the same measurement on a GPU ---------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    """Measure the peak matmul rate and the MFU of the MLP loop on one device.

    ``python -m trainscale.efficiency --device cuda --dtype bfloat16`` on a GPU
    machine; the defaults measure the CPU in fp32, with PyTorch's default number
    of threads unless ``--threads`` says otherwise (more threads than idle
    cores make small products far slower: the threads wait for each other).
    """
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--sizes", type=int, nargs="+", help="matrix sizes to time")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, help="CPU threads (default: PyTorch's choice)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(_checks.count("threads", args.threads, minimum=1))
    threads = torch.get_num_threads()
    print(f"device {args.device}, {args.dtype}, {threads} CPU thread{'s' * (threads != 1)}")
    dtype = getattr(torch, args.dtype)
    on_cpu = torch.device(args.device).type == "cpu"
    sizes = args.sizes or ([256, 512, 1024] if on_cpu else [2048, 4096, 8192])
    rates = matmul_rates(sizes, dtype=dtype, device=args.device)
    for size, rate in rates.items():
        print(f"matmul {size} x {size}: {rate / 1e9:.1f} GFLOP/s (measured)")
    peak = max(rates.values())
    params = mlp_stack_params(args.width)
    for batch in args.batches:
        times = measure_training(
            batch,
            steps=args.steps,
            warmup=args.warmup,
            width=args.width,
            device=args.device,
            dtype=dtype,
        )
        share = times.mfu(batch, params, peak, statistic="median")
        print(f"micro-batch {batch:>4}: MFU {share:.1%} (measured)")
        if share > 1:
            print("  above 100 %: the peak was measured on too small matrices; pass larger --sizes")


if __name__ == "__main__":
    main()
