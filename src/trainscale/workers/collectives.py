"""Collectives on real processes (chapter 6).

* :func:`four_collectives`: all-reduce, reduce-scatter, all-gather and
  broadcast, each rank's input and output;
* :func:`ring_all_reduce`: the ring of :func:`trainscale.collectives.ring_all_reduce`
  written with point-to-point ``isend``/``irecv`` between the ranks, for any
  tensor length;
* :func:`check_ring`: that ring against ``dist.all_reduce``;
* :func:`measure_bandwidth`: the time of one all-reduce against message size,
  from which the chapter derives bandwidth as nccl-tests define it;
* :func:`measure_loopback_bytes`: the bytes that really crossed the loopback
  network interface, against the ring's count;
* :func:`worker`: all of them in one run;
* :func:`check_ring_exercise`: the chapter's "write it yourself" exercise, a reader's
  ring all-reduce run on real ranks and checked (its sum, and the bytes each rank sent),
  as a course's test suite would.

The same file runs on a GPU node, one process per GPU, with NCCL::

    torchrun --nproc-per-node=8 -m trainscale.workers.collectives
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from trainscale import _checks
from trainscale.collectives import ring_bytes_per_rank, ring_schedule
from trainscale.distributed import (
    RankError,
    backend_and_device,
    device,
    run_ranks,
    torchrun_main,
)
from trainscale.workers.exercise import (
    COLLECTIVES,
    ExerciseError,
    ExerciseReport,
    load_reader_function,
    rank_failure,
    reader_source,
    watch_communication,
)

LOOPBACK_TX = Path("/sys/class/net/lo/statistics/tx_bytes")
"""Linux's count of bytes sent through the loopback interface, since boot."""

RING_LENGTHS = (0, 1, 3, 7, 1000)
"""Tensor lengths the ring is checked on: empty, shorter than, not divisible by,
and much longer than the number of ranks (4 in the chapter)."""

BANDWIDTH_SIZES = tuple(4**k * 4096 for k in range(7))
"""Message sizes for the bandwidth sweep: 4 KiB to 16 MiB, in bytes."""


def _synchronise(dev: torch.device) -> None:
    """Wait for the GPU's queued work, so a timer reads when it really ended."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def four_collectives(rank: int, world_size: int) -> dict[str, dict[str, list[int]]]:
    """Run the four collectives once each; return this rank's input and output of each.

    Rank ``r`` starts with ``[10r, 10r + 1, ..., 10r + N - 1]`` (``N`` ranks), so
    every value says which rank it came from. The all-gather gathers what the
    reduce-scatter left on each rank, which rebuilds the all-reduce's result.
    """
    dev = device()
    mine = torch.arange(world_size, dtype=torch.int64, device=dev) + 10 * rank
    results = {}

    summed = mine.clone()
    dist.all_reduce(summed)
    results["all-reduce"] = (mine, summed)

    piece = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.reduce_scatter(piece, list(mine.clone().split(1)))
    results["reduce-scatter"] = (mine, piece)

    pieces = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world_size)]
    dist.all_gather(pieces, piece)
    results["all-gather"] = (piece, torch.cat(pieces))

    copy = mine.clone()
    dist.broadcast(copy, src=0)
    results["broadcast"] = (mine, copy)
    return {
        name: {"input": before.tolist(), "output": after.tolist()}
        for name, (before, after) in results.items()
    }


def ring_all_reduce(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum ``tensor`` over every rank with the ring algorithm, using only ``isend``/``irecv``.

    Call it on every rank of the process group with a 1-D tensor of the same
    length and dtype. The tensor is cut into one chunk per rank as
    :func:`trainscale.collectives.chunks_of` cuts it, and each rank follows
    :func:`trainscale.collectives.ring_schedule`: at every step it sends one
    chunk to its right-hand neighbour while receiving one from its left-hand
    neighbour, so the ring is never idle and no rank waits on a chain. Empty
    chunks (tensors shorter than the ring) are not sent at all; both sides know
    the chunk sizes. ``tensor`` is not modified.

    Returns ``(total, sent)``: the sum, and how many elements this rank sent
    (what :func:`trainscale.collectives.ring_all_reduce` counts for it).
    """
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
        raise ValueError("tensor must be a 1-D torch.Tensor")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % ranks, (rank - 1) % ranks
    total = tensor.clone()
    chunks = torch.tensor_split(total, ranks)  # views: updating a chunk updates ``total``
    sent = 0
    for transfer in ring_schedule(rank, ranks):
        outgoing = chunks[transfer.send_chunk]
        incoming = torch.empty_like(chunks[transfer.recv_chunk])
        requests = []
        if outgoing.numel():
            requests.append(dist.isend(outgoing, right))
        if incoming.numel():
            requests.append(dist.irecv(incoming, left))
        for request in requests:
            request.wait()
        if transfer.phase == "reduce-scatter":
            chunks[transfer.recv_chunk].add_(incoming)
        else:
            chunks[transfer.recv_chunk].copy_(incoming)
        sent += outgoing.numel()
    return total, sent


