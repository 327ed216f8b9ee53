"""Traffic: what each kind of parallelism sends, and how much of it hides under compute.

One cost function per kind, in seconds on one GPU of the fullest stage: data
parallelism and the ZeRO stages (:func:`_data_parallel_seconds`; ZeRO-3 gathered layer
by layer with prefetching, :func:`_zero3_prefetch`, and its costs beyond the bytes,
:func:`_zero3_extra`), context parallelism's ring (:func:`_context_parallel_seconds`),
expert parallelism's all-to-alls (:func:`_expert_parallel_seconds`) and tensor
parallelism's collectives (:func:`_tensor_collective_seconds`); :data:`OVERLAP` is the
share that hides, and :func:`_parallel_notes` says when a CP or EP degree cannot be used.
:mod:`trainscale.planner.step` adds them up into a layout's step time.

Sequence parallelism (``sequence_parallel``, Korthikanti et al. section 4.2.2) turns
each tensor-parallel all-reduce into an all-gather and a reduce-scatter that move the
same bytes, so the traffic is priced the same; what it changes is the activation
memory (the ``10 s b h`` outside the split blocks are split too).

Context parallelism (chapter 10, :mod:`trainscale.context`): ``CP`` ranks each hold
``s / CP`` tokens of every sequence, so every activation, GEMM row and pipeline send
shrinks by ``CP``, while each rank's queries still meet all ``s`` keys; the keys and
values travel a ring (:func:`trainscale.context.ring_bytes_per_rank`, Liu et al. 2023),
:data:`OVERLAP` of it hidden under the attention it feeds
(:func:`_context_parallel_seconds`); the DP and CP ranks reduce the gradients
together, as Megatron-core does. Tried by default only where chapter 10's thresholds
say it helps (:func:`context_parallel_degrees`). Expert parallelism (chapter 11,
:mod:`trainscale.experts`): a mixture of experts (:attr:`Model.experts`) spreads its
experts over ``EP`` of the DP ranks, whose all-to-alls
(:func:`trainscale.experts.all_to_all_bytes_per_rank`, four per layer) are charged in
full (:func:`_expert_parallel_seconds`); each GPU holds ``E / EP`` experts, sharded by
ZeRO over the ``DP CP / EP`` ranks that hold the same ones; the local experts run as
one batched GEMM (:func:`_layer_times_at`), and MFU counts the active parameters
(:attr:`Model.active_params`). Both dimensions are searched for every layout by
:func:`plan` (:func:`expert_parallel_degrees`).
"""

from __future__ import annotations

import functools

from trainscale.collectives import ring_factor
from trainscale.context import ring_bytes_per_rank
from trainscale.experts import ALL_TO_ALLS_PER_LAYER, all_to_all_bytes_per_rank
from trainscale.planner.inputs import Model
from trainscale.sharding import ZERO_COLLECTIVES
from trainscale.sharding import zero_collective_bytes as _zero_collective_bytes

zero_collective_bytes = functools.lru_cache(maxsize=8192)(_zero_collective_bytes)
""":func:`trainscale.sharding.zero_collective_bytes`, remembered: the search asks for the same
stage's bytes once per ZeRO stage, micro-batch and recomputation mode (read only)."""

COLLECTIVE_STEP_SECONDS = 5e-6
"""Latency of one step of a ring collective between nodes, in seconds (an assumption:
NCCL's per-hop latency over InfiniBand is a few microseconds). A ring over ``n`` GPUs
takes ``n - 1`` steps, so it matters only where collectives are many and small."""


@functools.lru_cache(maxsize=4096)
def _tensor_collective_seconds(s: float, b: int, h: int, t: int, link: float) -> float:
    """One tensor-parallel all-reduce of a layer's ``s x b x h`` 16-bit activations over
    ``t`` GPUs: ring cost (:func:`trainscale.collectives.ring_factor`) at ``link`` B/s."""
    return ring_factor(t) * 2 * s * b * h / link


