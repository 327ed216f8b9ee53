"""Context parallelism: the sequence split over ranks (chapter 10).

Context parallelism (CP) gives each of ``N`` ranks a slice of every sequence:
``S / N`` tokens of the queries, keys and values of each layer. Everything but
attention works token by token, so it needs no communication; attention needs
every earlier key and value, which the ranks exchange in one of two ways:

* **ring attention** (Liu et al. 2023): each rank keeps its queries and passes
  its keys and values around a ring of ``N - 1`` steps, combining the partial
  results with the online softmax; backward passes the keys and values round
  again, with their gradients, which travel one step more to reach their owner;
* **all-to-all** (DeepSpeed-Ulysses, Jacobs et al. 2023): four all-to-alls
  swap the split from the sequence to the heads and back, so each rank runs
  full-length attention on ``heads / N`` query heads. With grouped-query
  attention and fewer key-value heads than ranks, each key-value head is copied
  before the all-to-all (:func:`ulysses_kv_replicas`), so only the query heads
  limit the degree.

Causal masking makes the ring uneven: with a contiguous split rank ``r``'s
queries see the keys of ranks ``0 .. r`` only. The zig-zag layout (each rank
holds chunks ``r`` and ``2N - 1 - r`` of ``2N``) evens it out.

This module holds the chapter's formulas: which tokens each rank holds
(:func:`token_positions`), the attention work each rank does
(:func:`ring_schedule`, :func:`attention_blocks_per_rank`,
:func:`causal_pairs_per_rank`, :func:`attention_flops_per_rank`), the bytes
each rank sends (:func:`ring_bytes_per_rank`, :func:`ulysses_bytes_per_rank`), how
DeepSpeed-Ulysses deals out the heads (:func:`ulysses_heads_per_rank`,
:func:`ulysses_kv_replicas`),
when the ring's traffic hides under its compute, against tensor
parallelism's (:func:`cp_comm_to_compute`, :func:`cp_beats_tp_local_tokens`);
the bytes of Ulysses and the ring combined (:func:`hybrid_bytes_per_rank`);
the work of each rank when documents are packed into one sequence
(:func:`document_ring_pairs`); and where CP sits in the whole layout: its ranks
hold the same weights, so gradients are reduced, and ZeRO shards, over the data-
and context-parallel ranks together (:func:`gradient_reduce_ranks`,
:func:`cp_model_state_groups`).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainscale import _checks
from trainscale.collectives import tp_comm_to_compute
from trainscale.memory import StateDtypes, model_state_groups

LAYOUTS = ("contiguous", "zigzag")
"""How the sequence is dealt out: in ``N`` contiguous slices, or zig-zag in ``2N`` chunks."""

ATTENTION_FLOPS_PER_PAIR_PER_DIM = 4
"""FLOPs of forward attention per (query, key) pair and per head dimension:
``2`` for the score ``q . k`` and ``2`` for adding ``p v`` to the output."""

CAUSAL_WORK_SHARE = 0.5
"""Share of the score matrix a causal mask keeps (for long sequences)."""

ULYSSES_ALL_TO_ALLS = 4
"""All-to-alls per layer and per pass in DeepSpeed-Ulysses: queries, keys, values
in (sequence -> heads), the output back (heads -> sequence); backward the same four."""


def _layout(layout: str) -> str:
    return str(_checks.choice("layout", layout, LAYOUTS))


def _ranks_and_length(seq_len: int, ranks: int, layout: str) -> tuple[int, int]:
    """``(S, N)`` after checking that ``S`` splits evenly into the layout's chunks."""
    n = _checks.count("ranks", ranks, minimum=1)
    s = _checks.count("seq_len", seq_len, minimum=1)
    chunks = n if _layout(layout) == "contiguous" else 2 * n
    if s % chunks:
        raise ValueError(f"seq_len must be divisible by {chunks} ({layout} on {n} ranks), got {s}")
    return s, n


