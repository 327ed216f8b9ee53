"""Memory per GPU (the fullest pipeline stage): model state and activations.

* model state: 16 bytes per parameter (:data:`trainscale.memory.BYTES_PER_PARAM`),
  for the parameters of one pipeline stage divided over the TP group, with
  ZeRO sharding over the DP group exactly as :func:`trainscale.memory.model_state_groups`
  does it (chapters 2 and 7);
* activations per Korthikanti et al. (arXiv 2205.05198; bib key korthikanti2022reducing),
  :func:`trainscale.checkpointing.layer_activation_bytes` (chapter 3), shaped by the
  model (:attr:`Model.layer_shape`: grouped-query attention's smaller keys and
  values, the MLP's width and gating, a fused attention kernel that keeps no
  ``s x s`` table, no dropout masks where there is no dropout), times the layers
  of the stage, times the micro-batches in flight on it (1F1B keeps up to
  ``PP`` of them on the first stage), plus the embedding on the first stage and
  the output layer and its fp32 logits on the last one;
* and, beside what an eager layer keeps, the bytes its element-wise ops read and write
  (:func:`eager_layer_traffic_bytes`), which :mod:`trainscale.planner.kernels` times.

Allocator headroom stays one share, :data:`trainscale.memory.USABLE_MEMORY`
(:mod:`trainscale.planner` lists what else it covers), an assumption, not an explicit
term: we found no published figure for how much memory PyTorch's caching allocator loses to
fragmentation in a training run. PyTorch's CUDA memory-management notes describe the
effect qualitatively (reserved but unallocated blocks, ``max_split_size_mb``,
``expandable_segments``), and NVIDIA's Megatron Bridge memory-tuning guide
recommends ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` as the fix for
fragmentation-induced out-of-memory errors, with no figure either. So a layout the
planner puts near :data:`USABLE_MEMORY` of the GPU is one to check on the GPU.
"""

from __future__ import annotations

import functools
import math

from trainscale import _checks
from trainscale.checkpointing import layer_activation_bytes
from trainscale.context import gradient_reduce_ranks
from trainscale.memory import StateDtypes, model_state_groups
from trainscale.planner.inputs import Model, _recompute
from trainscale.software import DEFAULT_SOFTWARE, Software