def _data_parallel_seconds(
    per_gpu: int,
    dp: int,
    zero: int,
    link: float,
    forward: float,
    backward: float,
    gradient_bytes: int = 2,
    micro_batches: int = 1,
) -> tuple[float, float]:
    """Data-parallel seconds not hidden under compute: ``(per micro-batch, once per step)``.

    The bytes of each collective come from :func:`trainscale.sharding.zero_collective_bytes`
    (the stage's ``per_gpu`` parameters over ``dp`` GPUs, 16-bit weights and
    ``gradient_bytes`` per gradient), which ones run every micro-batch from
    :data:`trainscale.sharding.ZERO_COLLECTIVES`. Collectives that hide under the
    backward pass share one micro-batch's ``backward`` (recomputation included); those
    that hide under the forward pass share one ``forward``; what they take beyond it is
    exposed. A gradient reduce-scatter that runs after every micro-batch (ZeRO-2 and 3)
    keeps running while the next micro-batch computes (1F1B, and plain accumulation,
    start the next forward as soon as a backward ends), so for all but the last of the
    ``micro_batches`` its window is ``forward + backward``; the last one's is its
    backward, the difference charged once per step.
    """
    runs = zero_collective_bytes(per_gpu, dp, zero, bytes_per_gradient=gradient_bytes)
    seconds: dict[tuple[bool, str], float] = {}
    for c in ZERO_COLLECTIVES[zero]:
        key = (c.per_micro_batch, c.hides_under)
        seconds[key] = seconds.get(key, 0.0) + runs[c.name] / link
    window = {"forward": forward, "backward": backward}
    exposed = {True: 0.0, False: 0.0}
    for (every, phase), busy in seconds.items():
        last = max(0.0, busy - window[phase])
        if every and phase == "backward" and micro_batches > 1:
            others = max(0.0, busy - forward - backward)
            exposed[True] += others
            exposed[False] += last - others
        else:
            exposed[every] += last
    return exposed[True], exposed[False]


def _zero3_extra(
    per_gpu: int, dp: int, zero: int, mode: str, layers: int, link: float
) -> tuple[float, float]:
    """ZeRO-3's costs beyond the bytes of :data:`trainscale.sharding.ZERO_COLLECTIVES`:
    ``(regather, latency)`` seconds per micro-batch.

    Regather: ZeRO-3 frees the gathered weights after the forward, so full
    recomputation gathers them once more (DeepSpeed's checkpointed layers re-run their
    forward hooks); it can hide under the recomputation. Latency: ZeRO-3 gathers and
    reduce-scatters layer by layer, ``layers x collectives`` rings of ``dp - 1`` steps
    of :data:`COLLECTIVE_STEP_SECONDS` each, which nothing hides.
    """
    if zero != 3:
        return 0.0, 0.0
    gather = zero_collective_bytes(per_gpu, dp, zero)["all-gather of weights, forward"] / link
    regather = gather if mode == "full" else 0.0
    collectives = len(ZERO_COLLECTIVES[zero]) + (mode == "full")
    return regather, layers * collectives * (dp - 1) * COLLECTIVE_STEP_SECONDS


def _zero3_prefetch(
    per_gpu: int,
    dp: int,
    mode: str,
    layers: int,
    link: float,
    forward: float,
    backward: float,
    gradient_bytes: int = 2,
) -> float:
    """ZeRO-3's exposed data-parallel seconds per micro-batch, gathered layer by layer
    with prefetching as FSDP and DeepSpeed do it.

    The next layer's all-gather is issued while this layer computes (PyTorch FSDP's
    ``forward_prefetch`` and ``backward_prefetch``, Zhao et al. 2023, arXiv 2304.11277;
    DeepSpeed ZeRO-3 prefetches too), so per layer only ``max(0, traffic - compute)`` is
    exposed, plus the first layer's gather, which nothing precedes, and the last
    reduce-scatter, which nothing follows. Forward: one gather per layer under ``forward / layers``.
    Backward: the gather again (twice with full recomputation, whose re-run forward
    gathers too, see :func:`_zero3_extra`) and the reduce-scatter of the layer's
    gradients, under ``backward / layers`` (recomputation included). Bytes from
    :func:`trainscale.sharding.zero_collective_bytes`, shared equally by the layers.
    """
    runs = zero_collective_bytes(per_gpu, dp, 3, bytes_per_gradient=gradient_bytes)
    gather = runs["all-gather of weights, forward"] / link / layers
    scatter = runs["reduce-scatter of gradients"] / link / layers
    gathers = 2 if mode == "full" else 1
    ahead = (layers - 1) * max(0.0, gather - forward / layers)
    behind = (layers - 1) * max(0.0, gathers * gather + scatter - backward / layers)
    return gather + ahead + gathers * gather + behind + scatter


