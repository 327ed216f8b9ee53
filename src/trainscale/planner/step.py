"""One layout's evaluation: memory per GPU, step time and MFU (:func:`evaluate`).

Step time (:func:`evaluate` lists every term), two models
    The simple one (``efficiency=`` a number, e.g. :data:`KERNEL_EFFICIENCY`), the
    one chapter 16 builds by hand: compute at ``peak x``
    :data:`KERNEL_EFFICIENCY` for the ``6 N`` FLOPs per token (chapter 1), plus
    recomputation (chapter 3); tensor-parallel all-reduces, never hidden (ring cost
    from chapter 6); pipeline sends; the pipeline bubble (chapter 9,
    :func:`trainscale.pipeline.bubble`); and data-parallel traffic (the bytes of
    chapter 7's ZeRO stages), which hides under one micro-batch's compute and is
    exposed beyond it.

    The calibrated one (``efficiency=None``, the default of :func:`plan` and
    :func:`evaluate`; :func:`estimate_run` uses it), which adds, each term with its
    source:

    * every GEMM of a layer at its roofline (:func:`gemm_seconds`: Williams et al.
      2009's roofline, with the wave quantisation of NVIDIA's "Matrix Multiplication
      Background" user's guide, and each tile's fixed cost, :func:`tile_overhead_k`:
      writing its output, so a GEMM whose reduction ``k`` is short runs slower per
      FLOP), the backward's gradient GEMMs at their own shapes, shaped by the model:
      grouped-query attention (``kv_heads``), the MLP width and gating (``ffn_hidden``,
      ``gated_mlp``), attention's ``s x s`` products (fused or not, ``fused_attention``:
      Dao et al. 2022; a fused kernel computes only the key blocks the causal mask
      leaves, :data:`trainscale.context.CAUSAL_WORK_SHARE` of them, as FlashAttention's
      causal kernels stop at the diagonal block, ``n_block_max`` in
      Dao-AILab/flash-attention's ``flash_fwd_kernel.h``; an unfused one computes the
      whole table and masks it), and the output layer's GEMM on the last stage; the main
      loop of a compute-bound GEMM runs at :data:`GEMM_SHARE` of peak, read off one
      measurement, Korthikanti et al.'s Table 4 (:func:`gemm_share`), and moved to other
      GPUs by the ratio of their fastest measured GEMMs
      (:attr:`Cluster.max_matmul_share`);
    * element-wise kernels at the memory bandwidth: :data:`ELEMENTWISE_TRAFFIC` x
      the bytes a layer keeps (Korthikanti et al.'s count, chapter 3);
    * overlap achieved (:data:`OVERLAP`): the share of the data-parallel traffic, and
      of the backward's tensor-parallel collectives, that hides under compute (for a
      stack whose code shows it, that share: :meth:`trainscale.software.Software.overlap_shares`);
    * the optimiser step, memory bound: :data:`OPTIMISER_STEP_BYTES` for each
      parameter a GPU updates (Megatron-LM's passes: gradient norm, Adam, the copy to
      16-bit weights, zeroing the gradients);
    * ZeRO-3 gathered layer by layer with prefetching (:func:`_zero3_prefetch`: per
      layer only ``max(0, traffic - compute)`` is exposed, plus the first gather and the
      last reduce-scatter), which the :data:`OVERLAP` band blends with no overlap at all;
      the third gather full recomputation needs, and the latency of layer-by-layer
      collectives (:func:`_zero3_extra`, :data:`COLLECTIVE_STEP_SECONDS`);
    * a fused attention kernel's backward recomputes ``Q K^T`` (Dao et al. 2022), so
      selective recomputation adds nothing to it;
    * a pipeline balanced as Llama 3's (Dubey et al., arXiv 2407.21783, section 3.3.2):
      when the layers fall short of the stages' slots, the first and the last stage
      hold one layer fewer, the embedding and the output layer taking their place, so
      ``PP x virtual_stages`` may reach ``layers + 2``;
    * the schedule: 1F1B, interleaved or not, or zero-bubble ZB-H1 (:data:`SCHEDULES`);
    * a gradient reduce-scatter after every micro-batch (ZeRO-2) keeps running under
      the next micro-batch's forward, which 1F1B starts right after a backward
      (:func:`_data_parallel_seconds`);
    * gradients in fp32 (the software's ``gradient_reduce_dtype``, :data:`FP32_GRADIENTS`:
      Llama 3 accumulates
      and reduce-scatters them in fp32, section 3.3.2): 4 bytes per gradient in memory
      and on the wire;
    * the interleaving depth, searched per layout by :func:`estimate_run`
      (:data:`INTERLEAVING`), with its bubble and its extra activation memory.

    Then ``MFU = 6 N x tokens per step / (step time x GPUs x peak)`` (chapter 15).

Placement follows Megatron-LM's rank order: TP ranks are neighbours (inside a
node when ``gpus_per_node`` is a multiple of TP), then DP, then PP. Each link is
charged at the cluster's per-GPU bandwidth of the slowest hop it crosses.
"""