def ring_input(rank: int, length: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """What ``rank`` contributes to the ring checks: distinct values on every rank.

    Integers (``7**rank`` plus multiples of ``rank + 1``) make any wrong sum
    visible and every right one exact; ``torch.float32`` gives random normals
    seeded by ``rank``.
    """
    r = _checks.count("rank", rank)
    n = _checks.count("length", length)
    if dtype == torch.float32:
        return torch.randn(n, generator=torch.Generator().manual_seed(r))
    return (torch.arange(n, dtype=torch.int64) * (r + 1) + 7**r).to(dtype)


def check_ring(rank: int, world_size: int, lengths: Sequence[int] = RING_LENGTHS) -> list[dict]:
    """The send/recv ring against ``dist.all_reduce``, for each length.

    Returns one dict per length: the ring's integer result (for the chapter to
    compare with the one-process simulation), the elements this rank sent,
    whether the integer sum equals ``dist.all_reduce``'s exactly, and the largest
    difference between the two on float32 data (summed in another order).
    """
    dev = device()
    checks = []
    for length in lengths:
        ints = ring_input(rank, length).to(dev)
        ring, sent = ring_all_reduce(ints)
        reference = ints.clone()
        dist.all_reduce(reference)
        floats = ring_input(rank, length, torch.float32).to(dev)
        float_ring, _ = ring_all_reduce(floats)
        float_reference = floats.clone()
        dist.all_reduce(float_reference)
        gap = (float_ring - float_reference).abs().max().item() if length else 0.0
        checks.append(
            {
                "length": length,
                "result": ring.cpu(),
                "sent": sent,
                "equal": bool(torch.equal(ring, reference)),
                "float_gap": gap,
            }
        )
    return checks


def measure_bandwidth(
    rank: int, world_size: int, sizes: Sequence[int] = BANDWIDTH_SIZES, seconds: float = 0.05
) -> list[float]:
    """Seconds one all-reduce of each size (in bytes, of float32 values) takes.

    For each size: two warm-up all-reduces, a barrier, then as many all-reduces
    as fill about ``seconds`` (at least 3, at most 100, estimated from the
    warm-ups), timed together. The time of the slowest rank counts: the
    collective is done when every rank has its result.
    """
    dev = device()
    times = []
    for size in sizes:
        data = torch.ones(_checks.count("sizes", size, minimum=4) // 4, device=dev)
        start = time.perf_counter()
        for _ in range(2):
            dist.all_reduce(data)
        _synchronise(dev)
        guess = torch.tensor([(time.perf_counter() - start) / 2], dtype=torch.float64, device=dev)
        dist.all_reduce(guess, op=dist.ReduceOp.MAX)  # every rank must repeat as often
        repeats = int(min(100, max(3, seconds / max(guess.item(), 1e-9))))
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(data)
        _synchronise(dev)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=dev)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item() / repeats)
    return times


def _read_loopback() -> int:
    return int(LOOPBACK_TX.read_text())


