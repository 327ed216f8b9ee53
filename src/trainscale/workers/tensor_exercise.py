"""Chapter 8's exercise: a reader's tensor-parallel MLP forward, checked on real ranks.

The reader writes ``parallel_mlp(x, w_i, u_i)`` in chapter 8's notation: each of the
``t`` ranks holds the whole input ``x`` (tokens x h, float64), its column block ``W_i``
of ``W_up`` and the matching row block ``U_i`` of ``W_down``, and returns
``Z = GELU(X W_up) W_down`` on every rank with exactly **one** ``dist.all_reduce``, of the
partial output ``GELU(X W_i) U_i``, as Megatron's MLP does (``ColumnParallelLinear`` with
``gather_output=False``, the activation, ``RowParallelLinear``, whose forward all-reduces).

:func:`check_parallel_mlp` runs it on 4 gloo ranks (:func:`exercise_inputs`: seeded) and
reports per check: every rank's output against :func:`reference_output` (the whole
weights in one process, float64), naming the usual wrong outputs (:func:`known_mistakes`);
then the ``all_reduce`` calls and the bytes each rank put in. Every other collective and
every send is refused. Under torchrun::

    torchrun --nproc-per-node=4 -m trainscale.workers.tensor_exercise
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from trainscale import _checks
from trainscale.distributed import RankError, device, run_ranks, torchrun_main
from trainscale.workers.exercise import (
    ExerciseError,
    ExerciseReport,
    load_reader_function,
    rank_failure,
    reader_source,
    watch_communication,
)

TOKENS, HIDDEN, FFN = 6, 8, 48
"""The exercise's shape: 6 tokens, width ``h`` = 8, MLP width ``h_ff`` = 6h = 48 (not the
chapter's 4h, so that on 4 ranks a hidden slice, 12 wide, is not the output's shape)."""

TOLERANCE = 1e-12
"""Largest difference from the one-process float64 MLP that counts as equal."""

_WHY = (
    "your parallel_mlp called dist.{name}: each rank computes with its own blocks W_i and"
    " U_i only, and one dist.all_reduce sums the partial outputs (gathering the weights"
    " or the hidden layer puts back on every rank what tensor parallelism splits)"
)

_HANG_HINT = (
    "a rank waits in an all_reduce that another rank never enters: every rank calls"
    " dist.all_reduce the same number of times, on a tensor of the same shape"
)

ParallelMLP = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``parallel_mlp(x, w_i, u_i)``: the whole output ``Z``, on every rank."""


def exercise_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``X`` (``TOKENS x HIDDEN``), ``W_up`` (``HIDDEN x FFN``) and ``W_down`` (``FFN x
    HIDDEN``), float64, drawn from ``seed``; the weights scaled by ``1/sqrt(fan-in)``,
    so the hidden values are of order 1, where GELU is far from linear."""
    g = torch.Generator().manual_seed(_checks.count("seed", seed))
    x = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    w_up = torch.randn(HIDDEN, FFN, generator=g, dtype=torch.float64) / HIDDEN**0.5
    w_down = torch.randn(FFN, HIDDEN, generator=g, dtype=torch.float64) / FFN**0.5
    return x, w_up, w_down


def shard(
    w_up: torch.Tensor, w_down: torch.Tensor, rank: int, ranks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s blocks of ``ranks``: columns ``rank * f .. (rank + 1) * f - 1`` of
    ``W_up`` (``W_i``) and the same rows of ``W_down`` (``U_i``), ``f = FFN / ranks``."""
    n = _checks.count("ranks", ranks, minimum=1)
    if w_up.shape[1] % n:
        raise ValueError(f"ranks must divide the MLP width {w_up.shape[1]}, got {ranks}")
    r = _checks.count("rank", rank, minimum=0)
    if r >= n:
        raise ValueError(f"rank must be in 0 .. {n - 1}, got {rank}")
    f = w_up.shape[1] // n
    return w_up[:, r * f : (r + 1) * f], w_down[r * f : (r + 1) * f, :]


