"""Chapter 10's exercise: check a reader's zig-zag split, by itself and on real ranks.

The reader writes ``positions(seq_len, ranks, rank) -> list[int]``: the positions in
the sequence of the tokens context-parallel rank ``rank`` of ``ranks`` holds, in the
order its tensor holds them. :func:`check_zigzag` checks it as a course's test suite
would, and says what is wrong:

1. **by itself**, against :func:`trainscale.context.token_positions` with
   ``layout="zigzag"`` for several lengths and rank counts: each rank holds
   ``seq_len / ranks`` positions, every position is held once, every rank sees the
   same number of visible (query, key) pairs under the causal mask, and the order
   is chunk ``r`` then chunk ``2c - 1 - r`` (for ``c`` ranks, as chapter 10 writes it);
2. **on real ranks**: :func:`worker` runs chapter 10's ring attention
   (:func:`trainscale.workers.context.ring_attention`) on gloo ranks with the
   reader's positions, forward and backward, and the parent compares every rank's
   output and gradients with causal attention on the whole sequence in one process
   (float64), and counts each rank's visible pairs.

A function defined in a notebook cannot be sent to the ranks as it is (they are
forked from a server that finds workers by name), so :func:`check_zigzag` sends its
source text (``inspect.getsource``) and each rank ``exec``-s it: the function must
be self-contained (imports inside it). The same file runs on a GPU node::

    torchrun --nproc-per-node=4 -m trainscale.workers.context_exercise
"""

from __future__ import annotations

import inspect
import textwrap
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from trainscale import _checks
from trainscale.context import token_positions
from trainscale.distributed import device, run_ranks, torchrun_main
from trainscale.workers.context import (
    Tally,
    reference_attention,
    ring_attention,
    sequence_inputs,
)

Positions = Callable[[int, int, int], Sequence[int]]
"""``positions(seq_len, ranks, rank)``: the token positions one rank holds, in its order."""

CASES = ((1, 2), (2, 4), (2, 8), (3, 6), (4, 8), (4, 16), (4, 64), (8, 32))
"""``(ranks, seq_len)`` pairs the split is checked on by itself: one rank, odd rank
counts, one token per chunk and several."""

TOLERANCE = 1e-12
"""Largest difference from one-process float64 attention that counts as equal."""


def causal_pairs(held: Sequence[int]) -> int:
    """Visible (query, key) pairs of a rank holding ``held``: keys at or before each query.

    Counted against the whole sequence ``0 .. S-1`` (every key is somewhere): a query
    at position ``p`` sees ``p + 1`` keys.
    """
    return sum(p + 1 for p in held)


def _tokens_on(seq_len: int, ranks: int) -> str:
    """``"8 tokens on 2 ranks"``, in the singular where it is one."""
    return f"{seq_len} tokens on {ranks} rank{'s' if ranks != 1 else ''}"


def load_positions(source: str, name: str) -> Positions:
    """The function ``name`` defined by ``source`` (executed in a fresh namespace)."""
    namespace: dict = {"__name__": "trainscale_exercise"}
    exec(compile(textwrap.dedent(source), "<your positions function>", "exec"), namespace)
    found = namespace.get(name)
    if not callable(found):
        raise ValueError(f"source must define a function named {name!r}")
    return found


def _call(positions: Positions, seq_len: int, ranks: int) -> list[list[int]]:
    """Every rank's positions, as lists of ints; ``ValueError`` saying why if not."""
    held = []
    for rank in range(ranks):
        call = f"positions({seq_len}, {ranks}, {rank})"
        try:
            got = list(positions(seq_len, ranks, rank))
        except Exception as error:  # the reader's code: report whatever it raised
            raise ValueError(f"{call} raised {type(error).__name__}: {error}") from None
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in got):
            raise ValueError(f"{call} returned {got!r}: positions must be whole numbers")
        held.append([int(p) for p in got])
    return held


def _problem(held: list[list[int]], seq_len: int, ranks: int) -> str | None:
    """What is wrong with one split of ``seq_len`` tokens over ``ranks``, or ``None``."""
    local = seq_len // ranks
    for rank, got in enumerate(held):
        if len(got) != local:
            return (
                f"rank {rank} of {ranks} holds {len(got)} positions of {seq_len};"
                f" each rank holds seq_len / ranks = {local}"
            )
        outside = [p for p in got if not 0 <= p < seq_len]
        if outside:
            return f"rank {rank} of {ranks} holds {outside}, outside 0 .. {seq_len - 1}"
    count = Counter(p for got in held for p in got)
    twice = sorted(p for p, n in count.items() if n > 1)
    if twice:
        missing = sorted(set(range(seq_len)) - set(count))
        return (
            f"{_tokens_on(seq_len, ranks)}: positions {twice} are held more than once"
            f" and {missing} by no rank; every token belongs to exactly one rank"
        )
    pairs = [causal_pairs(got) for got in held]
    if len(set(pairs)) > 1:
        contiguous = [token_positions(seq_len, ranks, r) for r in range(ranks)]
        hint = (
            "that is the contiguous split, where rank r does r + 1 blocks"
            if [sorted(g) for g in held] == contiguous
            else "pair early chunk r with late chunk 2c - 1 - r, of 2c chunks"
        )
        return (
            f"{_tokens_on(seq_len, ranks)}: visible (query, key) pairs per rank"
            f" {pairs}, not equal: {hint}"
        )
    wanted = [token_positions(seq_len, ranks, r, "zigzag") for r in range(ranks)]
    for rank, (got, want) in enumerate(zip(held, wanted, strict=True)):
        if got != want:
            same = sorted(got) == sorted(want)
            why = (
                "the right tokens in another order: chunk r first, then chunk 2c - 1 - r,"
                " as the rank's tensor holds them"
                if same
                else "rank r holds chunks r and 2c - 1 - r of 2c"
            )
            return f"positions({seq_len}, {ranks}, {rank}) returned {got}, expected {want}: {why}"
    return None