@functools.lru_cache(maxsize=8192)
def _context_parallel_seconds(
    model: Model,
    t: int,
    b: int,
    c: int,
    layers: int,
    mode: str,
    link: float,
    attention: float,
    overlap: float,
) -> float:
    """Ring attention's exposed seconds per micro-batch on one GPU of the fullest stage.

    Per layer, the keys and values of ``s / c`` tokens travel the ring
    (:func:`trainscale.context.ring_bytes_per_rank`, 16-bit, the ``kv_heads`` of one
    TP rank), forward and backward, and once more forward under full recomputation.
    Each step's transfer overlaps the attention of the block it brings (Liu et al.
    2023), so :data:`OVERLAP` of the traffic hides under ``attention``, the forward
    seconds of the layer's attention products (backward: 2.5 times as long, its four
    products and the recomputed ``Q K^T`` of a fused kernel); the rest is exposed.
    """
    if c == 1:
        return 0.0
    head = model.hidden // model.heads
    width = -(-(model.kv_heads or model.heads) // t) * head
    local = model.seq_len // c
    forward = ring_bytes_per_rank(local, c, width, 2, b) / link
    backward = ring_bytes_per_rank(local, c, width, 2, b, backward=True) / link
    passes = [(forward, attention), (backward, 2.5 * attention)]
    if mode == "full":
        passes.append((forward, attention))
    exposed = sum(
        overlap * max(0.0, comm - window) + (1 - overlap) * comm for comm, window in passes
    )
    return layers * exposed


def _expert_parallel_seconds(
    model: Model, t: int, b: int, c: int, ep: int, layers: int, mode: str, link: float
) -> float:
    """The all-to-alls of the fullest stage's MoE layers, seconds per micro-batch.

    Each of the ``layers`` runs :data:`trainscale.experts.ALL_TO_ALLS_PER_LAYER`
    all-to-alls (two more when full recomputation repeats the forward), each sending
    :func:`trainscale.experts.all_to_all_bytes_per_rank` of the GPU's ``b s / (c t)``
    tokens (with TP, each rank dispatches its share of the sequence: Megatron-core
    requires sequence parallelism with TP and EP, :func:`_parallel_notes`). Not
    overlapped: the dispatch waits for the router and the experts wait for the dispatch.
    """
    if model.experts is None or ep == 1:
        return 0.0
    tokens = b * model.seq_len / (c * t)
    each = all_to_all_bytes_per_rank(tokens, model.hidden, model.top_k, ep)
    count = ALL_TO_ALLS_PER_LAYER + (2 if mode == "full" else 0)
    return layers * count * each / link


def _parallel_notes(model: Model, t: int, d: int, c: int, ep: int, sp: bool) -> list[str]:
    """Why a context- or expert-parallel degree cannot be used, if it cannot.

    Megatron-core's rules: EP must divide the experts and DP, and EP with TP needs
    sequence parallelism ("When using expert parallelism and tensor parallelism,
    sequence parallelism must be used", ``TransformerConfig``)."""
    notes = []
    if ep > 1 and t > 1 and not sp:
        notes.append(f"EP {ep} with TP {t} needs sequence parallelism")
    if c > 1 and not model.layer_shape["fused_attention"]:
        notes.append(f"CP {c} needs a fused (ring) attention kernel")
    if model.seq_len % (2 * c):
        notes.append(f"CP {c} does not split the {model.seq_len} tokens into {2 * c} chunks")
    if ep > 1 and (model.experts is None or model.experts % ep):
        notes.append(f"EP {ep} does not divide the model's experts ({model.experts})")
    if d % ep:
        notes.append(f"EP {ep} does not divide DP {d}")
    return notes