from __future__ import annotations

import functools

from trainscale import _checks
from trainscale.checkpointing import selective_recompute_flops
from trainscale.collectives import layer_collectives
from trainscale.compute import FLOPS_PER_PARAM_PER_TOKEN, mfu
from trainscale.context import gradient_reduce_ranks
from trainscale.memory import BYTES_PER_PARAM, GIB, OPTIMIZER_STATE, USABLE_MEMORY
from trainscale.pipeline import bubble as _bubble
from trainscale.pipeline import bubble_zb_h1
from trainscale.planner.inputs import (
    Cluster,
    Model,
    _check_inputs,
    _Problem,
    _recompute,
    _software,
    _zero,
)
from trainscale.planner.kernels import _layer_times, _roofline
from trainscale.planner.layout import (
    _SEVERITY,
    MAX_BUBBLE,
    Layout,
    _invalid,
    _Options,
    _options,
    _Shape,
)
from trainscale.planner.memory import _activations, _chunks_fit, _model_state, _stage
from trainscale.planner.traffic import (
    _context_parallel_seconds,
    _data_parallel_seconds,
    _expert_parallel_seconds,
    _parallel_notes,
    _tensor_collective_seconds,
    _zero3_extra,
    _zero3_prefetch,
)
from trainscale.planner.unknowns import CENTRAL
from trainscale.software import Software

_OPTIMISER_BYTES = sum(BYTES_PER_PARAM[part] for part in OPTIMIZER_STATE)  # 12 per parameter

OPTIMISER_STEP_BYTES = 4 + (16 + 12) + (4 + 2) + 4
"""Bytes the optimiser step moves per parameter a GPU updates, 42: the passes of
Megatron-LM's mixed-precision step (``Float16OptimizerWithFloat16Params.step`` in
``megatron/optimizer/optimizer.py``, commit d239429) with bf16 and fp32 main
gradients: the gradient norm reads each fp32 gradient (4); Adam reads the fp32 weight,
gradient and two moments and writes the weight and moments (16 + 12); the 16-bit
weights are copied from the fp32 ones (4 + 2); the gradient buffer is zeroed for the
next step (4). With fp16, loss scaling adds a copy of the 16-bit gradients to fp32 and
the unscaling pass (6 + 8 more). The planner charges 42 for every run, fp16 ones
included (the difference is under a thousandth of their steps)."""


@functools.lru_cache(maxsize=4096)
def bubble(p: int, m: int, v: int) -> float:
    """:func:`trainscale.pipeline.bubble`, remembered (the search asks for few)."""
    return _bubble(p, m, v)


@functools.cache
def _tensor_halves(style: str) -> dict[str, int]:
    """Half-collectives (an all-reduce counts two) one layer runs per pass under a
    sequence-parallel ``style`` of :data:`trainscale.software.SEQUENCE_PARALLEL_STYLES`
    (``""``: none), from :func:`trainscale.parallel.layer_collectives`."""
    counts = layer_collectives(style or "none")
    return {
        phase: sum(n * (2 if kind == "all-reduce" else 1) for kind, n in kinds.items())
        for phase, kinds in counts.items()
    }


