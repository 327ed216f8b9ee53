"""Kernels: the calibrated model's compute, every kernel of a layer at its roofline.

:func:`~trainscale.hardware.gemm_seconds` is one GEMM at its roofline (wave quantisation
and each tile's fixed cost, :func:`~trainscale.hardware.tile_overhead_k`), from the
primer's module :mod:`trainscale.hardware`; :func:`_layer_times_at` a layer's forward
and backward, :func:`_roofline` a stage's; the GEMM share is read off Korthikanti et al.'s
Table 4 (:data:`TABLE4_SECONDS`, :func:`table4_seconds`, :func:`gemm_share`,
:data:`GEMM_SHARE`) at each setting of the unknowns it is tied to
(:mod:`trainscale.planner.unknowns`), and :func:`_rates` moves it to a layout's GPU.
:mod:`trainscale.planner.step` lists every term of the step time with its source.
"""

from __future__ import annotations

import functools

from trainscale import _checks
from trainscale.checkpointing import layer_activation_bytes
from trainscale.context import CAUSAL_WORK_SHARE
from trainscale.hardware import gemm_seconds
from trainscale.planner.inputs import Cluster, Model, published_cluster, published_model
from trainscale.planner.memory import (
    eager_layer_traffic_bytes,
    every_other_matmul_share,
)
from trainscale.planner.traffic import _tensor_collective_seconds
from trainscale.planner.unknowns import CENTRAL, ELEMENTWISE_TRAFFIC, Unknowns, band_value
from trainscale.published import GPUS, published_runs

TABLE4_SECONDS = {"forward": 7.7e-3, "backward": 11.9e-3}
"""The one measurement the roofline's GEMM share is read off: Korthikanti et al.
(arXiv 2205.05198), Table 4, one transformer layer of their 22B model (width 6,144,
64 heads, 2,048 tokens, micro-batch 4) on 8 A100s with TP 8, without sequence
parallelism or recomputation: 7.7 ms forward, 11.9 ms backward."""

TABLE4_GPU = "A100-80GB"
"""The GPU :data:`TABLE4_SECONDS` was measured on (a key of :data:`trainscale.published.GPUS`)."""

TABLE4_RUN = "GPT 22B on 8 A100s, full recompute"
"""The calibration row (:func:`trainscale.published.published_runs`) whose model and
GPUs :data:`TABLE4_SECONDS` timed."""


@functools.lru_cache(maxsize=8192)
def _layer_times(
    model: Model,
    cluster: Cluster,
    t: int,
    b: int,
    sp: bool,
    unknowns: Unknowns = CENTRAL,
    c: int = 1,
    ep: int = 1,
    linear_dtype: str = "bf16",
    fused_elementwise: bool = True,
) -> tuple[float, float, float]:
    """:func:`_layer_times_at` at one setting of the ``unknowns``: the GEMM share and the
    attention kernel's rate of :func:`_rates`, the element-wise traffic and tile overhead;
    the linear layers in ``linear_dtype`` (:func:`_linear_rate`), the element-wise work
    fused or eager (``fused_elementwise``)."""
    share, attention_rate = _rates(cluster, unknowns)
    return _layer_times_at(
        model,
        cluster,
        t,
        b,
        sp,
        share,
        unknowns.traffic,
        c,
        ep,
        unknowns.tile_overhead,
        attention_rate,
        _linear_rate(cluster, unknowns, linear_dtype),
        fused_elementwise,
    )


def _linear_rate(
    cluster: Cluster, unknowns: Unknowns, linear_dtype: str
) -> tuple[float, float] | None:
    """``(peak, share)`` of the linear layers' GEMMs in FP8, or ``None`` for 16-bit ones.

    The FP8 share is :func:`gemm_share` moved to the GPU's FP8 tensor cores by the ratio of
    their fastest measured GEMM (``fp8_max_matmul_share``) to the A100's bf16 one, as the
    bf16 share is moved by ``max_matmul_share``; on the power-limited end, scaled as the
    bf16 share is. ``ValueError`` when the GPU has no FP8 peak or no measured FP8 GEMM."""
    if linear_dtype == "bf16":
        return None
    if cluster.fp8_peak_flops is None or cluster.fp8_max_matmul_share is None:
        raise ValueError(
            "linear_dtype fp8 needs a GPU with fp8_peak_flops and a measured fp8_max_matmul_share"
        )
    reference = GPUS[TABLE4_GPU].max_matmul_share
    peaks = None if cluster.peak_flops_low is None else (cluster.peak_flops_low, cluster.peak_flops)
    limited = band_value(peaks, unknowns.peak, cluster.peak_flops) / cluster.peak_flops
    share = gemm_share(unknowns.tile_overhead, unknowns.traffic) / reference
    return cluster.fp8_peak_flops, share * cluster.fp8_max_matmul_share * limited