def token_positions(seq_len: int, ranks: int, rank: int, layout: str = "contiguous") -> list[int]:
    """The positions in the sequence of the tokens ``rank`` holds, in its local order.

    ``contiguous``: tokens ``r S/N .. (r+1) S/N - 1``. ``zigzag``: the sequence
    is cut into ``2N`` chunks of ``c = S / (2N)``; rank ``r`` holds chunk ``r``
    then chunk ``2N - 1 - r``, so the first rank holds the first and the last chunk.
    """
    s, n = _ranks_and_length(seq_len, ranks, layout)
    r = _checks.count("rank", rank)
    if r >= n:
        raise ValueError(f"rank must be a whole number in [0, {n - 1}], got {rank!r}")
    if layout == "contiguous":
        local = s // n
        return list(range(r * local, (r + 1) * local))
    chunk = s // (2 * n)
    first, second = r, 2 * n - 1 - r
    return list(range(first * chunk, (first + 1) * chunk)) + list(
        range(second * chunk, (second + 1) * chunk)
    )


def ring_schedule(ranks: int, layout: str = "contiguous") -> list[list[tuple[int, float]]]:
    """What each rank computes at each step of a causal ring: ``[rank][step] = (source, blocks)``.

    At step ``i`` rank ``r`` holds the keys and values of rank ``source = (r - i) mod N``
    (each step passes them one rank on). ``blocks`` is the work, in blocks of
    ``(S/N) x (S/N)`` scores (one rank's queries against one rank's keys):

    * step 0, its own keys: the block on the diagonal, computed whole under the
      causal mask: ``1``;
    * ``contiguous``: keys of an earlier rank are all visible (``1``), those of a
      later rank all hidden (``0``, skipped);
    * ``zigzag``: from an earlier rank, all queries see its first chunk only; from
      a later rank, only the last chunk of queries sees anything: ``1/2`` either way.
    """
    n = _checks.count("ranks", ranks, minimum=1)
    zigzag = _layout(layout) == "zigzag"
    schedule = []
    for rank in range(n):
        steps = []
        for step in range(n):
            source = (rank - step) % n
            if step == 0:
                blocks = 1.0
            elif zigzag:
                blocks = 0.5
            else:
                blocks = 1.0 if source < rank else 0.0
            steps.append((source, blocks))
        schedule.append(steps)
    return schedule


def attention_blocks_per_rank(ranks: int, layout: str = "contiguous") -> list[float]:
    """Attention work of each rank in a causal ring, in blocks of ``(S/N) x (S/N)`` scores.

    The sum over the steps of :func:`ring_schedule`. ``contiguous``: rank ``r``
    sees the keys of ranks ``0 .. r``, ``r + 1`` blocks, from ``1`` to ``N``.
    ``zigzag``: ``1 + (N - 1)/2 = (N + 1)/2`` on every rank. Both total
    ``N (N + 1) / 2`` blocks. The busiest contiguous rank does ``2N/(N + 1)``
    times the mean.

    The diagonal block counts whole here, as a kernel that computes a masked block
    densely does it (the chapter's ring does). A causal kernel that skips the
    masked tiles inside it does half of it, ``r + 1/2`` blocks on rank ``r``, so
    in FLOPs (:func:`causal_pairs_per_rank`) the busiest rank does
    ``(N - 1/2) / (N/2) = (2N - 1)/N`` times the mean, for long sequences.
    """
    return [sum(blocks for _, blocks in steps) for steps in ring_schedule(ranks, layout)]