def _evaluate(problem: _Problem, shape: _Shape, opt: _Options) -> Layout:
    """What :func:`evaluate` returns for one layout: ``problem``, ``shape`` and ``opt`` as
    its callers checked them (:func:`evaluate`, :func:`trainscale.planner.search.plan`,
    :mod:`trainscale.planner.calibration`)."""
    model, cluster, batch = problem.model, problem.cluster, problem.batch
    t, p, d, c, ep = shape.tp, shape.pp, shape.dp, shape.cp, shape.ep
    zero, mode, b = shape.zero_stage, shape.recompute, shape.micro_batch
    v = opt.virtual_stages if p > 1 else 1  # without a pipeline there is nothing to interleave
    notes = _parallel_notes(model, t, d, c, ep, opt.sequence_parallel) if c > 1 or ep > 1 else []
    notes += opt.software.layout_problems(p, v, zero)
    if model.heads % t:
        notes.append(f"TP {t} does not divide the {model.heads} attention heads")
    if opt.software.linear_dtype == "fp8" and (
        cluster.fp8_peak_flops is None or cluster.fp8_max_matmul_share is None
    ):
        notes.append("FP8 linear layers need a GPU with a measured FP8 GEMM")
    if not _chunks_fit(model.layers, p, v):
        notes.append(f"{p * v} pipeline chunks for {model.layers} layers")
    if batch % d:
        notes.append(f"DP {d} does not divide the global batch of {batch} sequences")
    elif opt.schedule == "zb-h1" and p > 1 and (v > 1 or batch // (d * b) < p):
        notes.append("ZB-H1 needs at least as many micro-batches as stages, not interleaved")
    elif (batch // d) % b:
        notes.append(f"micro-batch {b} does not divide the {batch // d} sequences per DP rank")
    tp_across = cluster.gpus_per_node % t != 0
    across = (
        f"TP {t} spans nodes of {cluster.gpus_per_node} GPUs: its all-reduces cross the network"
    )
    if notes:
        if tp_across:
            return _invalid(shape, batch, ["invalid", "TP across nodes"], [*notes, across])
        return _invalid(shape, batch, ["invalid"], notes)

    m = batch // (d * b)
    s, h, gpn = model.seq_len, model.hidden, cluster.gpus_per_node
    intra, inter = cluster.intra_node_bandwidth, cluster.inter_node_bandwidth

    # Memory on the fullest stage.
    _, per_stage, imbalance, stage_total = _stage(model, p, v)
    fp32 = opt.software.gradient_reduce_dtype == "fp32"
    state, per_gpu = _model_state(model, per_stage, stage_total, t, d, c, ep, zero, fp32)
    dp_ranks = gradient_reduce_ranks(d, c)  # the ranks that hold the same dense weights
    grad_bytes = opt.software.gradient_bytes
    activations = _activations(model, t, p, b, m, mode, opt.sequence_parallel, v, c, opt.software)
    memory_parts = {**state, "activations": activations}
    memory = sum(memory_parts.values())

    # Compute of one micro-batch on the slowest stage: at the roofline of each
    # kernel (efficiency=None), or 6N FLOPs at one achievable FLOP rate.
    if opt.efficiency is None:
        short = -(-model.layers // (p * v)) * p * v - model.layers if p > 1 else 0
        sp, unknowns = opt.sequence_parallel, opt.unknowns
        stack = opt.software
        forward, backward, recompute = _roofline(
            *(model, cluster, t, b, per_stage, mode, sp, unknowns, short, c, ep),
            *(stack.selective_recompute, stack.linear_dtype, stack.fused_elementwise),
        )
        compute = forward + backward
        attention = _layer_times(
            *(model, cluster, t, b, sp, unknowns, c, ep),
            *(stack.linear_dtype, stack.fused_elementwise),
        )[1]
    else:
        rate = cluster.peak_flops * opt.efficiency
        six = sum(FLOPS_PER_PARAM_PER_TOKEN.values())
        compute = six * model.active_params * b * s / (p * t * c) * imbalance / rate
        attention = 4 * b * (s / c) * s * h / t / rate
        forward = compute * FLOPS_PER_PARAM_PER_TOKEN["forward"] / six
        backward = compute - forward
        if mode == "full":
            recompute = forward  # one more forward pass
        elif mode == "selective":  # the attention scores of every layer, again
            recompute = selective_recompute_flops(s, b, h, t) * per_stage / rate
        else:
            recompute = 0.0
    overlap = 1.0 if opt.efficiency is not None else opt.unknowns.overlap
    documented = opt.software.overlap_shares(p, zero)  # what the stack's code shows
    if opt.overlap is not None:  # a share pinned by the caller replaces both
        documented = (opt.overlap, opt.overlap)
    data_overlap = overlap if documented[0] is None else documented[0]
    tensor_overlap = overlap if documented[1] is None else documented[1]

    # Tensor parallelism: the layer's collectives of s x b x h 16-bit values per
    # micro-batch (chapter 8's count, trainscale.parallel.layer_collectives): 2
    # all-reduces forward and 2 backward, or their halves with sequence parallelism,
    # plus 2 all-gathers in backward where the stack gathers the input again
    # (Megatron-LM); the forward's again when it is recomputed.
    tp_link = inter if tp_across else intra
    halves = _tensor_halves(opt.software.sequence_parallel_style if opt.sequence_parallel else "")
    forward_halves = halves["forward"] * (2 if mode == "full" else 1)
    half = _tensor_collective_seconds(s / c, b, h, t, tp_link) / 2  # a CP rank's tokens
    tensor = per_stage * (forward_halves + halves["backward"]) * half
    if opt.efficiency is None:  # the backward's hide under the gradient GEMMs
        tensor -= tensor_overlap * min(per_stage * halves["backward"] * half, backward / 2)

    # Context and expert parallelism: ring attention's keys and values, the MoE
    # all-to-alls. Megatron's rank order TP, CP, DP (EP inside DP), PP.
    cp_link = intra if gpn % (t * c) == 0 else inter
    ep_link = intra if gpn % (t * c * ep) == 0 else inter
    hides = overlap if opt.software.context_parallel_style == "ring" else 0.0  # all-gather: none
    context = _context_parallel_seconds(model, t, b, c, per_stage, mode, cp_link, attention, hides)
    expert = _expert_parallel_seconds(model, t, b, c, ep, per_stage, mode, ep_link)

    # Pipeline: each micro-batch sends its activations forward and its gradient
    # back, 1/t of them per GPU (Megatron's scatter/gather), once per model chunk.
    pp_link = intra if cluster.nodes == 1 else inter
    sends = 0.0 if p == 1 else 2 * v * 2 * (s / c) * b * h / t / pp_link

    # Data parallelism over the 16-bit gradients and weights of the stage, reduced
    # over the DP and CP ranks together.
    dp_link = intra if gpn % (t * c * d) == 0 else inter
    window = backward + recompute  # what one micro-batch's backward phase lasts
    dp_each, dp_once = _data_parallel_seconds(
        per_gpu, dp_ranks, zero, dp_link, forward, window, grad_bytes, m
    )
    if opt.efficiency is None:
        regather, latency = _zero3_extra(per_gpu, dp_ranks, zero, mode, per_stage, dp_link)
        all_each, all_once = _data_parallel_seconds(
            per_gpu, dp_ranks, zero, dp_link, 0.0, 0.0, grad_bytes
        )
        hidden_each = dp_each + max(0.0, regather - recompute)
        shown = 1 - data_overlap
        dp_each = data_overlap * hidden_each + shown * (all_each + regather) + latency
        dp_once = data_overlap * dp_once + shown * all_once
        if zero == 3:  # prefetched layer by layer; OVERLAP: how much of the prefetch works
            best = _zero3_prefetch(
                per_gpu, dp_ranks, mode, per_stage, dp_link, forward, window, grad_bytes
            )
            dp_each = data_overlap * best + shown * (all_each + regather) + latency

    # The optimiser step, once per step, memory bound: OPTIMISER_STEP_BYTES for each
    # parameter this GPU updates (all its own without ZeRO, its shard with it). The
    # simple model leaves it out.
    optimiser = 0.0
    if opt.efficiency is None:
        owned = state["optimiser state"] / _OPTIMISER_BYTES
        optimiser = owned * OPTIMISER_STEP_BYTES / cluster.memory_bandwidth

    per_micro = compute + recompute + tensor + context + expert + sends + dp_each
    busy = m * per_micro
    if opt.schedule == "zb-h1" and p > 1:
        idle_share = bubble_zb_h1(p, m, forward, backward, min(backward / 2, forward))
    else:
        idle_share = bubble(p, m, v)
    times = {
        "compute": m * compute,
        "recomputation": m * recompute,
        "tensor-parallel traffic": m * tensor,
        "context-parallel traffic": m * context,
        "expert-parallel traffic": m * expert,
        "pipeline sends": m * sends,
        "data-parallel traffic": m * dp_each + dp_once,
        "optimiser step": optimiser,
        "pipeline bubble": busy * idle_share / (1 - idle_share),  # idle = busy x b / (1 - b)
    }
    step = sum(times.values())
    bubble_share = times["pipeline bubble"] / step
    utilisation = mfu(batch * s / step, model.active_params, t * c * p * d, cluster.peak_flops)

    problems = []
    if memory > opt.usable_memory * cluster.memory_bytes:
        problems.append("out of memory")
        notes.append(
            f"{memory / GIB:.1f} GiB per GPU, over {opt.usable_memory:.0%} of "
            f"{cluster.memory_bytes / GIB:.1f} GiB"
        )
    if tp_across:
        problems.append("TP across nodes")
        notes.append(across)
    if bubble_share > opt.max_bubble:
        problems.append("bubble too large")
        notes.append(f"pipeline idle {bubble_share:.0%} of the step with {m} micro-batches")
    verdict = next((kind for kind in _SEVERITY if kind in problems), "fits")
    return Layout(
        tp=t,
        pp=p,
        dp=d,
        zero_stage=zero,
        recompute=mode,
        micro_batch=b,
        global_batch=batch,
        accumulation=m,
        memory_parts=memory_parts,
        memory_bytes=memory,
        times=times,
        step_seconds=step,
        mfu=utilisation,
        bubble=bubble_share,
        verdict=verdict,
        problems=tuple(sorted(problems, key=_SEVERITY.index)),
        notes=tuple(notes),
        virtual_stages=v,
        sequence_parallel=opt.sequence_parallel,
        cp=c,
        ep=ep,
    )


def evaluate(
    model: Model,
    cluster: Cluster,
    global_batch: int,
    tp: int,
    pp: int,
    dp: int,
    zero_stage: int = 1,
    recompute: str = "selective",
    micro_batch: int = 1,
    *,
    sequence_parallel: bool = True,
    virtual_stages: int = 1,
    efficiency: float | None = None,
    usable_memory: float = USABLE_MEMORY,
    max_bubble: float = MAX_BUBBLE,
    schedule: str = "1f1b",
    software: Software | str | None = None,
    context_parallel: int = 1,
    expert_parallel: int = 1,
) -> Layout:
    """Estimate memory per GPU, step time and MFU of one layout.

    ``global_batch`` is in sequences; ``tp * context_parallel * pp * dp`` must equal
    the cluster's GPUs; ``expert_parallel`` spreads a mixture of experts over that many
    of the DP ranks (:func:`_context_parallel_seconds`, :func:`_expert_parallel_seconds`
    price their traffic). The pipeline runs ``m = global_batch / (micro_batch * dp)`` micro-batches
    per step (the accumulation steps), each taking on the slowest stage:

    * compute: with ``efficiency=None`` (the default) the roofline of every kernel of
      the stage's layers (:func:`gemm_seconds`, the module docstring lists the terms);
      with a number, ``6 N b s / (pp tp)`` FLOPs at ``peak * efficiency``, times the
      layer imbalance when ``pp`` does not divide the layers;
    * recomputation: full, one more forward pass (a third more compute); selective,
      the attention scores again
      (:func:`trainscale.checkpointing.selective_recompute_flops`, ``2 b s^2 h / t``
      FLOPs per layer);
    * tensor parallelism: per layer 4 all-reduces of ``2 s b h`` bytes (6 with full
      recomputation), :func:`trainscale.collectives.ring_factor` (``2 (t-1)/t``) of
      them sent per GPU, over NVLink if TP fits in
      a node and over the network otherwise; the calibrated model hides
      :data:`OVERLAP` of the backward's two under its weight-gradient GEMMs, the
      simple one none;
    * pipeline sends: the activation forward and its gradient back, ``2 s b h / t``
      bytes each, per model chunk;
    * data-parallel traffic that did not hide under compute, each collective
      moving ``(d-1)/d x 2`` bytes per parameter of the stage (16-bit), twice for
      an all-reduce (:func:`trainscale.sharding.zero_collective_bytes`; which run
      every micro-batch: :data:`trainscale.sharding.ZERO_COLLECTIVES`). Without
      ZeRO, one gradient all-reduce per step, started bucket
      by bucket during the last micro-batch's backward and hidden under it as far
      as it lasts. ZeRO-1 splits it into a reduce-scatter of the gradients (under
      that backward) and an all-gather of the updated weights (prefetched under
      the next forward). ZeRO-2 keeps only a shard of the gradients, so it must
      reduce-scatter them after *every* micro-batch (holding the full gradient
      until the last one is what ZeRO-1 does). ZeRO-3 also all-gathers the weights
      before every forward and every backward: with one micro-batch, 1.5 times
      the traffic of the others;
    * the optimiser step (calibrated model only), once per step at the memory
      bandwidth.

    Then the pipeline idles :func:`trainscale.pipeline.bubble`, ``(p-1)/(v m + p - 1)``,
    of its time (chapter 9): ``(pp - 1) / virtual_stages`` micro-batch slots; with
    ``schedule="zb-h1"`` (:data:`SCHEDULES`) :func:`trainscale.pipeline.bubble_zb_h1`.
    The verdict is ``out of memory`` beyond ``usable_memory`` of the GPU, ``TP across nodes``
    when a TP group spans nodes, ``bubble too large`` beyond ``max_bubble``, and
    ``invalid`` when TP does not divide the heads, the chunks outnumber the layers,
    or DP and the micro-batch do not divide the batch.
    """
    batch = _check_inputs(model, cluster, global_batch)
    stack = _software(software)
    t = _checks.count("tp", tp, minimum=1)
    p = _checks.count("pp", pp, minimum=1)
    d = _checks.count("dp", dp, minimum=1)
    c = _checks.count("context_parallel", context_parallel, minimum=1)
    ep = _checks.count("expert_parallel", expert_parallel, minimum=1)
    if t * c * p * d != cluster.gpus:
        raise ValueError(
            f"tp x pp x dp x context_parallel must equal the cluster's {cluster.gpus} GPUs,"
            f" got {t}x{p}x{d}x{c}"
        )
    zero = _zero("zero_stage", zero_stage)
    mode = _recompute("recompute", recompute)
    b = _checks.count("micro_batch", micro_batch, minimum=1)
    opt = _options(
        sequence_parallel,
        virtual_stages,
        efficiency,
        usable_memory,
        max_bubble,
        CENTRAL,
        schedule,
        software=stack,
    )
    shape = _Shape(tp=t, pp=p, dp=d, zero_stage=zero, recompute=mode, micro_batch=b, cp=c, ep=ep)
    return _evaluate(_Problem(model.under(stack), cluster, batch), shape, opt)