def measure_loopback_bytes(
    rank: int, world_size: int, tensor_bytes: int = 64 * 2**20, repeats: int = 2, trials: int = 3
) -> dict[str, object] | None:
    """Bytes that crossed the loopback interface during all-reduces, against the ring's count.

    Each of ``trials`` trials reads the interface's counter around ``repeats``
    all-reduces of ``tensor_bytes`` bytes, then around an idle wait just as long
    (the machine's other loopback traffic, to subtract). Rank 0 reads and
    returns ``{"active": [...], "idle": [...], "expected": bytes}`` with one
    entry per trial; the others return ``None``. ``expected`` is what the ring
    sends in all: ``2(N-1)/N`` of the tensor, from each of the ``N`` ranks, per
    all-reduce. Returns ``None`` everywhere when ``/sys/class/net/lo`` is missing
    or the ranks talk over NCCL (GPU links, not the loopback interface).
    """
    backend = backend_and_device(rank)[0]
    here = torch.tensor([int(LOOPBACK_TX.exists() and backend == "gloo")])
    dist.all_reduce(here, op=dist.ReduceOp.MIN)
    if not here.item():
        return None
    data = torch.ones(_checks.count("tensor_bytes", tensor_bytes, minimum=4) // 4)
    dist.all_reduce(data)  # warm-up: connections and buffers are in place
    active, idle = [], []
    for _ in range(trials):
        # Rank 0 reads the counter before the first barrier and after the last one:
        # no rank can start sending before rank 0 has read, or still be sending after.
        before, start = _read_loopback(), time.perf_counter()
        dist.barrier()
        for _ in range(repeats):
            dist.all_reduce(data)
        dist.barrier()
        after, elapsed = _read_loopback(), time.perf_counter() - start
        if rank == 0:
            time.sleep(elapsed)  # the others wait in the barrier below, sending nothing
            active.append(after - before)
            idle.append(_read_loopback() - after)
        dist.barrier()
    if rank != 0:
        return None
    expected = ring_bytes_per_rank(data.nbytes, world_size) * world_size * repeats
    return {"active": active, "idle": idle, "expected": expected, "tensor_bytes": data.nbytes}


def loopback_ratio(measured: dict[str, object]) -> float:
    """Bytes that crossed loopback for the all-reduces, over what the ring should send.

    ``measured`` is what :func:`measure_loopback_bytes` returns on rank 0. Each
    trial's idle bytes (other traffic on the machine) are subtracted from its
    active bytes; the median over the trials is taken, so one trial disturbed by
    another program's burst of traffic does not decide the result.
    """
    active, idle = measured["active"], measured["idle"]
    expected = _checks.positive("expected", measured["expected"])
    if not active or len(active) != len(idle):
        raise ValueError("active and idle must hold one count per trial (at least 1)")
    return statistics.median((a - i) / expected for a, i in zip(active, idle, strict=True))


def worker(
    rank: int,
    world_size: int,
    ring_lengths: Sequence[int] = RING_LENGTHS,
    bandwidth_sizes: Sequence[int] = BANDWIDTH_SIZES,
    loopback_tensor_bytes: int = 64 * 2**20,
) -> dict[str, object]:
    """Every check of chapter 6 on this rank, in one run (starting processes is slow).

    Returns ``{"collectives": ..., "ring": ..., "bandwidth": ..., "loopback": ...}``
    from :func:`four_collectives`, :func:`check_ring`, :func:`measure_bandwidth`
    and :func:`measure_loopback_bytes`. Each of those is a worker too, for
    :func:`trainscale.distributed.run_ranks` to run alone.
    """
    return {
        "collectives": four_collectives(rank, world_size),
        "ring": check_ring(rank, world_size, ring_lengths),
        "bandwidth": measure_bandwidth(rank, world_size, bandwidth_sizes),
        "loopback": measure_loopback_bytes(rank, world_size, loopback_tensor_bytes),
    }


# --- "Write it yourself": the reader's ring, checked on real ranks ----------------------

EXERCISE_LENGTHS = (4, 7, 1000)
"""Lengths the reader's ring is checked on (4 ranks): one element per rank, chunks of
unequal size, and the length whose bytes are checked against 2(N-1)/N."""


def ring_exercise_worker(
    rank: int, world_size: int, source: str, name: str, lengths: Sequence[int]
) -> list[dict]:
    """On one rank: build the reader's function from ``source``, call it on this rank's
    :func:`ring_input` of each length, and return its result, the true sum (from
    ``dist.all_reduce``, called before the reader's code runs) and the bytes it sent."""
    inputs = [ring_input(rank, length) for length in lengths]
    sums = [x.clone() for x in inputs]
    for total in sums:
        dist.all_reduce(total)
    sent: dict[str, int] = {}
    why = "your ring called dist.{name}: build it from dist.isend/dist.irecv (or send/recv) alone"
    watch_communication(sent, refuse=COLLECTIVES, why=why)
    ring = load_reader_function(source, name, {"torch": torch, "dist": dist})
    checks = []
    for x, total in zip(inputs, sums, strict=True):
        sent.clear()
        result = ring(x.clone())
        if isinstance(result, tuple):  # (total, sent), as this module's ring returns
            result = result[0]
        if not isinstance(result, torch.Tensor):
            raise ExerciseError(f"your function returned {type(result).__name__}, not a tensor")
        sent_bytes = sent.get("send", 0) + sent.get("isend", 0)
        checks.append({"result": result.detach().cpu(), "sum": total, "sent": sent_bytes})
    return checks


_HANG_HINT = (
    "a rank is waiting for a message no rank sends. Each step, every rank sends to"
    " rank + 1 and receives from rank - 1 (mod N): post both (isend and irecv) before"
    " waiting on either, and make every rank take the same number of steps"
)


def check_ring_exercise(
    function: Callable[[torch.Tensor], torch.Tensor],
    ranks: int = 4,
    lengths: Sequence[int] = EXERCISE_LENGTHS,
    timeout: float = 60.0,
) -> ExerciseReport:
    """Run the reader's ring all-reduce on ``ranks`` real gloo processes and check it.

    ``function(tensor)`` is called on every rank with that rank's 1-D int64 tensor
    (:func:`ring_input`) and must return the element-wise sum over all ranks, using
    only ``dist.isend``/``dist.irecv`` (or ``send``/``recv``): any collective is
    refused. Checked: every rank's result equals ``dist.all_reduce``'s, for each of
    ``lengths``; and, for the last length (which should divide by ``ranks``), that
    each rank sent exactly ``2(N-1)/N`` of the tensor's bytes, as a ring does.
    """
    n = _checks.count("ranks", ranks, minimum=2)
    lengths = [_checks.count("length", length, minimum=n) for length in lengths]
    if not lengths:
        raise ValueError("lengths must hold at least one length")
    source, name = reader_source(function)
    report = ExerciseReport(f"your ring all-reduce on {n} ranks, lengths {lengths}:")
    try:
        results = run_ranks(ring_exercise_worker, n, source, name, lengths, timeout=timeout)
    except RankError as error:
        report.fail(rank_failure(error, timeout, _HANG_HINT))
        return report
    for index, length in enumerate(lengths):
        wrong = [
            rank
            for rank, result in enumerate(results)
            if not torch.equal(result[index]["result"], result[index]["sum"])
        ]
        if not wrong:
            report.ok(f"length {length:,}: every rank holds the sum dist.all_reduce gives")
            continue
        got, want = results[wrong[0]][index]["result"], results[wrong[0]][index]["sum"]
        if got.shape != want.shape:
            report.fail(
                f"length {length:,}: rank {wrong[0]} returned shape {tuple(got.shape)},"
                f" not {tuple(want.shape)}"
            )
            continue
        first = int((got != want).nonzero()[0])
        report.fail(
            f"length {length:,}: ranks {wrong} hold a wrong sum (rank {wrong[0]}, element"
            f" {first}: {int(got[first])} instead of {int(want[first])}). In the"
            " reduce-scatter a rank adds what it receives; in the all-gather it replaces"
            " its chunk with what it receives"
        )
    length = lengths[-1]
    tensor_bytes = length * torch.tensor([], dtype=torch.int64).element_size()
    expected = ring_bytes_per_rank(tensor_bytes, n)
    sent = [result[-1]["sent"] for result in results]
    if all(s == expected for s in sent):
        report.ok(
            f"length {length:,} ({tensor_bytes:,} bytes): each rank sent {expected:,.0f} bytes"
            f" = 2({n}-1)/{n} of the tensor"
        )
    else:
        report.fail(
            f"length {length:,} ({tensor_bytes:,} bytes): the ranks sent {sent} bytes; a ring"
            f" sends 2({n}-1)/{n} of the tensor from each rank, {expected:,.0f} bytes: at each"
            f" of its 2({n}-1) steps a rank sends one chunk, 1/{n} of the tensor"
        )
    return report


def main(rank: int, world_size: int) -> None:
    """``torchrun`` entry: run the four collectives and :func:`worker`; rank 0 reports."""
    from trainscale.collectives import bus_bandwidth

    got = worker(rank, world_size)
    if rank != 0:
        return
    for name, values in got["collectives"].items():
        print(f"{name:15s} rank 0: {values['input']} -> {values['output']}")
    for check in got["ring"]:
        print(
            f"ring, length {check['length']:>4}: equals dist.all_reduce {check['equal']},"
            f" rank 0 sent {check['sent']} elements"
        )
    for size, seconds in zip(BANDWIDTH_SIZES, got["bandwidth"], strict=True):
        algbw = size / seconds / 1e9
        busbw = bus_bandwidth(algbw, world_size)
        print(
            f"{size:>10,} bytes: algbw {algbw:.3f} GB/s (measured),"
            f" busbw {busbw:.3f} GB/s (measured)"
        )


if __name__ == "__main__":
    torchrun_main(main)