def _stage(model: Model, pp: int, virtual_stages: int) -> tuple[int, int, float, int]:
    """Layers per model chunk, per stage, the compute imbalance, and parameters per stage.

    With ``pp * virtual_stages`` chunks the layers may not divide evenly; the planner
    gives the fullest chunk ``ceil(layers / chunks)`` layers and charges every stage
    as if it were that full (an upper bound on memory), and the pipeline runs at the
    pace of that chunk (``imbalance`` > 1 is the slowdown).
    """
    chunks = pp * virtual_stages
    per_chunk = -(-model.layers // chunks)
    per_stage = per_chunk * virtual_stages
    imbalance = per_chunk * chunks / model.layers
    if pp == 1:
        return model.layers, model.layers, 1.0, model.params
    body = -(-(per_stage * (model.params - model.embedding_params)) // model.layers)
    return per_chunk, per_stage, imbalance, body + model.vocab * model.hidden


def _chunks_fit(layers: int, pp: int, virtual_stages: int) -> bool:
    """Whether ``pp x virtual_stages`` pipeline model chunks fit ``layers`` layers: at most
    ``layers + 2`` of them, as the embedding and the output layer may each take a layer's
    place on the first and the last stage (Llama 3's balance, Dubey et al., arXiv
    2407.21783, section 3.3.2). The planner's one statement of the rule."""
    return pp * virtual_stages <= layers + 2


def _check_chunks(layers: int, pp: int, virtual_stages: int) -> None:
    """A ``ValueError`` naming ``pp x virtual_stages`` when they break :func:`_chunks_fit`."""
    if not _chunks_fit(layers, pp, virtual_stages):
        raise ValueError(
            f"pp x virtual_stages must be <= layers + 2 ({layers + 2}), got {pp * virtual_stages}"
        )


def stage_params(model: Model, tp: int, pp: int, virtual_stages: int = 1) -> int:
    """Parameters one GPU of the fullest pipeline stage holds before ZeRO: ``ceil(stage / TP)``.

    With ``pp > 1`` a stage holds ``ceil(layers / pp)`` layers and either the input
    embedding (first stage) or the output layer (last stage); Megatron-LM splits
    both over the tensor-parallel group along the vocabulary.
    """
    if not isinstance(model, Model):
        raise ValueError(f"model must be a planner.Model, got {type(model).__name__}")
    t = _checks.count("tp", tp, minimum=1)
    p = _checks.count("pp", pp, minimum=1)
    v = _checks.count("virtual_stages", virtual_stages, minimum=1) if p > 1 else 1
    _check_chunks(model.layers, p, v)
    return -(-_stage(model, p, v)[3] // t)


def model_state_per_gpu(
    model: Model,
    tp: int,
    pp: int,
    dp: int,
    zero_stage: int,
    virtual_stages: int = 1,
    context_parallel: int = 1,
) -> dict[str, int]:
    """Bytes of weights, gradients and optimiser state on one GPU of the fullest stage.

    The stage's parameters are divided over TP (:func:`stage_params`), then ZeRO
    shards them over the ranks that hold the same weights with
    :func:`trainscale.memory.model_state_groups`: the DP ranks and the
    ``context_parallel`` ranks, which split the tokens, not the weights
    (:func:`trainscale.context.gradient_reduce_ranks`, chapter 10).
    """
    per_gpu = stage_params(model, tp, pp, virtual_stages)
    return dict(_state(per_gpu, gradient_reduce_ranks(dp, context_parallel), zero_stage))


FP32_GRADIENTS = StateDtypes(gradients="float32")
"""Mixed precision with fp32 gradients (accumulated over micro-batches and reduced in
fp32, as Llama 3 did: Dubey et al., arXiv 2407.21783, section 3.3.2, "Numerical
stability"): 18 bytes per parameter instead of 16, and 4-byte gradients on the wire."""


@functools.lru_cache(maxsize=4096)
def _state(
    per_gpu: int, dp: int, zero_stage: int, fp32_gradients: bool = False
) -> tuple[tuple[str, int], ...]:
    dtypes = FP32_GRADIENTS if fp32_gradients else None
    return tuple(model_state_groups(per_gpu, dp, zero_stage, dtypes).items())


@functools.lru_cache(maxsize=4096)
def _activations(
    model: Model,
    t: int,
    p: int,
    b: int,
    m: int,
    mode: str,
    sp: bool,
    v: int,
    c: int = 1,
    software: Software = DEFAULT_SOFTWARE,
) -> float:
    """Activation bytes on the fullest pipeline stage (see :func:`activation_bytes_per_gpu`)."""
    s, h, vocab = model.seq_len // c, model.hidden, model.vocab
    per_layer = kept_per_layer(model, s, b, t, sp, mode, software)
    t_sp = t if sp else 1
    embedding = s * b * h / t_sp if model.layer_shape["dropout"] else 0.0  # 1-byte dropout mask
    # final norm, output input, fp32 logits; an eager loss's two fp32 gradients at its backward
    logits = (1 if software.fused_loss else 3) * 4 * s * b * vocab / t
    output = 4 * s * b * h / t_sp + logits
    per_chunk, per_stage, _, _ = _stage(model, p, v)
    if p == 1:
        return per_stage * per_layer + embedding + output
    if v == 1:
        # Layers that do not divide evenly: the first and last stages, which also hold
        # the embedding and the logits, get one layer fewer (as Llama 3 did); then the
        # second stage, full and with p - 1 micro-batches in flight, may hold the most.
        short = per_chunk * p - model.layers
        first_layers = per_chunk - (short >= 1)
        last_layers = per_chunk - (short >= 2)
        first = max(
            min(p, m) * first_layers * per_layer + min(p, m) * embedding,
            min(p - 1, m) * per_chunk * per_layer,
        )
        return max(first, last_layers * per_layer + output)
    # Megatron's interleaved warm-up: (v-1) p + 2 (p-1) chunk forwards before a backward.
    # When the layers fall short of p v full chunks, the first chunk of the first stage
    # and the last chunk of the last stage hold one layer fewer (Llama 3's balance: the
    # embedding and the output layer take a layer's place); in-flight chunks then hold
    # the stage's average layers per chunk.
    short = per_chunk * p * v - model.layers
    first_chunks, last_chunks = min(v * p + p - 1, v * m), min((v - 1) * p + 1, v * m)
    first_per_chunk = (per_stage - (short >= 1)) / v
    last_per_chunk = (per_stage - (short >= 2)) / v
    first = first_chunks * first_per_chunk * per_layer + min(p, m) * embedding
    middle = min(v * p + p - 3, v * m) * per_chunk * per_layer if p > 2 else 0.0
    last = last_chunks * last_per_chunk * per_layer + output
    return max(first, middle if short else 0.0, last)


def eager_layer_activation_bytes(
    model: Model, s: int, b: int, t: int, sp: bool, keep_gathered: bool = False
) -> float:
    """Bytes one gated (Llama-shaped) layer keeps for backward when its element-wise work
    runs as separate eager PyTorch ops, as torchtitan's model runs it
    (torchtitan/models/llama/model.py and models/norms.py at 9dec370), with a fused attention
    kernel and no recomputation; per token of ``s x b`` on one of ``t`` tensor-parallel ranks,
    16-bit activations:

    * each RMSNorm (two per layer) computes in fp32: it keeps its fp32 input copy, the
      16-bit normalised value its weight multiplies and the weighted output the next
      products read, ``4h + 2h + 2h``; split by TP with sequence parallelism, and with
      DTensor's plan (``keep_gathered``) the gathered output kept whole, ``2h (1 - 1/t)``
      more;
    * the rotary embedding keeps nothing per token (the product's other operand, the
      rotation, needs no gradient);
    * the attention kernel keeps its queries, its keys and values repeated to every head
      (``repeat_kv``), its output (the output projection's input too) and its fp32 per-row
      statistic, ``4 x 2h + 4a``;
    * the gated MLP keeps the gate's and the up projection's outputs, the SiLU output and
      the product, ``4 x 2f``.

    Per layer ``24 h + 8 f + 4 a`` bytes per token without TP, about 52 ``h`` for Llama 3
    8B, against Korthikanti et al.'s count for fused kernels
    (:func:`trainscale.checkpointing.layer_activation_bytes`); ``tests/test_planner_unknowns.py``
    checks it against what autograd keeps for an eager block written that way. A layer that
    is not gated (LayerNorm and GeLU are single ATen ops that keep their inputs) keeps
    Korthikanti et al.'s count; so does every layer of a stack whose ``fused_elementwise``
    is true."""
    h, a = model.hidden, model.heads
    f = model.top_k * model.expert_width if model.experts else model.ffn_hidden or 4 * h
    norms = 2 * (4 * h + 2 * h + 2 * h) / (t if sp else 1)
    gathered = 2 * 2 * h * (1 - 1 / t) if sp and keep_gathered else 0.0
    attention = (4 * 2 * h + 4 * a) / t
    mlp = 4 * 2 * f / t
    return s * b * (norms + gathered + attention + mlp)


def eager_layer_traffic_bytes(
    model: Model, s: int, b: int, t: int, sp: bool
) -> tuple[float, float]:
    """``(forward, backward)`` bytes of memory traffic of one gated layer's eager
    element-wise ops on one GPU (the layer of :func:`eager_layer_activation_bytes`): what
    every ATen op other than the matrix products and the attention kernel reads and writes.

    Op by op, per token, without TP (``h`` hidden, ``f`` MLP width, ``k`` the keys' width
    ``kv_heads x h / heads``):

    * each RMSNorm, forward: the fp32 copy (``2h`` read, ``4h`` written), the square, the
      mean, the product with the reciprocal norm, the copy back to 16 bits and the product
      with the weight, ``36h``; backward (autograd's thirteen ops, two of them the weight's
      gradient), ``92h``;
    * the residual adds, ``6h`` each forward and backward, two of each;
    * the rotary embedding of queries (keys: ``k`` for ``h``): fp32 copy, complex product,
      copy back, ``20h`` forward and the same backward; repeating the keys and values to
      every head, ``2k + 2h`` each way for each;
    * the gated MLP: the SiLU (``4f``) and the product (``6f``) forward, their gradients
      (``18f``) backward;
    * backward, the gradients of the two norms' outputs summed over the products that read
      them (three adds of ``6h``).

    Forward ``108h + 24k + 10f``, backward ``238h + 24k + 18f``: ``346h + 48k + 28f`` per
    token, about 1.9 MB for Llama 3 8B, where the planner's fused count moves ``traffic``
    (:data:`trainscale.planner.unknowns.ELEMENTWISE_TRAFFIC`, 3 in the middle of its span)
    times the 0.14 MB Korthikanti et al.'s layer keeps, 0.42 MB. With TP the head-split
    ops (rotary, repeats, MLP) divide by ``t``; with sequence parallelism the norms and
    residual adds do too; the three gradient sums run on the gathered, whole sequence.
    Left out: the norms' fp32 statistics and the rotation table's reads, 0.2 % of it for
    Llama 3 8B (``tests/test_planner_unknowns.py`` counts every op with a dispatch mode
    and finds exactly these left over)."""
    h, a = model.hidden, model.heads
    k = (model.kv_heads or a) * (h // a)
    f = model.top_k * model.expert_width if model.experts else model.ffn_hidden or 4 * h
    t_sp = t if sp else 1
    forward = 84 * h / t_sp + (24 * h + 24 * k + 10 * f) / t
    backward = 196 * h / t_sp + 18 * h + (24 * h + 24 * k + 18 * f) / t
    return s * b * forward, s * b * backward


def kept_per_layer(
    model: Model, s: int, b: int, t: int, sp: bool, mode: str, software: Software
) -> float:
    """Bytes one layer keeps for backward on one GPU under ``software``: torchtitan's per-op
    selective policy (:func:`every_other_matmul_bytes`), an eager gated layer's ops
    (:func:`eager_layer_activation_bytes`) or Korthikanti et al.'s count
    (:func:`trainscale.checkpointing.layer_activation_bytes`), the only one that
    applies to full recomputation (the layer's input)."""
    keep = sp and t > 1 and software.sequence_parallel_style == "keep gathered"
    if mode == "selective" and software.selective_recompute == "every other matmul":
        return every_other_matmul_bytes(model, s, b, t, sp)
    if mode != "full" and not software.fused_elementwise and model.gated_mlp:
        return eager_layer_activation_bytes(model, s, b, t, sp, keep)
    shape = {**model.layer_shape, "keep_gathered_inputs": keep}
    return layer_activation_bytes(s, b, model.hidden, model.heads, t, sp, mode, **shape)


def layer_matmuls(model: Model) -> list[tuple[int, int, bool]]:
    """A layer's forward matrix products in the order they run: ``(inputs, outputs,
    column-parallel)`` widths per token (queries, keys, values, the output projection,
    the MLP's input matrices, gate first when gated, and its output matrix; a mixture of
    experts' ``top_k`` experts as one MLP). Column-parallel products split their output
    over TP; row-parallel ones (the output projection, the MLP's output) produce a whole
    ``hidden`` partial sum on every rank."""
    h, d = model.hidden, model.hidden // model.heads
    kv = (model.kv_heads or model.heads) * d
    ffn = model.top_k * model.expert_width if model.experts else model.ffn_hidden or 4 * h
    mlp_in = [(h, ffn, True)] * (2 if model.gated_mlp else 1)
    return [(h, h, True), (h, kv, True), (h, kv, True), (h, h, False), *mlp_in, (ffn, h, False)]


def every_other_matmul_bytes(model: Model, s: int, b: int, t: int, sp: bool) -> float:
    """Bytes one layer keeps for backward under torchtitan's per-op selective policy
    (``selective_ac_option = "op"``, torchtitan/parallelisms/parallelize_llama.py@9dec370,
    lines 214-276): the checkpointed block's 16-bit input (split by TP with sequence
    parallelism), the outputs of the 1st, 3rd, 5th, ... matrix products
    (:func:`layer_matmuls`; the others are recomputed), the attention kernel's output and
    its fp32 per-row statistic; everything element-wise is recomputed. ``s`` tokens of
    ``b`` sequences on one of ``t`` tensor-parallel ranks."""
    tokens = s * b
    kept = 2 * tokens * model.hidden / (t if sp else 1)
    for position, (_, width, column) in enumerate(layer_matmuls(model), start=1):
        if position % 2:
            kept += 2 * tokens * width / (t if column else 1)
    kept += 2 * tokens * model.hidden / t + 4 * tokens * model.heads / t  # attention's output
    return kept


def every_other_matmul_share(model: Model) -> float:
    """The share of a layer's forward matrix-product FLOPs torchtitan's per-op policy
    recomputes: the 2nd, 4th, ... products of :func:`layer_matmuls`."""
    flops = [width_in * width_out for width_in, width_out, _ in layer_matmuls(model)]
    return sum(flops[1::2]) / sum(flops)


def activation_bytes_per_gpu(
    model: Model,
    tp: int,
    pp: int,
    micro_batch: int,
    micro_batches: int,
    recompute: str = "none",
    sequence_parallel: bool = True,
    virtual_stages: int = 1,
    context_parallel: int = 1,
) -> float:
    """Activation bytes on one GPU of the fullest pipeline stage.

    :func:`layer_activation_bytes` times the layers of a stage times the
    micro-batches in flight. With the 1F1B schedule the first stage has started
    ``min(pp, micro_batches)`` micro-batches before it finishes one (its layers
    add up to the whole model's, Korthikanti et al. section 4.2.3), the last stage
    one; the interleaved schedule keeps ``(v+1) p - 1`` model chunks in flight on the
    first stage. Added outside the layers (section 4.3): the embedding's 1-byte
    dropout mask on the first stage, and on the last the final layer norm's input,
    the output layer's input and the fp32 logits the loss needs (``4 s b vocab / t``;
    three times that with a stack whose loss is not fused, ``Software.fused_loss``: the
    fp32 gradients of the log-probabilities and of the logits as the backward starts).
    Without pipelining all of it lands on one stage, once. Context parallelism
    (``context_parallel`` ranks) keeps ``seq_len / context_parallel`` tokens of every
    sequence on each GPU, so every term shrinks by that factor (with a fused attention
    kernel no term grows with the whole sequence).
    """
    if not isinstance(model, Model):
        raise ValueError(f"model must be a planner.Model, got {type(model).__name__}")
    t = _checks.count("tp", tp, minimum=1)
    p = _checks.count("pp", pp, minimum=1)
    b = _checks.count("micro_batch", micro_batch, minimum=1)
    m = _checks.count("micro_batches", micro_batches, minimum=1)
    mode = _recompute("recompute", recompute)
    sp = _checks.boolean("sequence_parallel", sequence_parallel)
    v = _checks.count("virtual_stages", virtual_stages, minimum=1) if p > 1 else 1
    _check_chunks(model.layers, p, v)
    c = _checks.count("context_parallel", context_parallel, minimum=1)
    if model.seq_len % c:
        raise ValueError(
            f"context_parallel must divide seq_len ({model.seq_len}), got {context_parallel}"
        )
    return _activations(model, t, p, b, m, mode, sp, v, c)


def _model_state(
    model: Model,
    per_stage: int,
    stage_total: int,
    t: int,
    d: int,
    c: int,
    ep: int,
    zero: int,
    fp32: bool,
) -> tuple[dict[str, int], float]:
    """Model-state bytes on one GPU, and the parameters its data-parallel traffic carries.

    The dense parameters of the stage are split over TP and sharded by ZeRO over the
    ``d c`` ranks that hold the same ones (Megatron-core reduces gradients over DP and
    CP together); the experts' over ``t ep`` and sharded over the ``d c / ep`` ranks
    that hold the same experts. The second number is the dense parameters plus the
    expert ones scaled to the dense group's ring share (``(n-1)/n``), so one call of
    the data-parallel cost prices both groups.
    """
    experts = per_stage * model.expert_params_per_layer
    dense_gpu = -(-(stage_total - experts) // t)
    holders = gradient_reduce_ranks(d, c)  # DP x CP hold the same dense weights
    state = dict(_state(dense_gpu, holders, zero, fp32))
    if not experts:
        return state, dense_gpu
    expert_gpu = -(-experts // (t * ep))
    group = holders // ep
    for key, value in _state(expert_gpu, group, zero, fp32):
        state[key] += value
    ring, expert_ring = (holders - 1) / holders, (group - 1) / group
    return state, dense_gpu + math.ceil(expert_gpu * expert_ring / ring if ring else 0)