def reference_output(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """``GELU(X W_up) W_down`` with the whole weights, in this process."""
    return torch.nn.functional.gelu(x @ w_up) @ w_down


def worker(rank: int, world_size: int, solutions: Sequence[tuple[str, str]], seed: int) -> list:
    """Run each reader's function (source, name) on this rank's blocks; return, per
    function, its output (on the CPU), its ``all_reduce`` calls and the bytes it put
    into them, or the error it raised (a refused collective's message)."""
    x, w_up, w_down = exercise_inputs(seed)
    w_i, u_i = shard(w_up, w_down, rank, world_size)
    dev = device()
    sent: dict[str, int] = {}
    watch_communication(sent, why=_WHY, allow=("all_reduce",))
    found = []
    for source, name in solutions:
        sent.clear()
        try:
            parallel_mlp = load_reader_function(source, name, {"torch": torch, "dist": dist})
            got = parallel_mlp(*(t.to(dev).clone() for t in (x, w_i, u_i)))
        except Exception as error:  # a refused collective says why; others, what was raised
            raised = f"your parallel_mlp raised {type(error).__name__}: {error}"
            found.append({"error": str(error) if isinstance(error, ExerciseError) else raised})
            continue
        output = got.detach().cpu() if isinstance(got, torch.Tensor) else type(got).__name__
        calls, put = sent.get("all_reduce calls", 0), sent.get("all_reduce", 0)
        found.append({"output": output, "calls": calls, "bytes": put})
    return found


def known_mistakes(
    x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, rank: int, ranks: int
) -> list[tuple[torch.Tensor, str]]:
    """``(output, why)`` of the usual wrong answers on rank ``rank``, to name a mistake."""
    gelu = torch.nn.functional.gelu
    blocks = [shard(w_up, w_down, r, ranks) for r in range(ranks)]
    hidden_sum = sum(x @ w for w, _ in blocks)
    w_i, u_i = blocks[rank]
    return [
        (
            gelu(x @ w_up @ w_down),
            "is GELU(X W_up W_down), GELU applied after the sum: apply it to your slice"
            " X W_i before U_i (each hidden unit is whole there; GELU(u + v) is not"
            " GELU(u) + GELU(v), so GELU does not commute with the sum)",
        ),
        (
            sum(gelu(hidden_sum) @ v for _, v in blocks),
            "sums the hidden slices X W_i across the ranks: they hold different hidden"
            " units, so the sum mixes them; the slice needs no communication, only the"
            " partial output does",
        ),
        (
            gelu(x @ w_i) @ u_i,
            "is the rank's own partial output GELU(X W_i) U_i alone: sum the partial outputs"
            " of all ranks with one dist.all_reduce",
        ),
        (
            reference_output(x, w_up, w_down) / ranks,
            "is the mean of the partial outputs, not their sum: all-reduce with the"
            " default op, ReduceOp.SUM",
        ),
    ]


def _output_problem(got: object, rank: int, ranks: int, seed: int) -> str | float | None:
    """What is wrong with rank ``rank``'s output: ``None`` if nothing, a sentence if it
    is a known mistake or not a ``(TOKENS, HIDDEN)`` tensor, else its largest difference
    from ``Z``."""
    x, w_up, w_down = exercise_inputs(seed)
    want = reference_output(x, w_up, w_down)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else got
        return f"returned {shape}, not a tensor of ({TOKENS}, {HIDDEN}): Z has the shape of X"
    got = got.to(torch.float64)
    worst = (got - want).abs().max().item()
    if worst < TOLERANCE:
        return None
    for output, why in known_mistakes(x, w_up, w_down, rank, ranks):
        if (got - output).abs().max() < TOLERANCE:
            return f"the output {why}"
    return worst


def _on(ranks: list[int], n: int) -> str:
    """``"on every rank"`` or ``"on ranks [0, 3]"``."""
    return "on every rank" if len(ranks) == n else f"on ranks {ranks}"


def _report(found: list[dict], seed: int, title: str) -> ExerciseReport:
    """One function's report from every rank's result."""
    report = ExerciseReport(title)
    n = len(found)
    failed = [r for r, f in enumerate(found) if "error" in f]
    if failed:
        report.fail(f"{_on(failed, n)}, {found[failed[0]]['error']}")
        return report
    named: dict[str, list[int]] = {}
    unexplained: dict[int, float] = {}
    for rank, f in enumerate(found):
        problem = _output_problem(f["output"], rank, n, seed)
        if isinstance(problem, str):
            named.setdefault(problem, []).append(rank)
        elif problem is not None:
            unexplained[rank] = problem
    for problem, ranks in named.items():
        report.fail(f"{_on(ranks, n)}, {problem}")
    if unexplained:
        scale = reference_output(*exercise_inputs(seed)).abs().max().item()
        report.fail(
            f"{_on(list(unexplained), n)}, the output differs from Z = GELU(X W_up) W_down by"
            f" up to {max(unexplained.values()):.2g} (its largest entry is {scale:.2g})"
        )
    if not named and not unexplained:
        report.ok(
            f"every rank returned Z = GELU(X W_up) W_down (within {TOLERANCE:g} of the"
            " whole weights in one process, float64)"
        )
    calls, put = [f["calls"] for f in found], [f["bytes"] for f in found]
    output_bytes = TOKENS * HIDDEN * torch.finfo(torch.float64).bits // 8
    if calls == [1] * n and put == [output_bytes] * n:
        report.ok(
            f"each rank called dist.all_reduce once, on {output_bytes} bytes: its partial"
            f" output, {TOKENS} x {HIDDEN} float64 values (its {TOKENS} x {FFN // n} slice"
            " of the hidden layer never left it)"
        )
    else:
        hint = (
            "no all-reduce leaves each rank with only its partial output GELU(X W_i) U_i"
            if not any(calls)
            else "the hidden slice X W_i needs no communication, only the partial output"
        )
        report.fail(
            f"dist.all_reduce calls per rank {calls}, {put} bytes in all; expected one each,"
            f" of the {output_bytes}-byte partial output ({TOKENS} x {HIDDEN} float64): {hint}"
        )
    return report


def check_parallel_mlps(
    functions: Sequence[ParallelMLP], ranks: int = 4, seed: int = 0, timeout: float = 60.0
) -> list[ExerciseReport]:
    """Check several ``parallel_mlp`` functions in one run of ``ranks`` gloo processes
    (one report each); a run that fails or hangs fails every report with the reason."""
    n = _checks.count("ranks", ranks, minimum=2)
    if FFN % n:
        raise ValueError(f"ranks must divide the MLP width {FFN}, got {ranks}")
    solutions = [reader_source(f) for f in functions]
    if not solutions:
        raise ValueError("functions must hold at least one function")
    title = (
        f"your parallel_mlp on {n} gloo ranks: X {TOKENS} x {HIDDEN}, W_up {HIDDEN} x {FFN}"
        f" in {n} column blocks of {FFN // n}, W_down in the matching row blocks:"
    )
    try:
        results = run_ranks(worker, n, solutions, seed, timeout=timeout)
    except RankError as error:
        failed = ExerciseReport(title)
        failed.fail(rank_failure(error, timeout, _HANG_HINT))
        return [failed for _ in solutions]
    return [_report([r[k] for r in results], seed, title) for k in range(len(solutions))]


def check_parallel_mlp(
    function: ParallelMLP, ranks: int = 4, timeout: float = 60.0
) -> ExerciseReport:
    """Check the reader's ``parallel_mlp`` on ``ranks`` gloo processes; the report says why."""
    return check_parallel_mlps([function], ranks, timeout=timeout)[0]


def reference_parallel_mlp(x, w_i, u_i):
    """The reference solution: GELU of my slice, my partial output, one all-reduce."""
    import torch
    import torch.distributed as dist

    z = torch.nn.functional.gelu(x @ w_i) @ u_i  # my partial output, (tokens, h)
    dist.all_reduce(z)  # the sum over the ranks: Z, on every rank
    return z


def main(rank: int, world_size: int) -> None:
    """``torchrun`` entry: the reference solution on every rank; each compares its output."""
    (found,) = worker(rank, world_size, [reader_source(reference_parallel_mlp)], 0)
    right = _output_problem(found["output"], rank, world_size, 0) is None
    print(f"rank {rank}: Z equal to the whole MLP's: {right}; all_reduce calls {found['calls']}")


if __name__ == "__main__":
    torchrun_main(main)