def _rates(cluster: Cluster, unknowns: Unknowns = CENTRAL) -> tuple[float, float]:
    """``(GEMM share of peak, fused attention FLOP/s)`` on the ``cluster``'s GPU.

    The share is :func:`gemm_share`, read off A100s at the unknowns' traffic and tile
    overhead, scaled by the ratio of the two GPUs' fastest measured GEMMs
    (``max_matmul_share``: 0.803 / 0.869 for an H100; as is where the GPU's was not
    measured), and by the sustained peak of a power-limited GPU at the unknowns' ``peak``
    band (``peak_flops_low``). The attention rate is the GPU's measured fused-attention
    share (``attention_share``) at the unknowns' ``attention`` band, or the GEMM share
    where none is measured."""
    reference = GPUS[TABLE4_GPU].max_matmul_share
    scale = 1.0 if cluster.max_matmul_share is None else cluster.max_matmul_share / reference
    peaks = None if cluster.peak_flops_low is None else (cluster.peak_flops_low, cluster.peak_flops)
    peak = band_value(peaks, unknowns.peak, cluster.peak_flops) / cluster.peak_flops
    share = gemm_share(unknowns.tile_overhead, unknowns.traffic) * scale * peak
    attention = band_value(cluster.attention_share, unknowns.attention, share / peak) * peak
    return share, cluster.peak_flops * attention


def _forward_and_backward(gemm, m: float, k: float, n: float, batch: float = 1):
    """Seconds of a GEMM ``(m x k) @ (k x n)`` and of its two backward GEMMs: the input's
    gradient ``(m x n) @ (n x k)`` and the weight's ``(k x m) @ (m x n)``, each at its
    own shape (the weight gradient's ``k`` is the forward's rows, ``b s``)."""
    forward = gemm(m, k, n, batch=batch)
    return forward, gemm(m, n, k, batch=batch) + gemm(k, m, n, batch=batch)


FUSED_BACKWARD_PASSES = 5 / 2
"""A fused attention kernel's backward over its forward: five products (the recomputed
``Q K^T``, ``dV``, ``dP``, ``dQ``, ``dK``) for two (Dao et al. 2022, section 3.1)."""


def _fused_attention_seconds(
    pairs: float, queries: float, keys: float, head_dim: int, rate: float
) -> tuple[float, float]:
    """Forward and backward seconds of a fused causal attention kernel (FlashAttention)
    over ``pairs`` (sequence, head) pairs: ``Q K^T`` and the product with ``V``, 2 x 2
    ``queries x keys x head_dim`` FLOPs per pair, only the blocks the causal mask leaves
    (:data:`trainscale.context.CAUSAL_WORK_SHARE`, as its kernels stop at the diagonal
    block), at ``rate`` FLOP/s; backward :data:`FUSED_BACKWARD_PASSES` times that."""
    forward = pairs * 2 * 2 * queries * keys * head_dim * CAUSAL_WORK_SHARE / rate
    return forward, FUSED_BACKWARD_PASSES * forward


