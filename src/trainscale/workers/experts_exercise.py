"""Chapter 11's exercise: a reader's expert-parallel dispatch, checked on real ranks.

The reader writes ``dispatch(tokens, expert_of_token, experts_per_rank)``: each rank
holds rows (``(T, h)`` float64, one per token copy) and each row's expert; rank ``q``
holds experts ``q * experts_per_rank`` onwards. It sends every row to its expert's rank
with **one** ``dist.all_to_all_single`` of the rows, after one of the counts, and returns
the rows received by local expert, then source rank, then the source's order (the order
Megatron-Core's ``MoEAlltoAllTokenDispatcher`` restores with ``sort_chunks_by_idxs``).
:func:`check_dispatch` runs it on 4 gloo ranks (:func:`exercise_inputs`: a seeded,
uneven routing) and reports per check: the rows against :func:`expected_rows` (a plain
gather, no collective), the calls, and the bytes of rows each rank put in against each
row once. Other collectives are refused; sizes that disagree with the peers' are
reported before they can hang. Under torchrun::

    torchrun --nproc-per-node=4 -m trainscale.workers.experts_exercise
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from trainscale import _checks
from trainscale.distributed import RankError, run_ranks, torchrun_main
from trainscale.workers.exercise import (
    ExerciseError,
    ExerciseReport,
    load_reader_function,
    rank_failure,
    reader_source,
    watch_communication,
)

HIDDEN = 4
"""Values per row (float64): small, so that a wrong row is easy to print."""

_WHY = (
    "your dispatch called dist.{name}: exchange the counts and the rows with"
    " dist.all_to_all_single alone (a gather or broadcast of the batch sends every row"
    " to every rank, N times what the experts need)"
)

_HANG_HINT = (
    "a rank waits in an all_to_all_single that another rank never enters: every rank"
    " calls it exactly twice (the counts, then the rows), even one with no rows to send"
)

Dispatch = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""``dispatch(tokens, expert_of_token, experts_per_rank)``: the rows this rank received."""