def check_alone(positions: Positions, cases: Sequence[tuple[int, int]] = CASES) -> list[str]:
    """What is wrong with ``positions`` on each ``(ranks, seq_len)`` case: empty if nothing."""
    problems = []
    for ranks, seq_len in cases:
        try:
            held = _call(positions, seq_len, ranks)
        except ValueError as error:
            problems.append(str(error))
            continue
        found = _problem(held, seq_len, ranks)
        if found:
            problems.append(found)
    return problems


def worker(
    rank: int,
    world_size: int,
    source: str,
    name: str,
    heads: int = 2,
    local_seq: int = 16,
    head_dim: int = 8,
    seed: int = 0,
) -> dict:
    """Chapter 10's ring attention on this rank's tokens at the positions ``source`` gives.

    ``source`` defines the function ``name``, ``positions(seq_len, ranks, rank)``;
    every rank runs it for every rank (the ring needs each sender's positions for
    the causal mask). Returns the positions, this rank's output and gradients
    (float64, on the CPU) and the visible pairs it computed.
    """
    positions = load_positions(source, name)
    seq = world_size * _checks.count("local_seq", local_seq, minimum=1)
    inputs = sequence_inputs(1, heads, seq, head_dim, seed)
    held = positions(seq, world_size, rank)
    index = torch.tensor(list(held), dtype=torch.long)
    dev = device()
    q, k, v = (t[..., index, :].to(dev).clone().requires_grad_(True) for t in inputs[:3])
    d_out = inputs[3][..., index, :].to(dev)
    tally = Tally()
    out = ring_attention(q, k, v, layout=positions, tally=tally)
    out.backward(d_out)
    print(f"computed {tally.pairs} visible (query, key) pairs")
    return {
        "positions": [int(p) for p in held],
        "output": out.detach().cpu(),
        "dq": q.grad.cpu(),
        "dk": k.grad.cpu(),
        "dv": v.grad.cpu(),
        "pairs": tally.pairs,
    }


def compare(results: Sequence[dict], heads: int = 2, head_dim: int = 8, seed: int = 0) -> float:
    """Largest difference of the ranks' outputs and gradients from one-process attention."""
    seq = sum(len(got["positions"]) for got in results)
    *qkv, d_out = sequence_inputs(1, heads, seq, head_dim, seed)
    q, k, v = (t.clone().requires_grad_(True) for t in qkv)
    expected = reference_attention(q, k, v)
    expected.backward(d_out)
    wanted = {"output": expected.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    worst = 0.0
    for got in results:
        index = torch.tensor(got["positions"], dtype=torch.long)
        for key, full in wanted.items():
            difference = (got[key] - full[..., index, :]).abs().max().item()
            worst = max(worst, difference)
    return worst


def check_zigzag(positions: Positions, ranks: int = 4, local_seq: int = 16) -> bool:
    """Check the reader's zig-zag split by itself, then on ``ranks`` gloo ranks; print why.

    Returns whether every check passed. The real run is skipped (and says so) if
    the split does not give every rank ``local_seq`` distinct positions inside
    the sequence, which the ring needs to run at all.
    """
    n = _checks.count("ranks", ranks, minimum=2)
    local = _checks.count("local_seq", local_seq, minimum=2)
    if local % 2:
        raise ValueError(f"local_seq must be even (zig-zag halves it), got {local_seq}")
    problems = check_alone(positions)
    print(
        f"by itself, {len(CASES)} cases against context.token_positions(..., 'zigzag'):"
        f" {'all pass' if not problems else f'{len(problems)} fail'}"
    )
    for problem in problems[:3]:
        print(f"  - {problem}")
    seq = n * local
    try:
        held = _call(positions, seq, n)
    except ValueError as error:
        print(f"not run on {n} ranks: {error}")
        return False
    if not all(len(g) == local and all(0 <= p < seq for p in g) for g in held):
        print(f"not run on {n} ranks: each rank must hold {local} positions in 0 .. {seq - 1}")
        return False
    source = textwrap.dedent(inspect.getsource(positions))
    results = run_ranks(worker, n, source, positions.__name__, 2, local, timeout=180)
    worst = compare(results)
    pairs = [got["pairs"] for got in results]
    equal, balanced = worst < TOLERANCE, len(set(pairs)) == 1
    print(
        f"on {n} gloo ranks, {seq} tokens: ring attention with your positions equals"
        f" one-process attention, forward and backward (within {TOLERANCE:g}): {equal}"
    )
    if not equal:
        print("  - some token is held twice or by no rank, so some key is seen twice or never")
    print(f"  visible (query, key) pairs per rank {pairs}: balanced {balanced}")
    return not problems and equal and balanced


def reference_positions(seq_len: int, ranks: int, rank: int) -> list[int]:
    """The reference solution: chunks ``rank`` and ``2 ranks - 1 - rank`` of ``2 ranks``."""
    chunk = seq_len // (2 * ranks)
    early, late = rank, 2 * ranks - 1 - rank
    return [
        *range(early * chunk, (early + 1) * chunk),
        *range(late * chunk, (late + 1) * chunk),
    ]


def main(rank: int, world_size: int) -> None:
    """``torchrun`` entry: the reference solution on every rank; rank 0 compares."""
    source = inspect.getsource(reference_positions)
    got = worker(rank, world_size, source, "reference_positions")
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, got)
    if rank == 0:
        worst = compare(gathered)
        print(f"equal to one-process attention (within {TOLERANCE:g}): {worst < TOLERANCE}")


if __name__ == "__main__":
    torchrun_main(main)