@functools.lru_cache(maxsize=8192)
def _layer_times_at(
    model: Model,
    cluster: Cluster,
    t: int,
    b: int,
    sp: bool,
    share: float,
    traffic: float,
    c: int = 1,
    ep: int = 1,
    overhead: float = 1.0,
    attention_rate: float | None = None,
    linear: tuple[float, float] | None = None,
    fused_elementwise: bool = True,
) -> tuple[float, float, float]:
    """Seconds of one layer on one GPU: ``(forward, its attention-score part, backward)``.

    The layer's GEMMs, split over TP as Megatron-LM splits them, each at its roofline
    (:func:`gemm_seconds`): the QKV projection (``kv_heads`` key/value heads), the
    output projection, the MLP's input (two matrices if gated) and output matrices, and
    per head ``Q K^T`` and the product with ``V`` (at the compute roof with a fused
    attention kernel, whose scores stay on chip and which skips the key blocks the
    causal mask hides, :func:`_fused_attention_seconds`, at ``attention_rate`` FLOP/s:
    a fused kernel is not a GEMM, and runs at its own measured share of peak; ``None``:
    the GEMM share's). ``linear``: ``(peak, share)`` of the linear layers' GEMMs when they
    run in FP8 (:func:`_linear_rate`; ``None``: as the others). Their FP8 casts and scaling
    are not counted: part of why FP8 is less validated. ``fused_elementwise`` false: the
    element-wise traffic of a gated layer is what its eager ops read and write, counted op
    by op (:func:`trainscale.planner.memory.eager_layer_traffic_bytes`), not estimated from
    the fused count.
    Backward, each GEMM's two gradient GEMMs at their own shapes
    (:func:`_forward_and_backward`); a fused attention kernel's
    :data:`FUSED_BACKWARD_PASSES` times its forward. Plus the
    element-wise kernels: ``traffic`` (:data:`ELEMENTWISE_TRAFFIC`) x the bytes the
    layer keeps (:func:`trainscale.checkpointing.layer_activation_bytes`, without the
    ``5 a s^2 b`` scores when attention is fused) at the memory bandwidth, a third of it
    forward, two thirds backward. ``share`` and ``overhead`` go to :func:`gemm_seconds`.

    With context parallelism over ``c`` ranks a GPU holds ``s / c`` tokens and their
    queries meet all ``s`` keys (ring attention, chapter 10). A mixture of experts
    replaces the MLP by its router (``h x E``) and the ``E / ep`` local experts, run as
    one batched GEMM of ``b s k ep / (c E)`` rows each (even routing, chapter 11).
    """
    s, h, a = model.seq_len, model.hidden, model.heads
    d, kv = h // a, model.kv_heads or a
    ffn = model.ffn_hidden or 4 * h
    peak, bw = cluster.peak_flops, cluster.memory_bandwidth
    gemm = functools.partial(
        gemm_seconds,
        peak_flops=peak,
        bandwidth=bw,
        share=share,
        multiprocessors=cluster.multiprocessors,
        tile_overhead=overhead,
    )
    rows = b * s / c
    gates = 2 if model.gated_mlp else 1
    shapes = [(rows, h, (h + 2 * kv * d) / t, 1), (rows, h / t, h, 1)]
    if model.experts is None:
        shapes += [(rows, h, ffn * gates / t, 1), (rows, ffn / t, h, 1)]
    else:
        local, width = model.experts / ep, model.expert_width
        per_expert = rows * model.top_k / local
        shapes += [(rows, h, model.experts, 1)]  # the router
        shapes += [(per_expert, h, width * gates / t, local), (per_expert, width / t, h, local)]
    linear_gemm = gemm
    if linear is not None:
        linear_gemm = functools.partial(gemm, peak_flops=linear[0], share=linear[1])
    passes = [_forward_and_backward(linear_gemm, m, k, n, batch) for m, k, n, batch in shapes]
    dense, dense_back = sum(f for f, _ in passes), sum(g for _, g in passes)
    pairs = b * a / t  # (sequence, head) pairs on this GPU
    shape = model.layer_shape
    kept = layer_activation_bytes(s // c, b, h, a, t, sp, "none", **shape)
    if shape["fused_attention"]:  # the software's, where the model leaves it
        rate = peak * share if attention_rate is None else attention_rate
        scores, scores_back = _fused_attention_seconds(pairs, s / c, s, d, rate)
        score_bytes = 0.0
    else:  # Q K^T, then the probabilities times V
        qk = _forward_and_backward(gemm, s, d, s, pairs)
        pv = _forward_and_backward(gemm, s, s, d, pairs)
        scores, scores_back = qk[0] + pv[0], qk[1] + pv[1]
        score_bytes = kept - layer_activation_bytes(s // c, b, h, a, t, sp, "selective", **shape)
    per_byte = traffic / 3 / bw
    elementwise = kept * per_byte, 2 * kept * per_byte
    if not fused_elementwise and model.gated_mlp:  # counted op by op, not estimated
        elementwise = tuple(
            moved / bw for moved in eager_layer_traffic_bytes(model, s // c, b, t, sp)
        )
    forward = dense + scores + elementwise[0]
    backward = dense_back + scores_back + elementwise[1]
    return forward, scores + score_bytes * per_byte, backward


def table4_seconds(
    share: float, overhead: float = 1.0, traffic: float = ELEMENTWISE_TRAFFIC["point"]
) -> dict[str, float]:
    """The roofline's time of :data:`TABLE4_SECONDS`'s layer at GEMM ``share``, in
    seconds: forward (the layer, :func:`_layer_times_at`, plus its two synchronous
    tensor-parallel all-reduces) and backward (the layer's gradient GEMMs at their own
    shapes; the run's software overlapped the backward's two all-reduces with the
    weight-gradient GEMMs, as the software documents it), with the tiles' fixed cost at
    ``overhead`` and the element-wise kernels moving ``traffic`` bytes per kept byte."""
    share = _checks.positive("share", share, maximum=1.0)
    overhead = _checks.non_negative("overhead", overhead)
    traffic = _checks.positive("traffic", traffic)
    run = next(r for r in published_runs() if r.name == TABLE4_RUN)
    model, cluster = published_model(run).under(run.software), published_cluster(run)
    s, b, h, t = model.seq_len, run.micro_batch, model.hidden, run.tp
    forward, _, backward = _layer_times_at(
        model, cluster, t, b, False, share, traffic, 1, 1, overhead
    )
    reduce = _tensor_collective_seconds(s, b, h, t, cluster.intra_node_bandwidth)
    return {"forward": forward + 2 * reduce, "backward": backward}


def _bisect(excess, low: float, high: float, steps: int = 32) -> float:
    """The root of ``excess``, which falls from positive at ``low`` to negative at
    ``high``, by bisection."""
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) > 0 else (low, middle)
    return (low + high) / 2


@functools.cache
def gemm_share(overhead: float = 1.0, traffic: float = ELEMENTWISE_TRAFFIC["point"]) -> float:
    """The share of peak a compute-bound GEMM's main loop sustains on an A100, read off
    Korthikanti et al.'s Table 4 (:data:`TABLE4_SECONDS`): the one share at which the
    roofline (:func:`table4_seconds`) takes the measured 19.6 ms for the layer's forward
    and backward together, given the tiles' fixed cost at ``overhead`` x
    :func:`tile_overhead_k` and ``traffic`` bytes of element-wise traffic per kept byte.
    The three are tied: the more time the element-wise kernels and the tiles' writes take,
    the faster the GEMMs must run for the layer to take what it measured
    (:mod:`trainscale.planner.unknowns`). An effective share: it also carries whatever the
    measured layer spends that the roofline does not count. Not fitted to the published
    runs. (Read apart, the two halves of Table 4 want different shares,
    :func:`table4_half_shares`: the roofline puts a larger part of the layer in its
    backward than the measurement does, an error of the model that the central estimate
    averages.)
    """
    scale = _checks.non_negative("overhead", overhead)
    bytes_per_byte = _checks.positive("traffic", traffic)
    measured = sum(TABLE4_SECONDS.values())

    def excess(share: float) -> float:  # time falls as the share rises
        return sum(table4_seconds(share, scale, bytes_per_byte).values()) - measured

    if excess(1.0) > 0:
        raise ValueError(
            "overhead and traffic must leave Table 4's layer slower than the roofline at full"
            f" peak, got overhead {overhead} and traffic {traffic}"
        )
    return round(_bisect(excess, 0.05, 1.0), 4)


def table4_half_shares(
    overhead: float = 1.0, traffic: float = ELEMENTWISE_TRAFFIC["point"]
) -> dict[str, float]:
    """The GEMM shares at which the roofline reproduces each half of Table 4 alone:
    ``{"forward": ..., "backward": ...}`` (the gap between them is the model's error at
    the one layer it is read off, shown in the appendix, not a range)."""
    scale = _checks.non_negative("overhead", overhead)
    bytes_per_byte = _checks.positive("traffic", traffic)
    shares = {}
    for half, measured in TABLE4_SECONDS.items():
        excess = lambda share, h=half, m=measured: (  # noqa: E731
            table4_seconds(share, scale, bytes_per_byte)[h] - m
        )
        if excess(1.0) > 0:
            raise ValueError(f"Table 4's {half} is faster than the roofline at full peak")
        shares[half] = round(_bisect(excess, 0.05, 1.0), 4)
    return shares


@functools.lru_cache(maxsize=8192)  # many layouts share a stage (the ZeRO stages, DP)
def _roofline(
    model,
    cluster,
    t,
    b,
    layers,
    mode,
    sp,
    unknowns: Unknowns = CENTRAL,
    ends_short: int = 0,
    c: int = 1,
    ep: int = 1,
    selective: str = "scores",
    linear_dtype: str = "bf16",
    fused_elementwise: bool = True,
) -> tuple[float, float, float]:
    """Forward, backward and recomputation seconds of one micro-batch on the slowest stage.

    ``layers`` layers (:func:`_layer_times`) on a middle stage; the last stage has
    ``layers - 1`` of them when ``ends_short`` is 2 (the layers fall two short of the
    stages' slots, and the output layer takes one, as Llama 3 balanced its pipeline),
    plus the output layer's GEMM and its fp32 logits (``4 s b V / t`` bytes); the
    pipeline runs at the pace of the slower of the two, forward, backward and
    recomputation together. Backward: the layers' (:func:`_layer_times`: each GEMM's two
    gradient GEMMs at their own shapes) and the output layer's. Full recomputation
    repeats the forward of the stage's layers; selective, what the software's policy
    (``selective``, :data:`trainscale.software.SELECTIVE_RECOMPUTE`) recomputes: the score
    part (nothing with a fused kernel, whose backward rebuilds the scores anyway), the
    core attention (the fused kernel's forward too), or every other matrix product and
    every element-wise kernel (:func:`trainscale.planner.memory.every_other_matmul_share`
    of the forward GEMMs' time, taken as their FLOP share, and the forward's element-wise
    time).
    """
    layer, score, layer_back = _layer_times(
        model, cluster, t, b, sp, unknowns, c, ep, linear_dtype, fused_elementwise
    )
    rows, share = b * model.seq_len / c, _rates(cluster, unknowns)[0]
    bw = cluster.memory_bandwidth
    gemm = functools.partial(
        gemm_seconds,
        peak_flops=cluster.peak_flops,
        bandwidth=bw,
        share=share,
        multiprocessors=cluster.multiprocessors,
        tile_overhead=unknowns.tile_overhead,
    )
    head, head_back = _forward_and_backward(gemm, rows, model.hidden, model.vocab / t)
    logits = 4 * rows * model.vocab / t * unknowns.traffic / 3 / bw
    head, head_back = head + logits, head_back + 2 * logits
    last_layers = layers - (ends_short >= 2)

    if selective == "every other matmul":
        rates = _rates(cluster, unknowns)
        linear = _linear_rate(cluster, unknowns, linear_dtype)
        bare = _layer_times_at(
            *(model, cluster, t, b, sp, rates[0], 0.0, c, ep),
            *(unknowns.tile_overhead, rates[1], linear, fused_elementwise),
        )[0]  # the forward without its element-wise kernels
        again = every_other_matmul_share(model) * (bare - score) + (layer - bare)
    elif selective == "core attention" or not model.layer_shape["fused_attention"]:
        again = score
    else:
        again = 0.0

    def stage(count: int, head: float, head_back: float) -> tuple[float, float, float]:
        recompute = {"full": count * layer, "selective": count * again, "none": 0.0}[mode]
        return count * layer + head, count * layer_back + head_back, recompute

    middle, last = stage(layers, 0.0, 0.0), stage(last_layers, head, head_back)
    return max(middle, last, key=sum)  # the slower stage sets the pace


def __getattr__(name: str) -> object:
    """``GEMM_SHARE``: the central estimate's GEMM share (:func:`gemm_share` at the central
    unknowns), an effective share of a compute-bound GEMM's main loop on an A100. Read off
    Table 4 when first asked for (and cached by :func:`gemm_share`), not when the planner
    is imported."""
    if name == "GEMM_SHARE":
        return gemm_share(CENTRAL.tile_overhead, CENTRAL.traffic)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