def causal_pairs_per_rank(seq_len: int, ranks: int, layout: str = "contiguous") -> list[int]:
    """Visible (query, key) pairs of each rank under the causal mask: its exact score work.

    With ``L = S / N``, contiguous rank ``r`` has ``r L^2 + L (L + 1) / 2``
    (``r`` full blocks and a triangle). Zig-zag, with ``c = S / (2N)``: chunk
    ``r`` sees ``r c^2 + c (c + 1) / 2`` pairs and chunk ``2N - 1 - r`` sees
    ``(2N - 1 - r) c^2 + c (c + 1) / 2``; their sum ``c (S + 1) = S (S + 1) / (2N)``
    does not depend on ``r``. Both layouts total ``S (S + 1) / 2``.
    """
    s, n = _ranks_and_length(seq_len, ranks, layout)
    if layout == "contiguous":
        local = s // n
        return [r * local * local + local * (local + 1) // 2 for r in range(n)]
    return [s * (s + 1) // (2 * n)] * n


def attention_flops_per_rank(
    seq_len: int, ranks: int, hidden: int, layout: str = "contiguous"
) -> list[float]:
    """Forward FLOPs of each rank's attention scores and weighted sums, one layer.

    :func:`causal_pairs_per_rank` times ``4 h`` (``2 d`` for ``q . k`` and ``2 d``
    for ``p v``, over ``h / d`` heads); backward does about twice as much.
    """
    width = _checks.count("hidden", hidden, minimum=1)
    pairs = causal_pairs_per_rank(seq_len, ranks, layout)
    return [float(ATTENTION_FLOPS_PER_PAIR_PER_DIM * width * p) for p in pairs]


def kv_block_bytes(
    local_tokens: int, kv_hidden: int, bytes_per_value: float = 2, batch: int = 1
) -> float:
    """Bytes of one rank's keys *or* values in one layer: ``b L h_kv`` values.

    ``kv_hidden`` is the width of the keys: ``heads x head_dim`` with plain
    multi-head attention, ``kv_heads x head_dim`` with grouped-query attention.
    """
    tokens = _checks.count("local_tokens", local_tokens, minimum=1)
    width = _checks.count("kv_hidden", kv_hidden, minimum=1)
    size = _checks.positive("bytes_per_value", bytes_per_value)
    return _checks.count("batch", batch, minimum=1) * tokens * width * size


def ring_bytes_per_rank(
    local_tokens: int,
    ranks: int,
    kv_hidden: int,
    bytes_per_value: float = 2,
    batch: int = 1,
    backward: bool = False,
) -> float:
    """Bytes one rank sends for one layer's ring attention, forward or backward.

    Forward passes the keys and values ``N - 1`` steps: ``2 (N - 1) B`` for
    ``B`` = :func:`kv_block_bytes`. Backward passes them ``N - 1`` steps again,
    with their gradients, which take one step more to come home:
    ``(2 (N - 1) + 2 N) B``. The same for the contiguous and zig-zag layouts.
    """
    n = _checks.count("ranks", ranks, minimum=1)
    block = kv_block_bytes(local_tokens, kv_hidden, bytes_per_value, batch)
    if n == 1:
        return 0.0
    steps = 2 * (n - 1) + (2 * n if _checks.boolean("backward", backward) else 0)
    return steps * block


def ulysses_bytes_per_rank(
    local_tokens: int,
    ranks: int,
    hidden: int,
    kv_hidden: int | None = None,
    bytes_per_value: float = 2,
    batch: int = 1,
    *,
    kv_heads: int | None = None,
) -> float:
    """Bytes one rank sends for one layer's all-to-all attention, forward (backward the same).

    Each all-to-all keeps ``1/N`` of a rank's tensor and sends the rest:
    ``(N - 1)/N`` of ``b L h`` values for the queries and the output, of
    ``b L h_kv`` for the keys and the values (``kv_hidden``, default ``hidden``).
    With ``kv_heads`` (the key-value heads that make up ``kv_hidden``) fewer than
    ``N``, each is copied ``N / kv_heads`` times before the all-to-all
    (:func:`ulysses_kv_replicas`), so the keys and values each send ``(N - 1)/N``
    of ``b L h_kv N / kv_heads`` values; with one key-value head that is
    ``(N - 1) b L h_kv``, what an all-gather of the keys (or values) sends.
    Backward sends the gradients of the same four tensors.
    """
    n = _checks.count("ranks", ranks, minimum=1)
    width = _checks.count("hidden", hidden, minimum=1)
    kv_width = width if kv_hidden is None else _checks.count("kv_hidden", kv_hidden, minimum=1)
    if kv_heads is not None:
        kv_width *= ulysses_kv_replicas(kv_heads, n)
    per_width = kv_block_bytes(local_tokens, 1, bytes_per_value, batch)
    return (n - 1) / n * per_width * (2 * width + 2 * kv_width)


def ulysses_heads_per_rank(heads: int, ranks: int) -> int:
    """Query heads each rank attends over in DeepSpeed-Ulysses: ``heads / N``, which must be whole.

    The all-to-all hands out whole query heads, so the CP degree must divide the
    number of query heads (``ValueError`` naming ``heads`` otherwise). The
    key-value heads do not limit it: :func:`ulysses_kv_replicas`.
    """
    h = _checks.count("heads", heads, minimum=1)
    n = _checks.count("ranks", ranks, minimum=1)
    if h % n:
        raise ValueError(f"heads must be divisible by the CP degree ranks = {n}, got {h}")
    return h // n


def ulysses_kv_replicas(kv_heads: int, ranks: int) -> int:
    """Copies DeepSpeed-Ulysses makes of each key-value head before its all-to-all.

    ``1`` when ``N`` divides ``kv_heads`` (each rank gets ``kv_heads / N`` of
    them); ``N / kv_heads`` when ``kv_heads`` divides ``N``: each head is
    repeated so that every rank gets one, the one its query heads share (as
    DeepSpeed's ``UlyssesSPAttentionHF`` does: ``kv_replication_factor =
    world_size // kv_head_count``). With one key-value head every rank receives
    all of it, and the all-to-all of the keys (and values) is an all-gather.
    ``ValueError`` naming ``kv_heads`` if neither divides the other.
    """
    kv = _checks.count("kv_heads", kv_heads, minimum=1)
    n = _checks.count("ranks", ranks, minimum=1)
    if kv % n == 0:
        return 1
    if n % kv == 0:
        return n // kv
    raise ValueError(
        f"kv_heads must be divisible by the CP degree ranks = {n} or divide it, got {kv}"
    )


def cp_comm_to_compute(
    local_tokens: int,
    peak_flops: float,
    mfu: float,
    link_bandwidth: float,
    bytes_per_value: float = 2,
    kv_share: float = 1.0,
    causal: bool = True,
) -> float:
    """One ring step's key-value transfer time over the attention it overlaps, forward.

    Per head of ``d`` dimensions, a step sends ``2 L d g b`` bytes (keys and
    values of ``L = local_tokens`` tokens, ``g = kv_share`` the share of
    key-value heads, ``b = bytes_per_value``) and computes
    ``f * 4 L^2 d`` FLOPs (``f = 1/2`` under a causal, zig-zag-balanced mask).
    The ratio

        ``(2 L d g b / B) / (f 4 L^2 d / (peak * mfu)) = g b peak mfu / (2 f L B)``

    is independent of the width: it falls as the local sequence grows. Backward
    sends twice the bytes for about twice the FLOPs, the same ratio.
    """
    tokens = _checks.count("local_tokens", local_tokens, minimum=1)
    rate = _checks.positive("peak_flops", peak_flops) * _checks.positive("mfu", mfu, maximum=1.0)
    link = _checks.positive("link_bandwidth", link_bandwidth)
    size = _checks.positive("bytes_per_value", bytes_per_value)
    share = _checks.positive("kv_share", kv_share, maximum=1.0)
    work = CAUSAL_WORK_SHARE if _checks.boolean("causal", causal) else 1.0
    comm_seconds = 2 * tokens * share * size / link
    compute_seconds = work * ATTENTION_FLOPS_PER_PAIR_PER_DIM * tokens * tokens / rate
    return comm_seconds / compute_seconds


def cp_hiding_threshold_tokens(
    peak_flops: float,
    mfu: float,
    link_bandwidth: float,
    bytes_per_value: float = 2,
    kv_share: float = 1.0,
    causal: bool = True,
) -> float:
    """Local tokens per rank (``S / N``) from which the ring's traffic hides under attention.

    Where :func:`cp_comm_to_compute` is 1: ``L = g b peak mfu / (2 f B)``.
    """
    return cp_comm_to_compute(1, peak_flops, mfu, link_bandwidth, bytes_per_value, kv_share, causal)


def cp_beats_tp_local_tokens(
    hidden: int,
    shards: int,
    peak_flops: float,
    mfu: float,
    link_bandwidth: float,
    bytes_per_value: float = 2,
    kv_share: float = 1.0,
    causal: bool = True,
) -> float:
    """Local tokens per rank from which CP's comm-to-compute ratio is below TP's.

    TP's ratio (:func:`trainscale.collectives.tp_comm_to_compute`,
    ``(t-1)/h * (b/9) * peak * mfu / B``) depends on the width ``h``, not the
    sequence; CP's is ``T / L`` with ``T`` = :func:`cp_hiding_threshold_tokens`.
    They cross at ``L = T / ratio_TP``, which for ``g = 1``, causal, is
    ``9 h / (t - 1)``: long sequences favour CP, wide layers favour TP.
    """
    tp_ratio = tp_comm_to_compute(shards, hidden, peak_flops, mfu, link_bandwidth, bytes_per_value)
    if tp_ratio == 0:
        raise ValueError(f"shards must be >= 2 for TP to communicate, got {shards}")
    threshold = cp_hiding_threshold_tokens(
        peak_flops, mfu, link_bandwidth, bytes_per_value, kv_share, causal
    )
    return threshold / tp_ratio


def hybrid_bytes_per_rank(
    local_tokens: int,
    ulysses_ranks: int,
    ring_ranks: int,
    hidden: int,
    kv_hidden: int | None = None,
    bytes_per_value: float = 2,
    batch: int = 1,
    *,
    kv_heads: int | None = None,
    backward: bool = False,
) -> dict[str, float]:
    """Bytes one rank sends for one layer of Ulysses inside a ring (USP, Fang & Zhao 2024).

    ``N = U R`` ranks: all-to-alls over groups of ``U`` (``ulysses_ranks``), then a
    ring over ``R`` (``ring_ranks``). The all-to-alls send
    :func:`ulysses_bytes_per_rank` for ``L`` local tokens on ``U`` ranks. After them a
    rank holds ``U L`` tokens of ``kv_hidden r / U`` key width (``r`` =
    :func:`ulysses_kv_replicas`), and the ring sends :func:`ring_bytes_per_rank` of
    that, blocks of ``b L h_kv r`` values: the block of a plain ring over ``N`` ranks,
    passed ``R - 1`` times instead of ``N - 1``. Returns ``{"all-to-all": ..., "ring": ...}``.
    """
    u = _checks.count("ulysses_ranks", ulysses_ranks, minimum=1)
    r = _checks.count("ring_ranks", ring_ranks, minimum=1)
    tokens = _checks.count("local_tokens", local_tokens, minimum=1)
    width = _checks.count("hidden", hidden, minimum=1)
    kv_width = width if kv_hidden is None else _checks.count("kv_hidden", kv_hidden, minimum=1)
    copies = 1 if kv_heads is None else ulysses_kv_replicas(kv_heads, u)
    if (kv_width * copies) % u:
        raise ValueError(f"kv_hidden must split over ulysses_ranks = {u}, got {kv_width}")
    a2a = ulysses_bytes_per_rank(
        tokens, u, width, kv_width, bytes_per_value, batch, kv_heads=kv_heads
    )
    ring = ring_bytes_per_rank(
        u * tokens, r, kv_width * copies // u, bytes_per_value, batch, backward=backward
    )
    return {"all-to-all": a2a, "ring": ring}


DOCUMENT_LAYOUTS = (*LAYOUTS, "per-document zigzag")
"""Layouts of a packed sequence: :data:`LAYOUTS` over the whole sequence, or each
document cut into ``2N`` chunks of its own, rank ``r`` taking chunks ``r`` and ``2N-1-r``."""


def _segments(lengths: list[int], ranks: int, rank: int, layout: str) -> list[tuple[int, int, int]]:
    """``(document, first, end)``: the runs of positions ``rank`` holds, cut at documents."""
    starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    if layout == "contiguous":
        local = starts[-1] // ranks
        return _cut([(rank * local, (rank + 1) * local)], starts)
    pieces = (rank, 2 * ranks - 1 - rank)
    if layout == "zigzag":
        chunk = starts[-1] // (2 * ranks)
        return _cut([(p * chunk, (p + 1) * chunk) for p in pieces], starts)
    runs = []
    for doc, length in enumerate(lengths):
        chunk = length // (2 * ranks)
        runs += [(doc, starts[doc] + p * chunk, starts[doc] + (p + 1) * chunk) for p in pieces]
    return runs


def _cut(runs: list[tuple[int, int]], starts: list[int]) -> list[tuple[int, int, int]]:
    """Each run ``[first, end)`` cut where a document starts: ``(document, first, end)``."""
    return [
        (doc, max(first, starts[doc]), min(end, starts[doc + 1]))
        for first, end in runs
        for doc in range(len(starts) - 1)
        if max(first, starts[doc]) < min(end, starts[doc + 1])
    ]


def _causal_pairs(queries: tuple[int, int], keys: tuple[int, int]) -> int:
    """Pairs ``key <= query`` for queries in ``[qa, qb)`` and keys in ``[ka, kb)``."""
    (qa, qb), (ka, kb) = queries, keys

    def tri(n: int) -> int:
        return n * (n + 1) // 2

    lo, hi = max(qa, ka), min(qb, kb)  # queries inside the keys' run see ka .. q
    inside = tri(hi - ka) - tri(lo - ka) if hi > lo else 0
    return inside + max(0, qb - max(qa, kb)) * (kb - ka)  # later queries see all of them


def document_ring_pairs(
    doc_lengths: Sequence[int], ranks: int, layout: str = "zigzag"
) -> list[list[int]]:
    """Visible (query, key) pairs of each ring step under a document mask: ``[rank][step]``.

    Documents of ``doc_lengths`` tokens are packed into one sequence; a query sees
    the keys of its own document up to itself (block-diagonal causal). Rank ``r``'s
    step ``i`` pairs its queries with the keys of rank ``(r - i) mod N``, as in
    :func:`ring_schedule`; the sum of a row is the rank's whole work, whatever way the
    keys reach it (a ring or an all-gather). ``layout`` is one of
    :data:`DOCUMENT_LAYOUTS`; ``per-document zigzag`` needs every length divisible
    by ``2N``. A token at position ``p`` of its document sees ``p + 1`` keys, so one
    document of ``S`` tokens gives :func:`causal_pairs_per_rank`.
    """
    n = _checks.count("ranks", ranks, minimum=1)
    lengths = [_checks.count("doc_lengths", x, minimum=1) for x in doc_lengths]
    if not lengths:
        raise ValueError("doc_lengths must list at least one document, got []")
    chosen = _checks.choice("layout", layout, DOCUMENT_LAYOUTS)
    chunks = n if chosen == "contiguous" else 2 * n
    if chosen == "per-document zigzag" and any(x % chunks for x in lengths):
        raise ValueError(f"doc_lengths must each be divisible by 2N = {chunks}, got {lengths}")
    if sum(lengths) % chunks:
        raise ValueError(f"doc_lengths must add up to a multiple of {chunks}, got {lengths}")
    runs = [_segments(lengths, n, r, str(chosen)) for r in range(n)]
    return [
        [
            sum(
                _causal_pairs((qa, qb), (ka, kb))
                for doc, qa, qb in runs[r]
                for key_doc, ka, kb in runs[(r - step) % n]
                if key_doc == doc
            )
            for step in range(n)
        ]
        for r in range(n)
    ]


def gradient_reduce_ranks(dp: int, cp: int) -> int:
    """Ranks that hold the same weights and reduce their gradients together: ``DP x CP``.

    Context-parallel ranks hold the whole layer (CP splits the tokens, not the
    weights), each computing the gradient of its own tokens, so the gradients are
    summed over the CP ranks as well as the DP ranks: Megatron-Core's
    ``get_data_parallel_group(with_context_parallel=True)``, torchtitan's FSDP mesh
    of ``dp_shard x cp``.
    """
    return _checks.count("dp", dp, minimum=1) * _checks.count("cp", cp, minimum=1)


def cp_model_state_groups(
    params: float, dp: int, cp: int, zero_stage: int = 0, dtypes: StateDtypes | None = None
) -> dict[str, int]:
    """Bytes of weights, gradients and optimiser state on one GPU with DP and CP.

    :func:`trainscale.memory.model_state_groups` over :func:`gradient_reduce_ranks`
    GPUs: ZeRO (or FSDP) shards each part it shards over ``DP x CP`` ranks, not ``DP``
    alone; without sharding (stage 0) every GPU holds all of it, CP or not.
    ``params`` is what one GPU holds before sharding (after TP and PP).
    """
    return model_state_groups(params, gradient_reduce_ranks(dp, cp), zero_stage, dtypes)
