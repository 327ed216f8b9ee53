"""Collective operations simulated in one process (chapter 6).

``tensors[r]`` is what rank ``r`` holds. The ring algorithm is written out step
by step, exactly as the ranks would run it, so the book can count what each
rank sends and draw every intermediate state. Chapter 6 runs the same
algorithm with real ``send``/``recv`` between processes.

Each tensor is cut into one chunk per rank with ``torch.tensor_split``, which
handles lengths not divisible by the number of ranks (the first chunks get one
element more) and lengths shorter than it (the last chunks are empty).
Inputs are never modified.

The module is also the one home of the chapter's cost formulas: the bytes a ring
sends (:func:`ring_factor`), the time it takes in the latency-bandwidth model
(:func:`ring_all_reduce_seconds`, fitted to measurements by :func:`fit_alpha_beta`),
and when communication hides under compute: data parallelism's gradients under
backward (:func:`dp_hiding_threshold_tokens`) and tensor parallelism's all-reduces
against its matrix products (:func:`tp_comm_to_compute`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainscale import _checks
from trainscale.compute import FLOPS_PER_PARAM_PER_TOKEN, training_flops, training_seconds

if TYPE_CHECKING:  # torch runs only where tensors do: the byte and time formulas need none
    import torch


def _check_ranks(tensors: Sequence[torch.Tensor], name: str = "tensors") -> int:
    """Number of ranks; every rank must hold a 1-D tensor of the same length and dtype."""
    import torch

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
    import torch

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

    The same schedule as :func:`ring_all_reduce` (which chapter 6 runs on real
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
    import torch

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
    import torch

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


# ---------------------------------------------------------------------------
# Time: the latency-bandwidth (alpha-beta) model of the ring all-reduce.
# ---------------------------------------------------------------------------


def ring_all_reduce_seconds(
    size_bytes: float, ranks: int, latency: float, bandwidth: float
) -> float:
    """Seconds a ring all-reduce of ``size_bytes`` takes in the alpha-beta model.

    ``T(S) = 2(N-1) alpha + 2(N-1)/N * S / B``: each of the ``2(N-1)`` steps pays a
    fixed ``latency`` ``alpha`` (seconds) to start, and each rank sends
    :func:`ring_factor` of the tensor at ``bandwidth`` ``B`` (bytes per second)
    (Thakur, Rabenseifner and Gropp 2005). One rank alone takes no time.
    """
    size = _checks.non_negative("size_bytes", size_bytes)
    n = _checks.count("ranks", ranks, minimum=1)
    alpha = _checks.non_negative("latency", latency)
    beta = _checks.positive("bandwidth", bandwidth)
    return 2 * (n - 1) * alpha + ring_factor(n) * size / beta


def latency_bandwidth_crossover(ranks: int, latency: float, bandwidth: float) -> float:
    """Message size in bytes at which the ring's two terms are equal: ``S* = N alpha B``.

    Setting ``2(N-1) alpha = 2(N-1)/N * S / B`` and dividing by ``2(N-1)`` gives
    ``alpha = S / (N B)``. Below ``S*`` latency dominates, above it bandwidth; at
    ``S*`` the all-reduce takes twice its latency term, so busbw is half of ``B``.
    ``ranks`` must be at least 2 (one rank has neither term).
    """
    n = _checks.count("ranks", ranks, minimum=2)
    alpha = _checks.non_negative("latency", latency)
    beta = _checks.positive("bandwidth", bandwidth)
    return n * alpha * beta


@dataclass(frozen=True)
class AlphaBeta:
    """A fitted alpha-beta model of a ring all-reduce over ``ranks`` ranks.

    ``latency`` is ``alpha`` in seconds per ring step, ``bandwidth`` ``B`` in bytes
    per second each rank sends (busbw at large sizes).
    """

    latency: float
    bandwidth: float
    ranks: int

    def seconds(self, size_bytes: float) -> float:
        """Predicted seconds of one all-reduce of ``size_bytes`` bytes (the model's ``T(S)``)."""
        return ring_all_reduce_seconds(size_bytes, self.ranks, self.latency, self.bandwidth)

    @property
    def crossover_bytes(self) -> float:
        """:func:`latency_bandwidth_crossover` of the fit, in bytes."""
        return latency_bandwidth_crossover(self.ranks, self.latency, self.bandwidth)


def _weighted_line(
    x: Sequence[float], y: Sequence[float], w: Sequence[float]
) -> tuple[float, float]:
    """Weighted least-squares line ``y = a + c x``: ``(a, c)`` from the normal equations."""
    sw = sum(w)
    sx = sum(wi * xi for wi, xi in zip(w, x, strict=True))
    sy = sum(wi * yi for wi, yi in zip(w, y, strict=True))
    sxx = sum(wi * xi * xi for wi, xi in zip(w, x, strict=True))
    sxy = sum(wi * xi * yi for wi, xi, yi in zip(w, x, y, strict=True))
    det = sw * sxx - sx * sx
    return (sy * sxx - sx * sxy) / det, (sw * sxy - sx * sy) / det


def fit_alpha_beta(sizes: Sequence[float], seconds: Sequence[float], ranks: int) -> AlphaBeta:
    """Fit :func:`ring_all_reduce_seconds` to measured all-reduce times by least squares.

    ``sizes`` are message sizes in bytes (at least two distinct ones), ``seconds``
    the measured time of one all-reduce of each. The model is a straight line in
    ``S``, ``T = a + c S`` with ``a = 2(N-1) alpha`` and ``c = 2(N-1)/(N B)``.
    Times span orders of magnitude, so the fit minimises the *relative* error,
    ``sum(((T_i - T(S_i)) / T_i)^2)`` (weights ``1 / T_i^2``); a plain fit would
    ignore every small message. Neither term may be negative: if the best line
    has ``a < 0``, the best one through the origin (``alpha = 0``) is returned.
    Raises ``ValueError`` when the times do not grow with the size (no bandwidth).
    """
    n = _checks.count("ranks", ranks, minimum=2)
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(
            f"sizes and seconds must hold one value per measurement (at least 2), "
            f"got {len(sizes)} and {len(seconds)}"
        )
    x = [_checks.non_negative("sizes", s) for s in sizes]
    y = [_checks.positive("seconds", t) for t in seconds]
    if len(set(x)) < 2:
        raise ValueError(f"sizes must hold at least 2 distinct values, got {sorted(set(x))}")
    w = [1 / (t * t) for t in y]
    intercept, slope = _weighted_line(x, y, w)
    if intercept < 0:  # the constrained optimum lies on alpha = 0: a line through the origin
        intercept = 0.0
        slope = sum(wi * xi * yi for wi, xi, yi in zip(w, x, y, strict=True)) / sum(
            wi * xi * xi for wi, xi in zip(w, x, strict=True)
        )
    if slope <= 0:
        raise ValueError("seconds must grow with sizes: the fit found no bandwidth term")
    return AlphaBeta(latency=intercept / (2 * (n - 1)), bandwidth=ring_factor(n) / slope, ranks=n)


# ---------------------------------------------------------------------------
# When communication hides under compute.
# ---------------------------------------------------------------------------

BACKWARD_FLOPS_PER_PARAM_PER_TOKEN = FLOPS_PER_PARAM_PER_TOKEN["backward"]
"""Backward's FLOPs per parameter per token (4), under which gradients can travel."""


def dp_hiding_threshold_tokens(
    ranks: int,
    bytes_per_element: float,
    peak_flops: float,
    mfu: float,
    link_bandwidth: float,
) -> float:
    """Tokens per GPU per step from which the gradient all-reduce fits under backward.

    Per parameter, the ring sends ``2(N-1)/N * b`` bytes (``b`` =
    ``bytes_per_element`` of a gradient) at ``link_bandwidth`` ``B`` bytes/s, and
    backward does ``4`` FLOPs per token at ``peak_flops * mfu`` FLOP/s. The
    all-reduce is no longer than backward when, for ``T`` tokens per GPU,

        ``2(N-1)/N * b / B <= 4 T / (peak * mfu)``, i.e.
        ``T >= (N-1)/N * b * peak * mfu / (2 B)``.

    The parameter count cancels. The same threshold holds for FSDP (ZeRO-3) when
    weights and gradients travel in the same dtype: forward all-gathers
    ``(N-1)/N * b`` per parameter under 2 FLOPs per token, backward all-gathers and
    reduce-scatters twice that under 4. It assumes perfect overlap: in practice
    the last bucket always waits, so leave a margin. One rank needs no tokens.
    """
    n = _checks.count("ranks", ranks, minimum=1)
    size = _checks.positive("bytes_per_element", bytes_per_element)
    rate = _checks.positive("peak_flops", peak_flops) * _checks.positive("mfu", mfu, maximum=1.0)
    link = _checks.positive("link_bandwidth", link_bandwidth)
    return ring_factor(n) * size * rate / (BACKWARD_FLOPS_PER_PARAM_PER_TOKEN * link)


@dataclass(frozen=True)
class DataParallelStep:
    """Backward and gradient all-reduce of one data-parallel step, in seconds per GPU."""

    backward_seconds: float
    all_reduce_seconds: float

    @property
    def exposed_seconds(self) -> float:
        """All-reduce time left over after backward: what overlap cannot hide."""
        return max(0.0, self.all_reduce_seconds - self.backward_seconds)


def data_parallel_step(
    params: float,
    tokens_per_gpu: float,
    ranks: int,
    bytes_per_element: float,
    peak_flops: float,
    mfu: float,
    link_bandwidth: float,
) -> DataParallelStep:
    """Backward and all-reduce seconds of a step, as :func:`dp_hiding_threshold_tokens` compares.

    Backward: ``4 * params * tokens_per_gpu / (peak_flops * mfu)``. All-reduce:
    :func:`ring_bytes_per_rank` of ``params * bytes_per_element`` at
    ``link_bandwidth`` bytes/s.
    """
    n_params = _checks.count("params", params, minimum=1)
    tokens = _checks.positive("tokens_per_gpu", tokens_per_gpu)
    n = _checks.count("ranks", ranks, minimum=1)
    size = _checks.positive("bytes_per_element", bytes_per_element)
    rate = _checks.positive("peak_flops", peak_flops) * _checks.positive("mfu", mfu, maximum=1.0)
    link = _checks.positive("link_bandwidth", link_bandwidth)
    backward = BACKWARD_FLOPS_PER_PARAM_PER_TOKEN * n_params * tokens / rate
    return DataParallelStep(backward, ring_factor(n) * n_params * size / link)


@dataclass(frozen=True)
class DataParallelSetup:
    """The inputs of one data-parallel step, as a record the chapters share.

    ``params`` parameters on ``gpus`` data-parallel GPUs, each processing
    ``sequences_per_gpu`` sequences of ``seq_len`` tokens per step at ``mfu`` (0 to 1)
    of a ``peak_flops`` FLOP/s peak; gradients travel as ``bytes_per_gradient`` bytes
    each (2 for bf16) over a ring at ``link_bandwidth`` bytes/s per GPU (the bus
    bandwidth, busbw, of chapter 6).
    """

    params: float
    gpus: int
    sequences_per_gpu: int
    seq_len: int
    peak_flops: float
    mfu: float
    bytes_per_gradient: float
    link_bandwidth: float

    def __post_init__(self) -> None:
        _checks.count("params", self.params, minimum=1)
        for name in ("gpus", "sequences_per_gpu", "seq_len"):
            _checks.count(name, getattr(self, name), minimum=1)
        _checks.positive("peak_flops", self.peak_flops)
        _checks.positive("mfu", self.mfu, maximum=1.0)
        _checks.positive("bytes_per_gradient", self.bytes_per_gradient)
        _checks.positive("link_bandwidth", self.link_bandwidth)

    @property
    def tokens_per_gpu(self) -> int:
        """Tokens each GPU processes per step: ``sequences_per_gpu * seq_len``."""
        return self.sequences_per_gpu * self.seq_len

    @property
    def compute_seconds(self) -> float:
        """Forward and backward seconds per GPU: ``6 * params * tokens_per_gpu / (peak * mfu)``."""
        return training_seconds(self.params, self.tokens_per_gpu, 1, self.peak_flops, self.mfu)

    def step(self, gpus: int | None = None) -> DataParallelStep:
        """:func:`data_parallel_step` of this setup on ``gpus`` GPUs (default ``self.gpus``)."""
        ranks = self.gpus if gpus is None else gpus
        return data_parallel_step(
            self.params,
            self.tokens_per_gpu,
            ranks,
            self.bytes_per_gradient,
            self.peak_flops,
            self.mfu,
            self.link_bandwidth,
        )


SEVEN_B_STEP = DataParallelSetup(
    params=7e9,
    gpus=8,
    sequences_per_gpu=4,
    seq_len=4096,
    peak_flops=1000e12,
    mfu=0.40,
    bytes_per_gradient=2,
    link_bandwidth=100e9,
)
"""The book's 7B data-parallel step, introduced in chapter 1 and used by chapters 6,
8, 12 and 14: 7e9 parameters on 8 GPUs, 4 sequences of 4,096 tokens per GPU, a
1,000 TFLOP/s peak (a round number near an H100's dense bf16) at an assumed 40 % MFU,
bf16 gradients over an assumed 100 GB/s: 1.72 s of forward and backward per GPU, of
which backward 1.15 s, and a 0.245 s gradient all-reduce."""


TP_ALL_REDUCES_PER_LAYER = 4
"""Megatron-style tensor parallelism: one all-reduce after attention and one after
the MLP in forward, and one for each of their input gradients in backward, each of
the ``tokens x hidden`` activations (Shoeybi et al. 2019)."""

TP_LAYER_WEIGHTS_PER_HIDDEN_SQUARED = 12
"""Weights of one transformer layer in units of ``hidden**2``: ``4 h^2`` in
attention, ``8 h^2`` in an MLP of width ``4h``."""


def tp_comm_to_compute(
    shards: int,
    hidden: int,
    peak_flops: float,
    mfu: float,
    link_bandwidth: float,
    bytes_per_value: float = 2,
) -> float:
    """Tensor-parallel communication time over compute time, per layer, forward and backward.

    Per token and layer, each of ``t`` = ``shards`` GPUs sends
    ``4 * 2(t-1)/t * h * b`` bytes (four ring all-reduces of ``h`` values of ``b``
    bytes) and computes ``6 * 12 h^2 / t = 72 h^2 / t`` FLOPs (its share of
    forward and backward through ``12 h^2`` weights). The ratio is

        ``(8 (t-1)/t * h b / B) / (72 h^2 / (t * peak * mfu))
        = (t-1)/h * (b/9) * peak * mfu / B``,

    independent of the batch and the sequence length: it falls only with a wider
    layer (``hidden``) or a faster link (``link_bandwidth``, bytes/s), and grows
    with the GPU's speed. Attention's score products (``s/6h`` more compute) are
    left out, so the true ratio is a little lower. Sequence parallelism replaces
    each all-reduce by a reduce-scatter and an all-gather, the same bytes, as long as
    backward keeps the gathered inputs (PyTorch's DTensor plan); Megatron-LM, which
    gathers them again in backward to reach ``34 sbh / t``, sends a quarter more
    (:func:`layer_collective_bytes`).
    """
    t = _checks.count("shards", shards, minimum=1)
    h = _checks.count("hidden", hidden, minimum=1)
    rate = _checks.positive("peak_flops", peak_flops) * _checks.positive("mfu", mfu, maximum=1.0)
    link = _checks.positive("link_bandwidth", link_bandwidth)
    size = _checks.positive("bytes_per_value", bytes_per_value)
    comm_seconds = TP_ALL_REDUCES_PER_LAYER * ring_factor(t) * h * size / link
    layer_flops = training_flops(TP_LAYER_WEIGHTS_PER_HIDDEN_SQUARED * h * h, 1)
    return comm_seconds / (layer_flops / t / rate)


@dataclass(frozen=True)
class TensorParallelSetup:
    """The inputs of one tensor-parallel layer, as a record the chapters share.

    A layer of width ``hidden`` split over ``shards`` GPUs, on a micro-batch of
    ``tokens`` tokens whose activations travel as ``bytes_per_value`` bytes each (2 for
    bf16); each GPU peaks at ``peak_flops`` FLOP/s and runs at ``mfu`` (0 to 1), and
    sends at ``nvlink_bandwidth`` bytes/s each way inside a server and at
    ``network_bandwidth`` bytes/s between servers.
    """

    hidden: int
    shards: int
    tokens: int
    bytes_per_value: int
    peak_flops: float
    mfu: float
    nvlink_bandwidth: float
    network_bandwidth: float

    def __post_init__(self) -> None:
        for name in ("hidden", "shards", "tokens", "bytes_per_value"):
            _checks.count(name, getattr(self, name), minimum=1)
        _checks.positive("peak_flops", self.peak_flops)
        _checks.positive("mfu", self.mfu, maximum=1.0)
        _checks.positive("nvlink_bandwidth", self.nvlink_bandwidth)
        _checks.positive("network_bandwidth", self.network_bandwidth)

    def comm_to_compute(self, link_bandwidth: float | None = None) -> float:
        """:func:`tp_comm_to_compute` of this layer over ``link_bandwidth`` bytes/s
        (default ``nvlink_bandwidth``)."""
        link = self.nvlink_bandwidth if link_bandwidth is None else link_bandwidth
        return tp_comm_to_compute(
            self.shards, self.hidden, self.peak_flops, self.mfu, link, self.bytes_per_value
        )


SEVEN_B_TP_LAYER = TensorParallelSetup(
    hidden=4096,
    shards=8,
    tokens=4096,
    bytes_per_value=2,
    peak_flops=SEVEN_B_STEP.peak_flops,
    mfu=SEVEN_B_STEP.mfu,
    nvlink_bandwidth=450e9,
    network_bandwidth=50e9,
)
"""Chapter 8's 7B-class layer, used again by chapter 10: width 4,096, 8-way tensor
parallelism, one sequence of 4,096 tokens, bf16 activations, chapter 1's GPU (1,000
TFLOP/s at 40 %), and assumed links of 450 GB/s (NVLink-class, inside a server) and
50 GB/s (one 400 Gb/s network card per GPU, between servers): communication 0.34 x
compute over NVLink, 3.04 x over the network."""


# --- one tensor-parallel layer's collectives, with and without sequence parallelism (ch 8) -

SEQUENCE_PARALLEL_STYLES = ("none", "keep gathered", "re-gather")
"""How a layer runs sequence parallelism (:func:`layer_collectives`): not at all
(Megatron's tensor parallelism alone), keeping each all-gathered input whole for
backward (PyTorch's DTensor plan: ``SequenceParallel`` + ``PrepareModuleInput``, as
in torchtitan), or keeping only the ``s/t`` shard and all-gathering it again in
backward (Megatron-LM, Korthikanti et al. section 4.2.2)."""


def layer_collectives(style: str = "none") -> dict[str, dict[str, int]]:
    """The collectives one tensor-parallel transformer layer runs per micro-batch, by pass.

    Each is of one ``tokens x hidden`` activation (or its gradient). Tensor parallelism
    alone: an all-reduce at the end of attention and of the MLP in forward, and one
    for each block's input gradient in backward. With sequence parallelism each
    all-reduce becomes its two halves: forward all-gathers the tokens where a block
    starts and reduce-scatters them where it ends; backward all-gathers the output
    gradient and reduce-scatters the input gradient. ``"re-gather"`` (Megatron-LM)
    adds one all-gather per block in backward: the column-parallel product's input,
    kept as the ``s/t`` shard, gathered again for its weight gradient. ``style`` is one
    of :data:`SEQUENCE_PARALLEL_STYLES`.
    """
    kind = _checks.choice("style", style, SEQUENCE_PARALLEL_STYLES)
    if kind == "none":
        return {"forward": {"all-reduce": 2}, "backward": {"all-reduce": 2}}
    again = 2 if kind == "re-gather" else 0
    return {
        "forward": {"all-gather": 2, "reduce-scatter": 2},
        "backward": {"all-gather": 2 + again, "reduce-scatter": 2},
    }


def layer_collective_bytes(
    tokens: int, hidden: int, shards: int, bytes_per_value: int = 2, style: str = "none"
) -> float:
    """Bytes one device sends per layer and micro-batch in :func:`layer_collectives`.

    Each collective is of a ``tokens x hidden`` tensor of ``bytes_per_value`` bytes,
    sent around a ring of ``shards`` devices: ``2(N-1)/N`` of it for an all-reduce,
    ``(N-1)/N`` for each half (:func:`ring_factor`). Tensor
    parallelism alone and the ``"keep gathered"`` plan send the same bytes, eight
    half-collectives; ``"re-gather"`` sends ten, a quarter more.
    """
    t = _checks.count("tokens", tokens, minimum=1)
    d = _checks.count("hidden", hidden, minimum=1)
    n = _checks.count("shards", shards, minimum=1)
    size = _checks.count("bytes_per_value", bytes_per_value, minimum=1)
    return sum(
        count * ring_factor(n, kind) * t * d * size
        for counts in layer_collectives(style).values()
        for kind, count in counts.items()
    )