def exercise_inputs(
    rank: int, world_size: int, experts_per_rank: int = 2, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows (float64, ``(T, HIDDEN)``) and each row's expert (int64).

    ``T`` is 8 + (5 rank + 3) mod 7 (11, 9, 14, 12 rows on 4 ranks); the experts are
    drawn with weights (5 e + 3) mod 7, so uneven, and expert 5 (weight 0) gets no row.
    """
    r = _checks.count("rank", rank, minimum=0)
    n = _checks.count("world_size", world_size, minimum=1)
    if r >= n:
        raise ValueError(f"rank must be in 0 .. {n - 1}, got {rank}")
    experts = n * _checks.count("experts_per_rank", experts_per_rank, minimum=1)
    g = torch.Generator().manual_seed(1000 * _checks.count("seed", seed) + r)
    rows = 8 + (5 * r + 3) % 7
    weights = torch.tensor([float((5 * e + 3) % 7) for e in range(experts)])
    if not weights.any():  # one expert: it takes every row
        weights += 1
    chosen = torch.multinomial(weights, rows, replacement=True, generator=g)
    return torch.randn(rows, HIDDEN, generator=g, dtype=torch.float64), chosen


def expected_rows(experts: Sequence[Sequence[int]], rank: int, per_rank: int) -> list:
    """``(source rank, row)`` of the rows ``rank`` must return, in order: local expert,
    then source rank, then row; ``experts[s]`` lists the expert of each row of rank ``s``."""
    local = range(rank * per_rank, (rank + 1) * per_rank)
    return [
        (s, i)
        for e in local
        for s, held in enumerate(experts)
        for i, x in enumerate(held)
        if x == e
    ]


def _splits(sizes: object, rows: int, n: int) -> list[int] | None:
    """Split sizes as ints; ``None`` means equal parts (``None`` back if rows do not divide)."""
    if sizes is None:
        return [rows // n] * n if rows % n == 0 else None
    return [int(s) for s in sizes]


def _guard(calls: list[tuple[bool, int]], send: list[int], receive: list[int]) -> None:
    """Wrap ``dist.all_to_all_single``: record each call (of rows or not, bytes put in);
    if a call of rows (2-D) has sizes other than the routing's, run it with the right ones
    (so no peer waits forever), then raise :class:`ExerciseError` saying which."""
    from torch.distributed import distributed_c10d

    inner = dist.all_to_all_single

    def call(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        rows = input.dim() == 2
        calls.append((rows, input.numel() * input.element_size()))
        n = len(send)
        ins = _splits(input_split_sizes, input.shape[0], n)
        outs = _splits(output_split_sizes, output.shape[0], n)
        if rows and (ins != send or outs != receive or output.shape[0] != sum(receive)):
            width = input.shape[1]
            scratch = input.new_empty(sum(receive), width), input.new_zeros(sum(send), width)
            inner(*scratch, receive, send, group=group)
            got = outs if outs is not None else f"{output.shape[0]} rows in equal parts"
            why = f"was told to receive {got} rows from ranks 0-{n - 1}, but they send {receive}"
            if ins != send:
                why = f"was told to send {ins} rows to ranks 0-{n - 1}, but holds {send} for them"
            raise ExerciseError(
                f"rank {dist.get_rank()}'s all_to_all_single of the rows {why}: no rank knows"
                " how many rows will arrive until the others say so; exchange the counts"
                " first (a count per expert, with all_to_all_single)"
            )
        return inner(output, input, output_split_sizes, input_split_sizes, group=group, **kw)

    for module in (dist, distributed_c10d):
        module.all_to_all_single = call


def worker(
    rank: int, world_size: int, solutions: Sequence[tuple[str, str]], per_rank: int, seed: int
) -> list[dict]:
    """Run each reader's function (source, name) on this rank's :func:`exercise_inputs`;
    return, per function, the rows it returned, its all_to_all_single calls (of rows or
    not, and the bytes put in), the bytes :func:`watch_communication` counted in them,
    or the :class:`ExerciseError` it raised."""
    inputs = [exercise_inputs(r, world_size, per_rank, seed) for r in range(world_size)]
    tokens, chosen = inputs[rank]
    send = [int((chosen // per_rank == q).sum()) for q in range(world_size)]
    receive = [int((held // per_rank == rank).sum()) for _, held in inputs]
    sent: dict[str, int] = {}
    watch_communication(sent, why=_WHY, allow=("all_to_all_single",))
    calls: list[tuple[bool, int]] = []
    _guard(calls, send, receive)
    found = []
    for source, name in solutions:
        sent.clear()
        calls.clear()
        dispatch = load_reader_function(source, name, {"torch": torch, "dist": dist})
        try:
            got = dispatch(tokens.clone(), chosen.clone(), per_rank)
        except ExerciseError as error:
            found.append({"error": str(error)})
            continue
        got = got.detach().cpu() if isinstance(got, torch.Tensor) else type(got).__name__
        found.append({"rows": got, "calls": list(calls), "bytes": sent.get("all_to_all_single", 0)})
    return found


def _order_problem(rank: int, got: torch.Tensor, want: list, inputs: list, per_rank: int) -> str:
    """What is wrong with ``rank``'s rows ``got``, given the ``(source, row)`` it must hold."""
    where = {
        tuple(row.tolist()): (s, i) for s, (x, _) in enumerate(inputs) for i, row in enumerate(x)
    }
    ids = [where.get(tuple(row.tolist()), (-1, -1)) for row in got]
    if sorted(ids, key=str) == sorted(want, key=str):
        by_source = sorted(want, key=lambda si: (si[0], int(inputs[si[0]][1][si[1]]), si[1]))
        why = (
            "grouped by source rank, as all_to_all_single leaves them: regroup them by local"
            " expert (the counts say where each source's block for each expert starts)"
            if ids == by_source
            else "order them by local expert, then source rank, then the source's order"
        )
        return f"rank {rank} received the right rows in another order: {why}"
    stray = next((si for si in ids if si not in want), None)
    if stray == (-1, -1):
        return f"rank {rank} returned a row that no rank sent: return the rows received"
    if stray is None:
        return (
            f"rank {rank} returned {len(got)} rows, not the {len(want)} sent to its experts:"
            " every row arrives once"
        )
    expert = int(inputs[stray[0]][1][stray[1]])
    return (
        f"rank {rank} received row {stray[1]} of rank {stray[0]}, for expert {expert} on rank"
        f" {expert // per_rank}: sort each rank's rows by expert before the all-to-all, so that"
        " each destination's rows are one block, input_split_sizes[q] long"
    )


def _more(ranks: int) -> str:
    """`` (and 2 more ranks)``: how many other ranks have a problem too."""
    return f" (and {ranks} more rank{'s' * (ranks > 1)})" if ranks else ""


def _report(found: list[dict], inputs: list, per_rank: int, title: str) -> ExerciseReport:
    """One function's report from every rank's result."""
    report = ExerciseReport(title)
    errors = [f["error"] for f in found if "error" in f]
    if errors:
        report.fail(errors[0] + _more(len(errors) - 1))
        return report
    experts = [held.tolist() for _, held in inputs]
    problems = []
    for rank, f in enumerate(found):
        want = expected_rows(experts, rank, per_rank)
        got = f["rows"]
        if not isinstance(got, torch.Tensor) or got.dim() != 2 or got.shape[1] != HIDDEN:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else got
            problems.append(f"rank {rank} returned {shape}, not a tensor of (rows, {HIDDEN})")
            continue
        reference = [inputs[s][0][i] for s, i in want]
        if not torch.equal(got, torch.stack(reference) if reference else got[:0]):
            problems.append(_order_problem(rank, got, want, inputs, per_rank))
    for problem in problems[:1]:
        report.fail(problem + _more(len(problems) - 1))
    if not problems:
        report.ok(
            "every rank returned the rows for its experts: by local expert, then source rank,"
            " then the source's order (a plain gather of every rank's rows agrees)"
        )
    kinds = [[rows for rows, _ in f["calls"]] for f in found]
    if all(k == [False, True] for k in kinds):
        report.ok("each rank called all_to_all_single twice: the counts, then the rows")
    else:
        report.fail(
            f"all_to_all_single calls per rank (True: rows) {kinds}: one call of the counts,"
            " then one of all the rows"
        )
    row_bytes = HIDDEN * torch.finfo(torch.float64).bits // 8
    minimum = [len(x) * row_bytes for x, _ in inputs]
    put = [sum(b for rows, b in f["calls"] if rows) for f in found]
    counts = [f["bytes"] - p for f, p in zip(found, put, strict=True)]
    leave = [row_bytes * int((h // per_rank != q).sum()) for q, (_, h) in enumerate(inputs)]
    if put == minimum:
        report.ok(
            f"each rank put each of its rows into the all-to-all once: {minimum} bytes"
            f" ({row_bytes} a row), of which {leave} left the rank (rows for other ranks'"
            f" experts); the counts took {counts} bytes"
        )
    else:
        report.fail(
            f"the ranks put {put} bytes of rows into all_to_all_single; the minimum is each"
            f" row once, {minimum} bytes: send each row only to its expert's rank"
        )
    return report


def check_dispatches(
    functions: Sequence[Dispatch],
    ranks: int = 4,
    experts_per_rank: int = 2,
    seed: int = 0,
    timeout: float = 60.0,
) -> list[ExerciseReport]:
    """Check several dispatch functions in one run of ``ranks`` gloo processes (one
    report each); a run that fails or hangs fails every report with the reason."""
    n = _checks.count("ranks", ranks, minimum=2)
    per_rank = _checks.count("experts_per_rank", experts_per_rank, minimum=1)
    solutions = [reader_source(f) for f in functions]
    if not solutions:
        raise ValueError("functions must hold at least one function")
    inputs = [exercise_inputs(r, n, per_rank, seed) for r in range(n)]
    loads = torch.bincount(torch.cat([h for _, h in inputs]), minlength=n * per_rank).tolist()
    title = f"your dispatch on {n} gloo ranks, {n * per_rank} experts, rows per expert {loads}:"
    try:
        results = run_ranks(worker, n, solutions, per_rank, seed, timeout=timeout)
    except RankError as error:
        failed = ExerciseReport(title)
        failed.fail(rank_failure(error, timeout, _HANG_HINT))
        return [failed for _ in solutions]
    return [
        _report([r[k] for r in results], inputs, per_rank, title) for k in range(len(solutions))
    ]


def check_dispatch(function: Dispatch, ranks: int = 4, timeout: float = 60.0) -> ExerciseReport:
    """Check the reader's ``dispatch`` on ``ranks`` gloo processes; the report says why."""
    return check_dispatches([function], ranks, timeout=timeout)[0]


def reference_dispatch(tokens, expert_of_token, experts_per_rank):
    """The reference solution: sort by expert, exchange counts, then rows, then regroup."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size()
    order = torch.argsort(expert_of_token, stable=True)  # by expert, so by rank
    per_expert = torch.bincount(expert_of_token, minlength=n * experts_per_rank)
    counts = torch.empty_like(per_expert)  # [source, local expert], flattened
    dist.all_to_all_single(counts, per_expert)
    send = per_expert.view(n, -1).sum(dim=1).tolist()
    receive = counts.view(n, -1).sum(dim=1).tolist()
    rows = tokens.new_empty(sum(receive), tokens.shape[1])
    dist.all_to_all_single(rows, tokens[order], receive, send)
    blocks = rows.split(counts.tolist())  # block [s * E_local + e]: rank s, expert e
    return torch.cat(
        [blocks[s * experts_per_rank + e] for e in range(experts_per_rank) for s in range(n)]
    )


def main(rank: int, world_size: int) -> None:
    """``torchrun`` entry: the reference solution on every rank; each compares its rows."""
    (found,) = worker(rank, world_size, [reader_source(reference_dispatch)], 2, 0)
    inputs = [exercise_inputs(r, world_size) for r in range(world_size)]
    want = [inputs[s][0][i] for s, i in expected_rows([h.tolist() for _, h in inputs], rank, 2)]
    equal = torch.equal(found["rows"], torch.stack(want))
    print(f"rank {rank}: {len(want)} rows, equal to a plain gather of every rank's: {equal}")


if __name__ == "__main__":
    torchrun_main(main)
