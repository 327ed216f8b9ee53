"""The layout planner of chapter 13: which TP x PP x DP layout to start a large run with.

Given a model, a cluster and a global batch, :func:`plan` tries every way of
splitting the GPUs into tensor (TP), pipeline (PP) and data (DP) parallel groups,
and, where they can help, context-parallel (CP) groups and expert-parallel (EP)
groups inside DP, with every ZeRO stage, every activation-recomputation mode and every candidate
micro-batch size, and estimates for each one the memory per GPU and the time of
one training step. It is a *model*: a small set of stated assumptions, each
with its source, meant to rank layouts and to explain why the bad ones are bad,
not to predict a step time to the millisecond.

Memory per GPU (the fullest pipeline stage)
    * model state: 16 bytes per parameter (:data:`trainscale.memory.BYTES_PER_PARAM`),
      for the parameters of one pipeline stage divided over the TP group, with
      ZeRO sharding over the DP group exactly as :func:`trainscale.memory.model_state_groups`
      does it (chapters 02 and 05);
    * activations per Korthikanti et al. (arXiv 2205.05198; bib key korthikanti2022reducing),
      :func:`trainscale.checkpointing.layer_activation_bytes` (chapter 09), shaped by the
      model (:attr:`Model.layer_shape`: grouped-query attention's smaller keys and
      values, the MLP's width and gating, a fused attention kernel that keeps no
      ``s x s`` table, no dropout masks where there is no dropout), times the layers
      of the stage, times the micro-batches in flight on it (1F1B keeps up to
      ``PP`` of them on the first stage), plus the embedding on the first stage and
      the output layer and its fp32 logits on the last one.

Step time (:func:`evaluate` lists every term), two models
    The simple one (``efficiency=`` a number, e.g. :data:`KERNEL_EFFICIENCY`), the
    one chapter 13 builds by hand: compute at ``peak x``
    :data:`KERNEL_EFFICIENCY` for the ``6 N`` FLOPs per token (chapter 01), plus
    recomputation (chapter 09); tensor-parallel all-reduces, never hidden (ring cost
    from chapter 04); pipeline sends; the pipeline bubble (chapter 07,
    :func:`trainscale.pipeline.bubble`); and data-parallel traffic (the bytes of
    chapter 05's ZeRO stages), which hides under one micro-batch's compute and is
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
      the bytes a layer keeps (Korthikanti et al.'s count, chapter 09);
    * overlap achieved (:data:`OVERLAP`): the share of the data-parallel traffic, and
      of the backward's tensor-parallel collectives, that hides under compute (for a
      published run whose software's code shows it, that share:
      :data:`DOCUMENTED_OVERLAP`);
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
    * gradients in fp32 (``fp32_gradients``, :data:`FP32_GRADIENTS`: Llama 3 accumulates
      and reduce-scatters them in fp32, section 3.3.2): 4 bytes per gradient in memory
      and on the wire;
    * the interleaving depth, searched per layout by :func:`estimate_run`
      (:data:`INTERLEAVING`), with its bubble and its extra activation memory.

    Then ``MFU = 6 N x tokens per step / (step time x GPUs x peak)`` (chapter 12).
    The calibrated model's range (:func:`estimate_run`, :func:`mfu_range`) comes from
    what it admits it does not know: the GEMM share (the two halves of Table 4 read
    apart, :func:`gemm_share`) and how far that share carries to GEMMs of other shapes
    (the tiles' fixed cost between none and the most Table 4 can carry,
    :func:`tile_overhead_range`: narrow at Table 4's shapes, wider away from them),
    :data:`ELEMENTWISE_TRAFFIC`, and :data:`OVERLAP` where no source documents it; the
    fields a run does not publish are searched. Chapter 13 prints it against every published run of
    :func:`trainscale.published.published_runs`.

Placement follows Megatron-LM's rank order: TP ranks are neighbours (inside a
node when ``gpus_per_node`` is a multiple of TP), then DP, then PP. Each link is
charged at the cluster's per-GPU bandwidth of the slowest hop it crosses.

Which layouts are tried: TP over every divisor of the GPU count (it must also
divide the attention heads), CP over the degrees that can help
(:func:`context_parallel_degrees`) that divide what is left, PP over every divisor
of what is left then, DP the rest, and EP over the divisors of the experts that
also divide DP. PP need *not* divide the layers: the fullest stage gets ``ceil(L / PP)``
layers and its pace sets the pipeline's; without interleaving, the first and last
stages, which also hold the embedding and the logits, get one layer fewer when the
layers fall short (as Llama 3 did), which lowers their activation memory. The
micro-batch must divide the sequences of each DP rank; the number
of micro-batches per step is the gradient accumulation.

Sequence parallelism (``sequence_parallel``, Korthikanti et al. section 4.2.2) turns
each tensor-parallel all-reduce into an all-gather and a reduce-scatter that move the
same bytes, so the traffic is priced the same; what it changes is the activation
memory (the ``10 s b h`` outside the split blocks are split too).

Context parallelism (chapter 14, :mod:`trainscale.context`): ``CP`` ranks each hold
``s / CP`` tokens of every sequence, so every activation, GEMM row and pipeline send
shrinks by ``CP``, while each rank's queries still meet all ``s`` keys; the keys and
values travel a ring (:func:`trainscale.context.ring_bytes_per_rank`, Liu et al. 2023),
:data:`OVERLAP` of it hidden under the attention it feeds
(:func:`_context_parallel_seconds`); the DP and CP ranks reduce the gradients
together, as Megatron-core does. Tried by default only where chapter 14's thresholds
say it helps (:func:`context_parallel_degrees`). Expert parallelism (chapter 15,
:mod:`trainscale.experts`): a mixture of experts (:attr:`Model.experts`) spreads its
experts over ``EP`` of the DP ranks, whose all-to-alls
(:func:`trainscale.experts.all_to_all_bytes_per_rank`, four per layer) are charged in
full (:func:`_expert_parallel_seconds`); each GPU holds ``E / EP`` experts, sharded by
ZeRO over the ``DP CP / EP`` ranks that hold the same ones; the local experts run as
one batched GEMM (:func:`_layer_times_at`), and MFU counts the active parameters
(:attr:`Model.active_params`). Both dimensions are searched for every layout by
:func:`plan` (:func:`expert_parallel_degrees`).

What the model leaves out: data loading and kernel launches, latency outside ZeRO-3,
uneven expert loads (routing is taken as even), and memory the estimate does not list
(CUDA context, NCCL buffers, fragmentation, the transient buffers of recomputation), for
which only :data:`USABLE_MEMORY` of each GPU is counted as
available.

Allocator headroom stays that one share, an assumption, not an explicit term: we
found no published figure for how much memory PyTorch's caching allocator loses to
fragmentation in a training run. PyTorch's CUDA memory-management notes describe the
effect qualitatively (reserved but unallocated blocks, ``max_split_size_mb``,
``expandable_segments``), and NVIDIA's Megatron Bridge memory-tuning guide
recommends ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` as the fix for
fragmentation-induced out-of-memory errors, with no figure either. So a layout the
planner puts near :data:`USABLE_MEMORY` of the GPU is one to check on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from trainscale import _checks
from trainscale.checkpointing import (
    ACTIVATION_PARTS,
    RECOMPUTE,
    layer_activation_bytes,
    selective_recompute_flops,
)
from trainscale.collectives import ring_factor
from trainscale.compute import FLOPS_PER_PARAM_PER_TOKEN, PublishedUtilisation, mfu
from trainscale.context import (
    CAUSAL_WORK_SHARE,
    cp_beats_tp_local_tokens,
    cp_hiding_threshold_tokens,
    ring_bytes_per_rank,
)
from trainscale.experts import ALL_TO_ALLS_PER_LAYER, all_to_all_bytes_per_rank
from trainscale.memory import (
    BYTES_PER_PARAM,
    GIB,
    OPTIMIZER_STATE,
    STATE_GROUPS,
    USABLE_MEMORY,
    StateDtypes,
    model_state_groups,
)
from trainscale.pipeline import bubble, bubble_zb_h1
from trainscale.published import GPUS, PublishedRun, published_runs
from trainscale.sharding import ZERO_COLLECTIVES, zero_collective_bytes

__all__ = [  # this module's public names, and those it re-exports for chapter 13
    "A100_NODE",
    "ACTIVATION_PARTS",
    "CALIBRATION_TARGETS",
    "COLLECTIVE_STEP_SECONDS",
    "DEEPSPEED_PIPELINE_SOURCES",
    "DOCUMENTED_OVERLAP",
    "ELEMENTWISE_TRAFFIC",
    "EXAMPLE_CLUSTER",
    "EXAMPLE_GLOBAL_BATCH",
    "EXAMPLE_MODEL",
    "FP32_GRADIENTS",
    "FP32_GRADIENT_SOURCES",
    "FUSED_ATTENTION_SOURCES",
    "FUSED_BACKWARD_PASSES",
    "GEMM_SHARE",
    "H100_NODE",
    "INTERLEAVING",
    "KERNEL_EFFICIENCY",
    "LONG_CONTEXT_MODEL",
    "MAX_BUBBLE",
    "MEMORY_PARTS",
    "MOE_MODEL",
    "NO_DROPOUT_SOURCES",
    "OPTIMISER_STEP_BYTES",
    "OVERLAP",
    "RECOMPUTE",
    "SCHEDULES",
    "TABLE4_GPU",
    "TABLE4_RUN",
    "TABLE4_SECONDS",
    "TILE",
    "TIME_PARTS",
    "USABLE_MEMORY",
    "VERDICTS",
    "Cluster",
    "Layout",
    "Model",
    "PublishedRun",
    "RunEstimate",
    "activation_bytes_per_gpu",
    "calibration_targets",
    "context_parallel_degrees",
    "estimate_run",
    "evaluate",
    "expert_parallel_degrees",
    "gemm_seconds",
    "gemm_share",
    "layer_activation_bytes",
    "mfu_range",
    "model_state_per_gpu",
    "node_settings",
    "plan",
    "published_cluster",
    "published_model",
    "published_runs",
    "reported_mfu",
    "reported_mfu_6n",
    "restated_run",
    "stage_params",
    "table4_seconds",
    "tile_overhead_k",
    "tile_overhead_range",
    "top_layouts",
    "verdict_counts",
]

KERNEL_EFFICIENCY = 0.6
"""The simple cost model's one efficiency: the share of peak FLOP/s that a transformer
layer's kernels sustain together, before any time is lost to communication or
pipeline idling. An assumption, not a measurement; pass ``efficiency=KERNEL_EFFICIENCY``
to use the simple model (the default, ``None``, is the calibrated roofline)."""

MAX_BUBBLE = 0.25
"""A pipeline that idles more than this share of the step is flagged."""

VERDICTS = ("fits", "TP across nodes", "bubble too large", "out of memory", "invalid")
"""Every verdict a layout can get. A layout with several problems gets the
first of ``invalid``, ``out of memory``, ``TP across nodes``, ``bubble too large``;
:attr:`Layout.problems` lists them all."""

_SEVERITY = ("invalid", "out of memory", "TP across nodes", "bubble too large")

TIME_PARTS = (
    "compute",
    "recomputation",
    "tensor-parallel traffic",
    "context-parallel traffic",
    "expert-parallel traffic",
    "pipeline sends",
    "data-parallel traffic",
    "optimiser step",
    "pipeline bubble",
)
"""The terms of :attr:`Layout.times`, which add up to the step time."""

MEMORY_PARTS = (*STATE_GROUPS, "activations")
"""The terms of :attr:`Layout.memory_parts`, which add up to the memory per GPU."""


def _recompute(name: str, value: object) -> str:
    return str(_checks.choice(name, value, RECOMPUTE))


@dataclass(frozen=True)
class Model:
    """A dense GPT-style transformer as the planner sees it.

    The roofline step time (:func:`gemm_seconds`) also reads the layer's shape:
    ``kv_heads`` (grouped-query attention; ``None``: as many as ``heads``),
    ``ffn_hidden`` (``None``: ``4 hidden``), ``gated_mlp`` (SwiGLU: two input
    matrices) and ``fused_attention`` (a FlashAttention-style kernel, Dao et al.
    2022, arXiv 2205.14135: the ``s x s`` scores never reach GPU memory); the
    activation memory reads the same fields and ``dropout`` (``False``: no dropout
    masks are kept), through :func:`trainscale.checkpointing.layer_activation_bytes`.

    A mixture of experts (chapter 15): ``experts`` MLPs of width ``expert_ffn_hidden``
    (``None``: ``ffn_hidden``) in every layer, ``top_k`` of them per token; ``params``
    counts them all, :attr:`active_params` what one token uses. Its activations are
    counted as a dense MLP ``top_k`` experts wide (each token's copies pass through
    ``top_k`` experts); the router's scores are left out.

    ``params`` is the total parameter count (embeddings included), ``vocab`` the
    vocabulary size. The input embedding (``vocab x hidden``) lands on the first
    pipeline stage and the output layer (another ``vocab x hidden``, or a copy of
    the embedding when ``tied_embeddings``) on the last; the remaining parameters
    are shared equally by the ``layers`` transformer layers.
    """

    params: int
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    tied_embeddings: bool = False
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    gated_mlp: bool = False
    fused_attention: bool = True
    dropout: bool = True
    experts: int | None = None
    top_k: int = 1
    expert_ffn_hidden: int | None = None

    def __post_init__(self) -> None:
        for name in ("params", "layers", "hidden", "heads", "seq_len", "vocab", "top_k"):
            object.__setattr__(self, name, _checks.count(name, getattr(self, name), minimum=1))
        for name in ("kv_heads", "ffn_hidden", "experts", "expert_ffn_hidden"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _checks.count(name, getattr(self, name), minimum=1))
        for name in ("tied_embeddings", "gated_mlp", "fused_attention", "dropout"):
            _checks.boolean(name, getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden must be a multiple of heads ({self.heads}), got {self.hidden}"
            )
        if self.experts is not None and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be in [1, experts = {self.experts}], got {self.top_k}")
        fixed = self.embedding_params + self.layers * self.expert_params_per_layer
        if self.params <= fixed:
            raise ValueError(
                f"params must exceed the {fixed:,} parameters of the embedding, output "
                f"and expert layers, got {self.params:,}"
            )

    @property
    def expert_width(self) -> int:
        """Hidden width of one expert's MLP: ``expert_ffn_hidden``, else the dense MLP's."""
        return self.expert_ffn_hidden or self.ffn_hidden or 4 * self.hidden

    @property
    def expert_params_per_layer(self) -> int:
        """Parameters of one layer's experts, ``E x matrices x hidden x expert width``
        (3 matrices when gated, as SwiGLU experts; 2 otherwise); 0 for a dense model."""
        if self.experts is None:
            return 0
        matrices = 3 if self.gated_mlp else 2
        return self.experts * matrices * self.hidden * self.expert_width

    @property
    def active_params(self) -> int:
        """Parameters a token goes through: all of them for a dense model; for a mixture
        of experts only ``top_k`` of the ``experts`` of each layer (the ``N`` of the
        ``6 N`` FLOPs per token, chapter 01, and of MFU)."""
        if self.experts is None:
            return self.params
        unused = self.expert_params_per_layer // self.experts * (self.experts - self.top_k)
        return self.params - self.layers * unused

    @property
    def layer_shape(self) -> dict[str, object]:
        """The keyword arguments of :func:`trainscale.checkpointing.layer_activation_bytes`
        that describe this model's layer (grouped-query attention, MLP width and gating,
        fused attention, dropout)."""
        ffn = self.ffn_hidden if self.experts is None else self.top_k * self.expert_width
        return {
            "kv_heads": self.kv_heads,
            "ffn_hidden": ffn,
            "gated_mlp": self.gated_mlp,
            "fused_attention": self.fused_attention,
            "dropout": self.dropout,
        }

    @property
    def embedding_params(self) -> int:
        """Parameters of the input embedding and output layer (counted once if tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def layer_params(self) -> float:
        """Parameters of one transformer layer: what the embeddings leave, shared equally."""
        return (self.params - self.embedding_params) / self.layers


@dataclass(frozen=True)
class Cluster:
    """GPUs and links: ``nodes`` machines of ``gpus_per_node`` GPUs each.

    ``memory_bytes`` and ``peak_flops`` are per GPU (bytes, dense bf16 FLOP/s);
    the bandwidths are what one GPU can send per second in one direction, inside
    a node (``intra_node_bandwidth``, e.g. NVLink) and to another node
    (``inter_node_bandwidth``, e.g. its InfiniBand card). ``memory_bandwidth`` is
    the GPU's HBM bandwidth in bytes/s, ``multiprocessors`` its SMs and
    ``max_matmul_share`` the fastest bf16 GEMM measured on it as a share of its peak
    (:attr:`trainscale.published.Gpu.max_matmul_share`; ``None``: not measured), which
    the roofline step time needs (defaults: an H100 SXM's 3.35e12, 132 and 794.5 / 989).
    """

    nodes: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    memory_bandwidth: float = 3.35e12
    multiprocessors: int = 132
    max_matmul_share: float | None = 794.5 / 989

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            object.__setattr__(self, name, _checks.count(name, getattr(self, name), minimum=1))
        names = ("memory_bytes", "peak_flops", "intra_node_bandwidth", "inter_node_bandwidth")
        for name in (*names, "memory_bandwidth"):
            object.__setattr__(self, name, _checks.positive(name, getattr(self, name)))
        sms = _checks.count("multiprocessors", self.multiprocessors, minimum=1)
        object.__setattr__(self, "multiprocessors", sms)
        if self.max_matmul_share is not None:
            share = _checks.positive("max_matmul_share", self.max_matmul_share, maximum=1.0)
            object.__setattr__(self, "max_matmul_share", share)

    @property
    def gpus(self) -> int:
        """GPUs in the whole cluster."""
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Layout:
    """One candidate layout and what the planner estimates for it.

    ``memory_parts`` (bytes on one GPU of the fullest stage, keys :data:`MEMORY_PARTS`)
    and ``times`` (seconds per step, keys :data:`TIME_PARTS`) add up to
    ``memory_bytes`` and ``step_seconds``. ``bubble`` is the pipeline's idle share
    of the step. For an ``invalid`` layout the numbers are ``nan`` and
    ``accumulation`` is ``None``; ``notes`` says what is wrong. ``cp`` is the
    context-parallel degree (GPUs that share each sequence) and ``ep`` the
    expert-parallel one (DP ranks that share a mixture of experts' experts).
    """

    tp: int
    pp: int
    dp: int
    zero_stage: int
    recompute: str
    micro_batch: int
    global_batch: int
    accumulation: int | None
    memory_parts: Mapping[str, float] = field(repr=False)
    memory_bytes: float
    times: Mapping[str, float] = field(repr=False)
    step_seconds: float
    mfu: float
    bubble: float
    verdict: str
    problems: tuple[str, ...]
    notes: tuple[str, ...] = field(repr=False)
    virtual_stages: int = 1
    sequence_parallel: bool = True
    cp: int = 1
    ep: int = 1

    @property
    def gpus(self) -> int:
        """GPUs the layout uses: ``TP x CP x PP x DP`` (expert parallelism reuses DP's)."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(TP, PP, DP)`` (for a given GPU count it also fixes CP)."""
        return (self.tp, self.pp, self.dp)

    @property
    def effective_batch(self) -> int | None:
        """Sequences per optimiser step: micro-batch x accumulation steps x DP."""
        if self.accumulation is None:
            return None
        return self.micro_batch * self.accumulation * self.dp

    @property
    def name(self) -> str:
        """``"TP 8 x PP 4 x DP 2"``, with ``CP n`` after TP when the sequence is split."""
        cp = f"CP {self.cp} \u00d7 " if self.cp > 1 else ""
        return f"TP {self.tp} \u00d7 {cp}PP {self.pp} \u00d7 DP {self.dp}"

    @property
    def settings(self) -> str:
        """``"ZeRO-1, selective recompute, micro-batch 1"`` (``", EP 8"`` added when the
        experts are spread over 8 of the DP ranks)."""
        recompute = "no recompute" if self.recompute == "none" else f"{self.recompute} recompute"
        experts = f", EP {self.ep}" if self.ep > 1 else ""
        return f"ZeRO-{self.zero_stage}, {recompute}, micro-batch {self.micro_batch}{experts}"


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
    if p * v > model.layers + 2:
        raise ValueError(
            f"pp x virtual_stages must be <= layers + 2 ({model.layers + 2}), got {p * v}"
        )
    return -(-_stage(model, p, v)[3] // t)


def model_state_per_gpu(
    model: Model, tp: int, pp: int, dp: int, zero_stage: int, virtual_stages: int = 1
) -> dict[str, int]:
    """Bytes of weights, gradients and optimiser state on one GPU of the fullest stage.

    The stage's parameters are divided over TP (:func:`stage_params`), then ZeRO
    shards them over DP with :func:`trainscale.memory.model_state_groups`.
    """
    per_gpu = stage_params(model, tp, pp, virtual_stages)
    return dict(_state(per_gpu, _checks.count("dp", dp, minimum=1), zero_stage))


FP32_GRADIENTS = StateDtypes(gradients=torch.float32)
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
) -> float:
    """Activation bytes on the fullest pipeline stage (see :func:`activation_bytes_per_gpu`)."""
    s, h, a, vocab = model.seq_len // c, model.hidden, model.heads, model.vocab
    per_layer = layer_activation_bytes(s, b, h, a, t, sp, mode, **model.layer_shape)
    t_sp = t if sp else 1
    embedding = s * b * h / t_sp if model.dropout else 0.0  # 1-byte dropout mask
    output = 4 * s * b * h / t_sp + 4 * s * b * vocab / t  # final norm, output input, fp32 logits
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
    the output layer's input and the fp32 logits the loss needs (``4 s b vocab / t``).
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
    if p * v > model.layers + 2:
        raise ValueError(
            f"pp x virtual_stages must be <= layers + 2 ({model.layers + 2}), got {p * v}"
        )
    c = _checks.count("context_parallel", context_parallel, minimum=1)
    if model.seq_len % c:
        raise ValueError(
            f"context_parallel must divide seq_len ({model.seq_len}), got {context_parallel}"
        )
    return _activations(model, t, p, b, m, mode, sp, v, c)


@dataclass(frozen=True)
class _Options:
    sequence_parallel: bool
    virtual_stages: int
    efficiency: float | None
    usable_memory: float
    max_bubble: float
    band: str = "point"
    schedule: str = "1f1b"
    fp32_gradients: bool = False
    overlap_data: float | None = None  # documented by the run's software, else the band's
    overlap_tensor: float | None = None
    overhead: float = 1.0  # the tiles' fixed cost, x tile_overhead_k (tile_overhead_range)


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

ELEMENTWISE_TRAFFIC = {"low": 4.0, "point": 3.0, "high": 2.0}
"""Bytes the element-wise kernels (norms, softmax, dropout, GeLU, residual adds) move
per byte of activation a layer keeps for backward, over forward and backward
together, by band (pessimistic ``low``). Derivation: each kept activation is written
once forward and read once backward (2); the backward writes a gradient of each and
reads inputs it did not keep (up to 2 more)."""

OVERLAP = {"low": 0.0, "point": 0.5, "high": 1.0}
"""Share of the communication that *can* hide under compute that does hide, by band
(where a run's software documents it, :data:`DOCUMENTED_OVERLAP` replaces the band):
data-parallel traffic under the backward (and ZeRO-3's gathers under the forward),
and the backward's tensor-parallel collectives under the weight-gradient GEMMs
(Korthikanti et al. section 6.2 overlap them; their Table 5 runs do not overlap the
data-parallel all-reduce). The other source of :func:`estimate_run`'s range."""


SCHEDULES = ("1f1b", "zb-h1")
"""Pipeline schedules the planner prices: 1F1B (interleaved when ``virtual_stages`` > 1;
bubble :func:`trainscale.pipeline.bubble`) and Qi et al.'s zero-bubble ZB-H1 (arXiv
2401.10241; bubble :func:`trainscale.pipeline.bubble_zb_h1`, the weight-gradient pass
taken as half of the backward: its GEMMs are half of the backward's), which keeps
1F1B's activation memory and needs ``m >= p`` micro-batches and no interleaving."""

TILE = (256, 128)
"""Output tile of one thread block in a large cuBLAS bf16 GEMM, rows x columns (NVIDIA's
"Matrix Multiplication Background" user's guide, section 2.3, lists 256 x 128 as the
most efficient of its typical tiles)."""


def tile_overhead_k(share: float, peak_flops: float, bandwidth: float) -> float:
    """A tile's fixed cost, first order, in steps of its main loop counted in units of ``k``.

    After its last multiply a tile writes its ``2 x 256 x 128`` bytes of 16-bit output
    at its SM's share of the memory bandwidth; its main loop does ``2 x 256 x 128``
    FLOPs per unit of ``k`` at its SM's share of ``share x peak_flops``. Both shares are
    the SM's, so the write lasts ``share x peak_flops / bandwidth`` units of ``k``: the
    machine's balance point, FLOPs per byte (2 bytes per output element, 2 FLOPs per
    multiply-add). About 103 on an A100 at the central share, 0.67. So a GEMM whose
    ``k`` is short (tensor parallelism cuts the output projection's ``k`` to ``h / TP``)
    runs further below its share than a wide one. Not counted: the wait for the first
    slice of A and B before the first multiply (CUTLASS's multistage main loop waits for
    one stage, one memory latency). A second tile resident on the SM, or a persistent
    kernel, hides the output write (CUTLASS's "Efficient GEMM" notes: Hopper's
    persistent ping-pong kernel overlaps one warp group's output with the other's math);
    :func:`tile_overhead_range` gives the span the range allows.
    """
    rate = _checks.positive("share", share, maximum=1.0) * _checks.positive(
        "peak_flops", peak_flops
    )
    return rate / _checks.positive("bandwidth", bandwidth)


def gemm_seconds(
    m: float,
    k: float,
    n: float,
    peak_flops: float,
    bandwidth: float,
    share: float,
    batch: float = 1,
    multiprocessors: int = 132,
    tile_overhead: float = 1.0,
) -> float:
    """Time in seconds of ``batch`` bf16 GEMMs ``(m x k) @ (k x n)``, launched as one kernel.

    Compute: the output is cut into :data:`TILE` tiles, one per thread block, and the
    ``multiprocessors`` SMs run them in waves; a partly filled last wave takes as long
    as a full one (wave quantisation, section 3.2 of NVIDIA's "Matrix Multiplication
    Background" user's guide). Each wave does ``multiprocessors x 2 x 256 x 128 x k``
    FLOPs at ``share x peak_flops``, and each of its tiles also pays a fixed cost worth
    ``tile_overhead x`` :func:`tile_overhead_k` more of ``k`` (writing its output;
    ``tile_overhead`` 0 when something hides it). Memory: the 16-bit
    operands and results, ``2 (m k + k n + m n)`` bytes per GEMM, at ``bandwidth``. The
    kernel takes the longer of the two (the roofline of Williams et al. 2009). So a
    GEMM's efficiency is a function of its shape: one with a short side (attention's
    ``Q K^T`` has the head dimension, 128) has few FLOPs per byte, one with few tiles
    wastes most of its last wave, and one with a short ``k`` spends a larger share of each
    tile's time on the tile's fixed cost.
    """
    for name, value in (("m", m), ("k", k), ("n", n), ("batch", batch)):
        _checks.positive(name, value)
    peak = _checks.positive("peak_flops", peak_flops)
    bw = _checks.positive("bandwidth", bandwidth)
    rate = peak * _checks.positive("share", share, maximum=1.0)
    sms = _checks.count("multiprocessors", multiprocessors, minimum=1)
    overhead = _checks.non_negative("tile_overhead", tile_overhead)
    rows, cols = TILE
    tiles = math.ceil(m / rows) * math.ceil(n / cols) * math.ceil(batch)
    depth = k + overhead * tile_overhead_k(share, peak, bw)
    compute = math.ceil(tiles / sms) * sms * 2 * rows * cols * depth / rate
    return max(compute, batch * 2 * (m * k + k * n + m * n) / bw)


def _layer_times(
    model: Model,
    cluster: Cluster,
    t: int,
    b: int,
    sp: bool,
    band: str,
    c: int = 1,
    ep: int = 1,
    overhead: float = 1.0,
) -> tuple[float, float, float]:
    """:func:`_layer_times_at` with the ``band`` of :func:`gemm_share` (at the tile
    ``overhead``) and of :data:`ELEMENTWISE_TRAFFIC`."""
    share = _gemm_share_on(cluster, band, overhead)
    traffic = ELEMENTWISE_TRAFFIC[band]
    return _layer_times_at(model, cluster, t, b, sp, share, traffic, c, ep, overhead)


def _gemm_share_on(cluster: Cluster, band: str, overhead: float) -> float:
    """:func:`gemm_share`, read off A100s, on the ``cluster``'s GPU: scaled by the ratio
    of the two GPUs' fastest measured GEMMs (``max_matmul_share``: 0.803 / 0.869 for an
    H100), as is where the GPU's was not measured."""
    reference = GPUS[TABLE4_GPU].max_matmul_share
    scale = 1.0 if cluster.max_matmul_share is None else cluster.max_matmul_share / reference
    return gemm_share(overhead)[band] * scale


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
) -> tuple[float, float, float]:
    """Seconds of one layer on one GPU: ``(forward, its attention-score part, backward)``.

    The layer's GEMMs, split over TP as Megatron-LM splits them, each at its roofline
    (:func:`gemm_seconds`): the QKV projection (``kv_heads`` key/value heads), the
    output projection, the MLP's input (two matrices if gated) and output matrices, and
    per head ``Q K^T`` and the product with ``V`` (at the compute roof with a fused
    attention kernel, whose scores stay on chip and which skips the key blocks the
    causal mask hides, :func:`_fused_attention_seconds`). Backward, each GEMM's two
    gradient GEMMs at their own shapes (:func:`_forward_and_backward`); a fused
    attention kernel's :data:`FUSED_BACKWARD_PASSES` times its forward. Plus the
    element-wise kernels: ``traffic`` (:data:`ELEMENTWISE_TRAFFIC`) x the bytes the
    layer keeps (:func:`trainscale.checkpointing.layer_activation_bytes`, without the
    ``5 a s^2 b`` scores when attention is fused) at the memory bandwidth, a third of it
    forward, two thirds backward. ``share`` and ``overhead`` go to :func:`gemm_seconds`.

    With context parallelism over ``c`` ranks a GPU holds ``s / c`` tokens and their
    queries meet all ``s`` keys (ring attention, chapter 14). A mixture of experts
    replaces the MLP by its router (``h x E``) and the ``E / ep`` local experts, run as
    one batched GEMM of ``b s k ep / (c E)`` rows each (even routing, chapter 15).
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
    passes = [_forward_and_backward(gemm, m, k, n, batch) for m, k, n, batch in shapes]
    dense, dense_back = sum(f for f, _ in passes), sum(g for _, g in passes)
    pairs = b * a / t  # (sequence, head) pairs on this GPU
    shape = model.layer_shape
    kept = layer_activation_bytes(s // c, b, h, a, t, sp, "none", **shape)
    if model.fused_attention:
        scores, scores_back = _fused_attention_seconds(pairs, s / c, s, d, peak * share)
        score_bytes = 0.0
    else:  # Q K^T, then the probabilities times V
        qk = _forward_and_backward(gemm, s, d, s, pairs)
        pv = _forward_and_backward(gemm, s, s, d, pairs)
        scores, scores_back = qk[0] + pv[0], qk[1] + pv[1]
        score_bytes = kept - layer_activation_bytes(s // c, b, h, a, t, sp, "selective", **shape)
    per_byte = traffic / 3 / bw
    forward = dense + scores + kept * per_byte
    backward = dense_back + scores_back + 2 * kept * per_byte
    return forward, scores + score_bytes * per_byte, backward


def _tensor_collective_seconds(s: float, b: int, h: int, t: int, link: float) -> float:
    """One tensor-parallel all-reduce of a layer's ``s x b x h`` 16-bit activations over
    ``t`` GPUs: ring cost (:func:`trainscale.collectives.ring_factor`) at ``link`` B/s."""
    return ring_factor(t) * 2 * s * b * h / link


def table4_seconds(share: float, overhead: float = 1.0) -> dict[str, float]:
    """The roofline's time of :data:`TABLE4_SECONDS`'s layer at GEMM ``share``, in
    seconds: forward (the layer, :func:`_layer_times_at`, plus its two synchronous
    tensor-parallel all-reduces) and backward (the layer's gradient GEMMs at their own
    shapes; the run's software overlapped the backward's two all-reduces with the
    weight-gradient GEMMs, :data:`DOCUMENTED_OVERLAP`), element-wise traffic at its
    central :data:`ELEMENTWISE_TRAFFIC`."""
    share = _checks.positive("share", share, maximum=1.0)
    overhead = _checks.non_negative("overhead", overhead)
    run = next(r for r in published_runs() if r.name == TABLE4_RUN)
    model, cluster = published_model(run), published_cluster(run)
    s, b, h, t = model.seq_len, run.micro_batch, model.hidden, run.tp
    traffic = ELEMENTWISE_TRAFFIC["point"]
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
def gemm_share(overhead: float = 1.0) -> dict[str, float]:
    """The share of peak a compute-bound GEMM's main loop sustains, by band, read off
    Korthikanti et al.'s Table 4 (:data:`TABLE4_SECONDS`) with the tiles' fixed cost at
    ``overhead`` x :func:`tile_overhead_k`: ``low``, the share at which the roofline
    reproduces the measured forward (:func:`table4_seconds`); ``point``, forward plus
    backward; ``high``, the backward. An effective share: it also carries whatever the
    measured layer spends that the roofline does not count. The two halves disagree
    less as the tile cost grows (the forward's GEMMs have shorter ``k`` than the
    backward's weight gradients), and agree at :func:`tile_overhead_range`'s upper end.
    Not fitted to the published runs; one of the sources of :func:`estimate_run`'s range.
    """
    scale = _checks.non_negative("overhead", overhead)
    measured = TABLE4_SECONDS
    targets = {
        "low": lambda share: table4_seconds(share, scale)["forward"] - measured["forward"],
        "point": lambda share: sum(table4_seconds(share, scale).values()) - sum(measured.values()),
        "high": lambda share: table4_seconds(share, scale)["backward"] - measured["backward"],
    }
    shares = {}
    for band, excess in targets.items():  # time falls as the share rises
        if excess(1.0) > 0:
            raise ValueError(
                f"overhead must leave Table 4's layer slower than the roofline at full peak "
                f"(up to about 8), got {overhead}"
            )
        shares[band] = round(_bisect(excess, 0.05, 1.0), 4)
    return shares


@functools.cache
def tile_overhead_range() -> tuple[float, float]:
    """How much of the tiles' fixed cost (:func:`tile_overhead_k`) a GEMM pays at the two
    ends of :func:`estimate_run`'s range, in multiples of that first-order count (1 in
    the central estimate): none (a co-resident tile or a persistent kernel hides it),
    and the most Korthikanti et al.'s Table 4 can carry: the multiple at which one
    share reproduces both its forward and its backward (:func:`gemm_share`'s ``low`` and
    ``high`` meet), so all of their disagreement is put down to the tiles' fixed cost.
    Each end reads its own share off Table 4, so the band is narrow at Table 4's shapes
    and widens with the distance from them."""
    gap = lambda overhead: gemm_share(overhead)["high"] - gemm_share(overhead)["low"]  # noqa: E731
    return 0.0, round(_bisect(gap, 0.0, 8.0, steps=16), 2)


def _roofline(
    model,
    cluster,
    t,
    b,
    layers,
    mode,
    sp,
    band,
    ends_short: int = 0,
    c: int = 1,
    ep: int = 1,
    overhead: float = 1.0,
) -> tuple[float, float, float]:
    """Forward, backward and recomputation seconds of one micro-batch on the slowest stage.

    ``layers`` layers (:func:`_layer_times`) on a middle stage; the last stage has
    ``layers - 1`` of them when ``ends_short`` is 2 (the layers fall two short of the
    stages' slots, and the output layer takes one, as Llama 3 balanced its pipeline),
    plus the output layer's GEMM and its fp32 logits (``4 s b V / t`` bytes); the
    pipeline runs at the pace of the slower of the two, forward, backward and
    recomputation together. Backward: the layers' (:func:`_layer_times`: each GEMM's two
    gradient GEMMs at their own shapes) and the output layer's. Full recomputation
    repeats the forward of the stage's layers, selective the score part (nothing more
    with a fused kernel, whose backward already does).
    """
    layer, score, layer_back = _layer_times(model, cluster, t, b, sp, band, c, ep, overhead)
    rows, share = b * model.seq_len / c, _gemm_share_on(cluster, band, overhead)
    bw = cluster.memory_bandwidth
    gemm = functools.partial(
        gemm_seconds,
        peak_flops=cluster.peak_flops,
        bandwidth=bw,
        share=share,
        multiprocessors=cluster.multiprocessors,
        tile_overhead=overhead,
    )
    head, head_back = _forward_and_backward(gemm, rows, model.hidden, model.vocab / t)
    logits = 4 * rows * model.vocab / t * ELEMENTWISE_TRAFFIC[band] / 3 / bw
    head, head_back = head + logits, head_back + 2 * logits
    last_layers = layers - (ends_short >= 2)

    def stage(count: int, head: float, head_back: float) -> tuple[float, float, float]:
        selective = 0.0 if model.fused_attention else count * score
        recompute = {"full": count * layer, "selective": selective, "none": 0.0}[mode]
        return count * layer + head, count * layer_back + head_back, recompute

    middle, last = stage(layers, 0.0, 0.0), stage(last_layers, head, head_back)
    return max(middle, last, key=sum)  # the slower stage sets the pace


def _options(
    sequence_parallel: object,
    virtual_stages: object,
    efficiency: object,
    usable_memory: object,
    max_bubble: object,
    band: str = "point",
    schedule: object = "1f1b",
    fp32_gradients: object = False,
    overlap: tuple[float | None, float | None] = (None, None),
    overhead: float = 1.0,
) -> _Options:
    """Checked options; ``overlap`` the ``(data, tensor)`` shares a run's software
    documents (``None``: the band's), ``overhead`` the tiles' fixed cost's multiple."""
    return _Options(
        sequence_parallel=_checks.boolean("sequence_parallel", sequence_parallel),
        virtual_stages=_checks.count("virtual_stages", virtual_stages, minimum=1),
        efficiency=None
        if efficiency is None
        else _checks.positive("efficiency", efficiency, maximum=1.0),
        usable_memory=_checks.positive("usable_memory", usable_memory, maximum=1.0),
        max_bubble=_checks.fraction("max_bubble", max_bubble),
        band=str(_checks.choice("band", band, tuple(OVERLAP))),
        schedule=str(_checks.choice("schedule", schedule, SCHEDULES)),
        fp32_gradients=_checks.boolean("fp32_gradients", fp32_gradients),
        overlap_data=overlap[0],
        overlap_tensor=overlap[1],
        overhead=overhead,
    )


def _invalid(t, p, d, zero, mode, b, batch, problems, notes, c=1, ep=1) -> Layout:
    nan = math.nan
    return Layout(
        tp=t,
        pp=p,
        dp=d,
        zero_stage=zero,
        recompute=mode,
        micro_batch=b,
        global_batch=batch,
        accumulation=None,
        memory_parts=dict.fromkeys(MEMORY_PARTS, nan),
        memory_bytes=nan,
        times=dict.fromkeys(TIME_PARTS, nan),
        step_seconds=nan,
        mfu=nan,
        bubble=nan,
        verdict="invalid",
        problems=tuple(problems),
        notes=tuple(notes),
        cp=c,
        ep=ep,
    )


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

COLLECTIVE_STEP_SECONDS = 5e-6
"""Latency of one step of a ring collective between nodes, in seconds (an assumption:
NCCL's per-hop latency over InfiniBand is a few microseconds). A ring over ``n`` GPUs
takes ``n - 1`` steps, so it matters only where collectives are many and small."""


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
    state = dict(_state(dense_gpu, d * c, zero, fp32))
    if not experts:
        return state, dense_gpu
    expert_gpu = -(-experts // (t * ep))
    group = d * c // ep
    for key, value in _state(expert_gpu, group, zero, fp32):
        state[key] += value
    ring, expert_ring = (d * c - 1) / (d * c), (group - 1) / group
    return state, dense_gpu + math.ceil(expert_gpu * expert_ring / ring if ring else 0)


def _parallel_notes(model: Model, t: int, d: int, c: int, ep: int, sp: bool) -> list[str]:
    """Why a context- or expert-parallel degree cannot be used, if it cannot.

    Megatron-core's rules: EP must divide the experts and DP, and EP with TP needs
    sequence parallelism ("When using expert parallelism and tensor parallelism,
    sequence parallelism must be used", ``TransformerConfig``)."""
    notes = []
    if ep > 1 and t > 1 and not sp:
        notes.append(f"EP {ep} with TP {t} needs sequence parallelism")
    if c > 1 and not model.fused_attention:
        notes.append(f"CP {c} needs a fused (ring) attention kernel")
    if model.seq_len % (2 * c):
        notes.append(f"CP {c} does not split the {model.seq_len} tokens into {2 * c} chunks")
    if ep > 1 and (model.experts is None or model.experts % ep):
        notes.append(f"EP {ep} does not divide the model's experts ({model.experts})")
    if d % ep:
        notes.append(f"EP {ep} does not divide DP {d}")
    return notes


def _evaluate(
    model: Model,
    cluster: Cluster,
    batch: int,
    t: int,
    p: int,
    d: int,
    zero: int,
    mode: str,
    b: int,
    opt: _Options,
    c: int = 1,
    ep: int = 1,
) -> Layout:
    v = opt.virtual_stages if p > 1 else 1  # without a pipeline there is nothing to interleave
    notes = _parallel_notes(model, t, d, c, ep, opt.sequence_parallel) if c > 1 or ep > 1 else []
    if model.heads % t:
        notes.append(f"TP {t} does not divide the {model.heads} attention heads")
    if p * v > model.layers + 2:  # the embedding and the output layer may fill one each
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
            return _invalid(
                t,
                p,
                d,
                zero,
                mode,
                b,
                batch,
                ["invalid", "TP across nodes"],
                [*notes, across],
                c,
                ep,
            )
        return _invalid(t, p, d, zero, mode, b, batch, ["invalid"], notes, c, ep)

    m = batch // (d * b)
    s, h, gpn = model.seq_len, model.hidden, cluster.gpus_per_node
    intra, inter = cluster.intra_node_bandwidth, cluster.inter_node_bandwidth

    # Memory on the fullest stage.
    _, per_stage, imbalance, stage_total = _stage(model, p, v)
    state, per_gpu = _model_state(
        model, per_stage, stage_total, t, d, c, ep, zero, opt.fp32_gradients
    )
    dp_ranks = d * c  # the ranks that hold the same dense parameters
    grad_bytes = 4 if opt.fp32_gradients else 2
    activations = _activations(model, t, p, b, m, mode, opt.sequence_parallel, v, c)
    memory_parts = {**state, "activations": activations}
    memory = sum(memory_parts.values())

    # Compute of one micro-batch on the slowest stage: at the roofline of each
    # kernel (efficiency=None), or 6N FLOPs at one achievable FLOP rate.
    if opt.efficiency is None:
        short = -(-model.layers // (p * v)) * p * v - model.layers if p > 1 else 0
        sp, band, overhead = opt.sequence_parallel, opt.band, opt.overhead
        forward, backward, recompute = _roofline(
            model, cluster, t, b, per_stage, mode, sp, band, short, c, ep, overhead
        )
        compute = forward + backward
        attention = _layer_times(model, cluster, t, b, sp, band, c, ep, overhead)[1]
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
    overlap = 1.0 if opt.efficiency is not None else OVERLAP[opt.band]
    tensor_overlap = overlap if opt.overlap_tensor is None else opt.overlap_tensor
    data_overlap = overlap if opt.overlap_data is None else opt.overlap_data

    # Tensor parallelism: 2 all-reduces forward, 2 backward (and 2 more when the
    # forward is recomputed), of s x b x h 16-bit values, per layer and micro-batch.
    tp_link = inter if tp_across else intra
    collectives = 6 if mode == "full" else 4
    tensor = per_stage * collectives * _tensor_collective_seconds(s, b, h, t, tp_link)
    if opt.efficiency is None:  # the backward's two hide under weight-gradient GEMMs
        tensor -= tensor_overlap * min(tensor * 2 / collectives, backward / 2)

    # Context and expert parallelism: ring attention's keys and values, the MoE
    # all-to-alls. Megatron's rank order TP, CP, DP (EP inside DP), PP.
    cp_link = intra if gpn % (t * c) == 0 else inter
    ep_link = intra if gpn % (t * c * ep) == 0 else inter
    context = _context_parallel_seconds(
        model, t, b, c, per_stage, mode, cp_link, attention, overlap
    )
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


def _check_inputs(model: object, cluster: object, global_batch: object) -> int:
    if not isinstance(model, Model):
        raise ValueError(f"model must be a planner.Model, got {type(model).__name__}")
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a planner.Cluster, got {type(cluster).__name__}")
    return _checks.count("global_batch", global_batch, minimum=1)


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
    fp32_gradients: bool = False,
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
    of its time (chapter 07): ``(pp - 1) / virtual_stages`` micro-batch slots; with
    ``schedule="zb-h1"`` (:data:`SCHEDULES`) :func:`trainscale.pipeline.bubble_zb_h1`.
    The verdict is ``out of memory`` beyond ``usable_memory`` of the GPU, ``TP across nodes``
    when a TP group spans nodes, ``bubble too large`` beyond ``max_bubble``, and
    ``invalid`` when TP does not divide the heads, the chunks outnumber the layers,
    or DP and the micro-batch do not divide the batch.
    """
    batch = _check_inputs(model, cluster, global_batch)
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
        "point",
        schedule,
        fp32_gradients,
    )
    return _evaluate(model, cluster, batch, t, p, d, zero, mode, b, opt, c, ep)


def _subset(name: str, values: object, convert, allowed: str) -> tuple:
    """The distinct values of a non-empty sequence, each checked by ``convert``."""
    if isinstance(values, str | bytes) or not isinstance(values, Iterable):
        raise ValueError(f"{name} must be a non-empty sequence of {allowed}, got {values!r}")
    chosen = tuple(dict.fromkeys(convert(name, value) for value in values))
    if not chosen:
        raise ValueError(f"{name} must be a non-empty sequence of {allowed}, got {values!r}")
    return chosen


def _micro(name: str, value: object) -> int:
    return _checks.count(name, value, minimum=1)


def _zero(name: str, value: object) -> int:
    return int(_checks.choice(name, value, (0, 1, 2, 3)))  # type: ignore[call-overload]


def _divisors(n: int) -> list[int]:
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return sorted({*small, *(n // k for k in small)})


def _sort_key(layout: Layout) -> tuple:
    step = layout.step_seconds if not math.isnan(layout.step_seconds) else math.inf
    memory = layout.memory_bytes if not math.isnan(layout.memory_bytes) else math.inf
    return (
        layout.verdict != "fits",
        step,
        memory,
        layout.shape,
        layout.zero_stage,
        RECOMPUTE.index(layout.recompute),
        layout.micro_batch,
    )


def plan(
    model: Model,
    cluster: Cluster,
    global_batch: int,
    *,
    micro_batches: Sequence[int] = (1, 2, 4, 8),
    zero_stages: Sequence[int] = (0, 1, 2, 3),
    recompute: Sequence[str] = RECOMPUTE,
    sequence_parallel: bool = True,
    virtual_stages: int = 1,
    efficiency: float | None = None,
    usable_memory: float = USABLE_MEMORY,
    max_bubble: float = MAX_BUBBLE,
    schedule: str = "1f1b",
    fp32_gradients: bool = False,
    context_parallel: Sequence[int] | None = None,
    expert_parallel: Sequence[int] | None = None,
) -> list[Layout]:
    """Every layout of ``cluster.gpus`` GPUs, estimated and ranked.

    ``context_parallel`` and ``expert_parallel`` are the CP and EP degrees to try;
    ``None`` tries those that can help (:func:`context_parallel_degrees`,
    :func:`expert_parallel_degrees`): for a dense model with short sequences only 1.

    TP runs over every divisor of the GPU count, CP over the degrees given that
    divide what TP leaves, PP over every divisor of what TP and CP leave, DP takes
    the rest, so ``TP x CP x PP x DP`` always equals the GPU count; each shape is
    tried with every EP degree given that divides DP, every ZeRO stage,
    recomputation mode and micro-batch size given. Pipeline stages need not divide
    the layers evenly (see :func:`stage_params`). Layouts that break a rule are kept
    with the verdict ``invalid`` so a reader can see why they were rejected.

    Ranked: layouts that fit without any problem first, fastest estimated step
    first, ties going to less memory; then all the others, the same way; the
    ``invalid`` ones last. Each entry is what :func:`evaluate` returns.
    """
    batch = _check_inputs(model, cluster, global_batch)
    micros = _subset("micro_batches", micro_batches, _micro, "whole numbers >= 1")
    stages = _subset("zero_stages", zero_stages, _zero, "ZeRO stages 0-3")
    modes = _subset("recompute", recompute, _recompute, f"modes from {RECOMPUTE}")
    opt = _options(
        sequence_parallel,
        virtual_stages,
        efficiency,
        usable_memory,
        max_bubble,
        "point",
        schedule,
        fp32_gradients,
    )
    gpus = cluster.gpus
    cps = (
        context_parallel_degrees(model, cluster)
        if context_parallel is None
        else _subset("context_parallel", context_parallel, _micro, "whole numbers >= 1")
    )
    eps = (
        expert_parallel_degrees(model)
        if expert_parallel is None
        else _subset("expert_parallel", expert_parallel, _micro, "whole numbers >= 1")
    )
    layouts = [
        _evaluate(model, cluster, batch, t, p, gpus // (t * c * p), zero, mode, b, opt, c, ep)
        for t in _divisors(gpus)
        for c in cps
        if (gpus // t) % c == 0
        for p in _divisors(gpus // (t * c))
        for ep in eps
        if (gpus // (t * c * p)) % ep == 0
        for zero in stages
        for mode in modes
        for b in micros
    ]
    return sorted(layouts, key=_sort_key)


def context_parallel_degrees(model: Model, cluster: Cluster) -> tuple[int, ...]:
    """The CP degrees :func:`plan` tries by default: 1, and each power of two ``c`` up to
    the GPU count for which CP can help.

    CP needs a fused attention kernel (ring attention keeps the online softmax's
    running sums, never the ``s x s`` scores) and ``2 c`` equal chunks of the sequence
    (the zig-zag layout that balances the causal mask, chapter 14). Degree ``c`` is
    tried when a GPU's ``s / c`` tokens are at least both thresholds of chapter 14:
    :func:`trainscale.context.cp_beats_tp_local_tokens` for ``c`` shards (``9 h g /
    (c - 1)`` tokens, ``g`` the share of key-value heads: from there the ring's
    traffic per FLOP is below that of a TP group of the same size, so splitting the
    sequence costs less than splitting the layers further), and
    :func:`trainscale.context.cp_hiding_threshold_tokens` over the inter-node link (the
    ring's traffic hides under attention even between nodes). At
    :data:`KERNEL_EFFICIENCY`. A 4,096-token, 8,192-wide model never qualifies, nor do
    Llama 3 405B's 8,192 tokens; 131,072 tokens with grouped-query attention do.
    """
    if not isinstance(model, Model):
        raise ValueError(f"model must be a planner.Model, got {type(model).__name__}")
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a planner.Cluster, got {type(cluster).__name__}")
    if not model.fused_attention:
        return (1,)
    share = (model.kv_heads or model.heads) / model.heads
    peak, link = cluster.peak_flops, cluster.inter_node_bandwidth
    hides = cp_hiding_threshold_tokens(peak, KERNEL_EFFICIENCY, link, kv_share=share)
    degrees, c = [1], 2
    while c <= cluster.gpus and model.seq_len % (2 * c) == 0:
        local = model.seq_len / c
        beats = cp_beats_tp_local_tokens(
            model.hidden, c, peak, KERNEL_EFFICIENCY, link, kv_share=share
        )
        if local < max(beats, hides):
            break
        degrees.append(c)
        c *= 2
    return tuple(degrees)


def expert_parallel_degrees(model: Model) -> tuple[int, ...]:
    """The EP degrees :func:`plan` tries by default: every divisor of the model's experts
    (1 for a dense model); :func:`plan` keeps those that also divide DP."""
    if not isinstance(model, Model):
        raise ValueError(f"model must be a planner.Model, got {type(model).__name__}")
    return (1,) if model.experts is None else tuple(_divisors(model.experts))


def top_layouts(layouts: Sequence[Layout], count: int = 5) -> list[Layout]:
    """The fastest layout that fits of each TP x PP x DP shape, fastest first, at most ``count``.

    :func:`plan` returns every ZeRO stage, recomputation mode and micro-batch of
    a shape; this keeps the best setting of each shape, so the list compares
    shapes rather than variations of one.
    """
    n = _checks.count("count", count, minimum=1)
    best: dict[tuple[int, int, int], Layout] = {}
    for layout in sorted((lay for lay in layouts if lay.verdict == "fits"), key=_sort_key):
        best.setdefault(layout.shape, layout)
    return list(best.values())[:n]


def verdict_counts(layouts: Iterable[Layout]) -> dict[str, int]:
    """How many layouts got each verdict, in the order of :data:`VERDICTS`."""
    counted = Counter(layout.verdict for layout in layouts)
    return {verdict: counted[verdict] for verdict in VERDICTS}


# ---------------------------------------------------------------------------
# The worked example of chapter 13, and published runs to compare with.

EXAMPLE_MODEL = Model(params=70e9, layers=80, hidden=8192, heads=64, seq_len=4096, vocab=32000)
"""The book's 70B worked example: 80 layers, hidden size 8,192, 64 heads,
sequences of 4,096 tokens, a 32,000-token vocabulary (Llama 2 70B's shape,
with plain multi-head attention assumed)."""

LONG_CONTEXT_MODEL = Model(
    params=8_030_261_248,
    layers=32,
    hidden=4096,
    heads=32,
    seq_len=131_072,
    vocab=128_256,
    kv_heads=8,
    ffn_hidden=14_336,
    gated_mlp=True,
    dropout=False,
)
"""Llama 3 8B's shape (Meta's model card and the paper's Table 3, arXiv 2407.21783:
8.03B parameters, 32 layers, width 4,096, 32 heads and 8 key-value heads, SwiGLU of
width 14,336, a 128,256-token vocabulary, no dropout) at 131,072 tokens per sequence:
the example where context parallelism pays (chapters 13 and 14)."""

MOE_MODEL = Model(
    params=46_702_792_704,
    layers=32,
    hidden=4096,
    heads=32,
    seq_len=4096,
    vocab=32_000,
    kv_heads=8,
    ffn_hidden=14_336,
    gated_mlp=True,
    dropout=False,
    experts=8,
    top_k=2,
)
"""Mixtral 8x7B's shape (Jiang et al. 2024, arXiv 2401.04088; bib key jiang2024mixtral):
8 SwiGLU experts of width 14,336 per layer, 2 chosen per token, 46.7B parameters of
which 12.9B are active: the example where expert parallelism pays (chapters 13 and 15)."""


def node_settings(gpu: str, inter_node_bandwidth: float) -> dict[str, float]:
    """The :class:`Cluster` settings of one node of ``gpu`` (a key of
    :data:`trainscale.published.GPUS`), all but ``nodes``: its GPUs per node, memory,
    peak FLOP/s and NVLink bandwidth, with the given bytes per second per GPU to
    other nodes."""
    spec = GPUS[str(_checks.choice("gpu", gpu, tuple(GPUS)))]
    return {
        "gpus_per_node": spec.gpus_per_node,
        "memory_bytes": spec.memory_bytes,
        "peak_flops": spec.peak_flops,
        "intra_node_bandwidth": spec.nvlink_bandwidth,
        "inter_node_bandwidth": _checks.positive("inter_node_bandwidth", inter_node_bandwidth),
        "memory_bandwidth": spec.memory_bandwidth,
        "multiprocessors": spec.multiprocessors,
        "max_matmul_share": spec.max_matmul_share,
    }


H100_NODE = node_settings("H100-80GB", inter_node_bandwidth=50e9)
"""Assumptions for an 8 x H100 SXM node: the GPU of :data:`trainscale.published.GPUS`
(the 81,559 MiB = 79.6 GiB an "80 GB" H100 reports, 989 TFLOP/s dense bf16, NVLink 4
at 450e9 B/s each way) and one 400 Gb/s InfiniBand or RoCE card per GPU (50e9 B/s)."""

EXAMPLE_CLUSTER = Cluster(nodes=8, **H100_NODE)
"""The worked example's cluster: 8 nodes x 8 H100 = 64 GPUs."""

EXAMPLE_GLOBAL_BATCH = 1024
"""The worked example's global batch, in sequences of 4,096 tokens: 4,194,304 tokens,
the "global batch-size of 4M tokens" Llama 2 70B trained with (Touvron et al., arXiv
2307.09288, Table 1; bib key touvron2023llama2)."""

A100_NODE = node_settings("A100-80GB", inter_node_bandwidth=25e9)
"""Assumptions for a DGX A100 80 GB node as in Narayanan et al.'s Selene runs:
81,920 MiB = 80 GiB reported per GPU, 312 TFLOP/s dense bf16/fp16, NVLink 3 at 300e9 B/s
each way, eight 200 Gb/s HDR InfiniBand cards per node (25e9 B/s per GPU)."""


def _published(run: object) -> PublishedRun:
    if not isinstance(run, PublishedRun):
        raise ValueError(
            f"run must be a planner.PublishedRun (see published_runs()), got {type(run).__name__}"
        )
    return run


FUSED_ATTENTION_SOURCES = ("dubey2024llama3",)
"""Bib keys of the calibration runs that used a fused (FlashAttention-style) attention
kernel. FlashAttention (Dao et al., arXiv 2205.14135) appeared in May 2022; Narayanan
et al. (2021), Korthikanti et al. and BLOOM (both trained before it) used Megatron-LM's
fused softmax, which still writes the ``s x s`` scores to memory; Llama 3 (2024)
names a fused attention kernel. A property of the software a paper used, not a tuned
constant."""


def _cites(run: PublishedRun, keys: Iterable[str]) -> bool:
    """Whether the run's source names one of the bib ``keys``."""
    return any(f"bib key {key}" in run.source for key in keys)


FP32_GRADIENT_SOURCES = ("dubey2024llama3",)
"""Bib keys of the calibration runs that accumulate and reduce gradients in fp32
(:data:`FP32_GRADIENTS`): Llama 3, section 3.3.2. The Megatron-LM runs and BLOOM
reduce 16-bit gradients (Megatron-LM's default)."""

NO_DROPOUT_SOURCES = ("dubey2024llama3",)
"""Bib keys of the calibration runs whose layers have no dropout: Llama 3's reference
model (meta-llama/llama3, ``llama/model.py``) has none, so no 1-byte masks are kept.
Megatron-LM's GPT runs and BLOOM use dropout (Megatron-LM's default, 0.1)."""


DOCUMENTED_OVERLAP: dict[str, tuple[float, float]] = {
    "narayanan2021efficient": (0.0, 0.0),
    "korthikanti2022reducing": (0.0, 1.0),
}
"""What the software of a calibration run hid, where its code shows it: ``(data-parallel
traffic, the backward's tensor-parallel collectives)``, the share hidden, by bib key, for
runs that use Megatron-LM's own data parallelism (ZeRO stage 0); the others keep the
:data:`OVERLAP` band. Megatron-LM as of 9 April 2021 (commit cdde433, Narayanan et
al.'s code): ``train_step`` all-reduces the gradients (``allreduce_gradients``, the
default ``--DDP-impl local``) after ``forward_backward_func`` returns, so nothing of it
hides; the tensor-parallel all-reduces are synchronous. As of 10 May 2022 (commit
d239429, Korthikanti et al.'s): the same all-reduce after the backward, and
``async_tensor_model_parallel_allreduce`` (on unless
``--no-async-tensor-model-parallel-allreduce``) runs a column-parallel layer's backward
all-reduce while its weight-gradient GEMM computes; with sequence parallelism (commit
739cb43, 24 May 2022, the code of their selective-recomputation runs) the backward's
all-gather runs under the input-gradient GEMM and its reduce-scatter under the
weight-gradient GEMM instead. A property of the software, read off its code, not a
tuned constant."""


DEEPSPEED_PIPELINE_SOURCES = ("bigscience2022bloom", "smith2022megatronturing")
"""Bib keys of runs whose pipeline ran on DeepSpeed's pipeline engine (Megatron-DeepSpeed:
BLOOM; MT-NLG). Its ``TrainSchedule`` (``deepspeed/runtime/pipe/schedule.py``) is 1F1B
without interleaving, and reduces the gradients (``ReduceGrads``) only after the last
micro-batch's backward; its engine refuses ZeRO stages 2 and 3 ("ZeRO-2 and ZeRO-3 are
incompatible with pipeline parallelism", ``deepspeed/runtime/pipe/engine.py``). So: one
model chunk per GPU, ZeRO 0 or 1, and no data-parallel traffic hidden under the
backward. A property of the software, read off its code."""


def _documented_overlap(run: PublishedRun) -> tuple[float | None, float | None]:
    """``(data, tensor)`` overlap a run's software documents (:data:`DOCUMENTED_OVERLAP`,
    :data:`DEEPSPEED_PIPELINE_SOURCES`), ``None`` where it does not."""
    if run.zero_stage == 0:
        for key, shares in DOCUMENTED_OVERLAP.items():
            if _cites(run, (key,)):
                return shares
    if _cites(run, DEEPSPEED_PIPELINE_SOURCES):
        return 0.0, None
    return None, None


def published_model(run: PublishedRun) -> Model:
    """The planner's :class:`Model` of a published run.

    Tied embeddings are read off the published parameter count
    (:attr:`trainscale.published.PublishedRun.tied_embeddings`); grouped-query
    attention, the MLP width and its gating go to the roofline step time; the
    attention kernel is fused when the run's source is in :data:`FUSED_ATTENTION_SOURCES`.
    Activation memory stays GPT-style (Korthikanti et al.'s count, an approximation
    for gated MLPs).
    """
    run = _published(run)
    return Model(
        params=run.params,
        layers=run.layers,
        hidden=run.hidden,
        heads=run.heads,
        seq_len=run.seq_len,
        vocab=run.vocab,
        tied_embeddings=run.tied_embeddings,
        kv_heads=run.kv_heads,
        ffn_hidden=run.ffn_hidden,
        gated_mlp=bool(run.gated_mlp),
        fused_attention=_cites(run, FUSED_ATTENTION_SOURCES),
        dropout=not _cites(run, NO_DROPOUT_SOURCES),
    )


def published_cluster(run: PublishedRun) -> Cluster:
    """The planner's :class:`Cluster` of a published run: its GPUs, in nodes of its GPU type."""
    run = _published(run)
    if run.inter_node_bandwidth is None:
        raise ValueError(f"run {run.name!r} does not publish inter_node_bandwidth")
    settings = node_settings(run.gpu, run.inter_node_bandwidth)
    return Cluster(nodes=run.gpus // settings["gpus_per_node"], **settings)


def reported_mfu_6n(run: PublishedRun) -> float:
    """A published run's utilisation in the book's ``6 N`` convention.

    ``6 N`` FLOPs per token times the tokens per second of its ``step_seconds``, over
    the peak of its GPUs (:func:`trainscale.compute.mfu`): comparable with
    :attr:`Layout.mfu`. Papers count more per token
    (:data:`trainscale.compute.FLOP_CONVENTIONS`): attention's products, which are
    model work that ``6 N`` leaves out, and in Megatron-LM's equation 3 also the
    forward pass full recomputation repeats, which is hardware work (HFU), not model
    work. ``step_seconds`` already undid their convention.
    """
    run = _published(run)
    peak = GPUS[run.gpu].peak_flops
    return mfu(run.tokens_per_step / run.step_seconds, run.params, run.gpus, peak)


def reported_mfu(run: PublishedRun) -> float:
    """A published run's MFU in the ``6 N`` convention (:func:`reported_mfu_6n`)."""
    return reported_mfu_6n(run)


@dataclass(frozen=True)
class RunEstimate:
    """The planner's estimate of a published run, at the run's own TP x PP x DP.

    ``mfu`` (6N) and its range ``[mfu_low, mfu_high]``: the fastest setting of the
    fields the run does not publish, under the central and the pessimistic and
    optimistic ends of :func:`gemm_share` (with no tile cost, the counted one and the
    upper end of :func:`tile_overhead_range`), :data:`ELEMENTWISE_TRAFFIC` and
    :data:`OVERLAP` (or :data:`DOCUMENTED_OVERLAP`).
    ``layout`` is the central estimate (its ``times`` the step's breakdown, in
    seconds), ``memory_bytes`` its memory per GPU, ``fits`` whether that is within
    :data:`trainscale.memory.USABLE_MEMORY` of the GPU, ``rank`` the published
    shape's place among the planner's fitting shapes (1 = the planner's first
    choice; ``None`` when it is not among them).
    """

    run: PublishedRun
    layout: Layout
    mfu: float
    mfu_low: float
    mfu_high: float
    memory_bytes: float
    fits: bool
    rank: int | None

    @property
    def times(self) -> Mapping[str, float]:
        """The central estimate's step time, term by term (:data:`TIME_PARTS`), in seconds."""
        return self.layout.times


INTERLEAVING = (1, 2, 3, 4, 6, 8)
"""Interleaving depths (model chunks per GPU) tried where a run does not publish one."""


def _choices(run: PublishedRun) -> dict:
    """What a run publishes, or every value the planner tries where it does not (on
    DeepSpeed's pipeline engine, one model chunk per GPU and ZeRO 0 or 1:
    :data:`DEEPSPEED_PIPELINE_SOURCES`)."""
    deepspeed = _cites(run, DEEPSPEED_PIPELINE_SOURCES)
    depths = INTERLEAVING if not deepspeed else (1,)
    stages = (0, 1, 2, 3) if not deepspeed else (0, 1)
    return {
        "micro_batches": (run.micro_batch,) if run.micro_batch else (1, 2, 4, 8),
        "zero_stages": (run.zero_stage,) if run.zero_stage is not None else stages,
        "recompute": (run.recompute,) if run.recompute else RECOMPUTE,
        "sp": (run.sequence_parallel,) if run.sequence_parallel is not None else (True, False),
        "v": (run.virtual_stages,) if run.virtual_stages else depths,
    }


def _best(layouts: Iterable[Layout]) -> Layout | None:
    order = ("fits", "bubble too large", "TP across nodes", "out of memory")
    usable = [lay for lay in layouts if lay.verdict != "invalid"]
    return min(usable, key=lambda lay: (order.index(lay.verdict), lay.step_seconds), default=None)


def _at_shape(
    run: PublishedRun, band: str, overhead: float = 1.0, overlap: float | None = None
) -> Layout | None:
    """The fastest setting at the run's shape, searched over what it does not publish;
    ``overlap`` pins the share of communication hidden (else documented, else the band)."""
    model, cluster, c = published_model(run), published_cluster(run), _choices(run)
    cp = run.cp or 1
    candidates = []
    for v in c["v"]:
        if run.pp * v > run.layers + 2:
            continue
        for sp in c["sp"]:
            fp32 = _cites(run, FP32_GRADIENT_SOURCES)
            shares = _documented_overlap(run) if overlap is None else (overlap, overlap)
            opt = _options(sp, v, None, USABLE_MEMORY, 1.0, band, "1f1b", fp32, shares, overhead)
            candidates += [
                _evaluate(
                    model, cluster, run.global_batch, run.tp, run.pp, run.dp, z, r, b, opt, cp
                )
                for z in c["zero_stages"]
                for r in c["recompute"]
                for b in c["micro_batches"]
            ]
    return _best(candidates)


def _rank(run: PublishedRun, point: Layout) -> int | None:
    """Place of the run's shape among the planner's fastest fitting shapes (central band)."""
    c = _choices(run)
    v = point.virtual_stages
    layouts = plan(
        published_model(run),
        published_cluster(run),
        run.global_batch,
        micro_batches=c["micro_batches"],
        zero_stages=c["zero_stages"],
        recompute=c["recompute"],
        sequence_parallel=point.sequence_parallel,
        virtual_stages=v,
        efficiency=None,
        max_bubble=1.0,
        fp32_gradients=_cites(run, FP32_GRADIENT_SOURCES),
        context_parallel=(run.cp or 1,),
    )
    shapes = [lay.shape for lay in top_layouts(layouts, count=len(layouts))]
    shape = (run.tp, run.pp, run.dp)
    return shapes.index(shape) + 1 if shape in shapes else None


def _range_ends(evaluate_at) -> tuple[Layout, Layout]:
    """The pessimistic and optimistic layouts among ``evaluate_at(band, overhead)`` for
    the ``low`` and ``high`` bands with no tile cost, the counted one and the upper end
    of :func:`tile_overhead_range`: the one slowest, the other fastest."""
    none, most = tile_overhead_range()
    ends = (none, 1.0, most)
    lows = [evaluate_at("low", overhead) for overhead in ends]
    highs = [evaluate_at("high", overhead) for overhead in ends]
    if None in lows or None in highs:
        raise ValueError("the layout is invalid for the planner")
    return min(lows, key=lambda lay: lay.mfu), max(highs, key=lambda lay: lay.mfu)


def estimate_run(run: PublishedRun, overlap: float | None = None) -> RunEstimate:
    """The planner's estimate of a published run, with its range (see :class:`RunEstimate`).

    The run's TP, PP, DP, global batch and GPUs are fixed; each field it leaves
    ``None`` (micro-batch, ZeRO stage, recomputation, sequence parallelism,
    interleaving depth) is searched, and the fastest setting taken, once for each end
    of the range: the ``low`` and ``high`` bands of :func:`gemm_share` (with no tile
    cost, the counted one and the upper end of :func:`tile_overhead_range`),
    :data:`ELEMENTWISE_TRAFFIC` and :data:`OVERLAP` (or the overlap the run's software documents,
    :data:`DOCUMENTED_OVERLAP`). ``overlap`` (a share in [0, 1]) pins the share of the
    data- and tensor-parallel communication that hides instead: what the range would be
    if a source said it.
    """
    run = _published(run)
    pinned = None if overlap is None else _checks.fraction("overlap", overlap)
    point = _at_shape(run, "point", 1.0, pinned)
    if point is None:
        raise ValueError(f"run {run.name!r}: its layout is invalid for the planner")
    low, high = _range_ends(lambda band, overhead: _at_shape(run, band, overhead, pinned))
    memory_ok = point.memory_bytes <= USABLE_MEMORY * published_cluster(run).memory_bytes
    return RunEstimate(
        run=run,
        layout=point,
        mfu=point.mfu,
        mfu_low=low.mfu,
        mfu_high=high.mfu,
        memory_bytes=point.memory_bytes,
        fits=memory_ok,
        rank=_rank(run, point),
    )


def mfu_range(
    model: Model,
    cluster: Cluster,
    layout: Layout,
    *,
    schedule: str = "1f1b",
    fp32_gradients: bool = False,
) -> tuple[float, float]:
    """``(low, high)``: the calibrated model's MFU range for one ``layout`` of
    :func:`plan` or :func:`evaluate` (with the ``schedule`` and ``fp32_gradients`` it was
    planned with), the same construction :func:`estimate_run` gives a published run:
    the pessimistic and optimistic bands of :func:`gemm_share` (with no tile cost, the
    counted one and the upper end of :func:`tile_overhead_range`),
    :data:`ELEMENTWISE_TRAFFIC` and :data:`OVERLAP`."""
    _check_inputs(model, cluster, 1)
    if not isinstance(layout, Layout):
        raise ValueError(f"layout must be a planner.Layout, got {type(layout).__name__}")
    if layout.verdict == "invalid":
        raise ValueError(f"layout must be a valid layout, got one that is invalid: {layout.notes}")

    def at(band: str, overhead: float) -> Layout:
        opt = _options(
            layout.sequence_parallel,
            layout.virtual_stages,
            None,
            USABLE_MEMORY,
            1.0,
            band,
            schedule,
            fp32_gradients,
            overhead=overhead,
        )
        return _evaluate(
            model,
            cluster,
            layout.global_batch,
            layout.tp,
            layout.pp,
            layout.dp,
            layout.zero_stage,
            layout.recompute,
            layout.micro_batch,
            opt,
            layout.cp,
            layout.ep,
        )

    low, high = _range_ends(at)
    return low.mfu, high.mfu


def restated_run(use: PublishedUtilisation, base: PublishedRun, **layout) -> PublishedRun:
    """A published utilisation (:data:`trainscale.compute.PUBLISHED_UTILISATION`) as a run
    :func:`estimate_run` can take: ``base``'s model and GPU type, ``use``'s name and GPU
    count, the fields in ``layout`` replaced (TP, DP, batch, ...), and its step time from
    the utilisation restated in 6N (chapter 12): the step's ``6 N`` FLOPs over the GPUs'
    peak times that utilisation."""
    if not isinstance(use, PublishedUtilisation):
        raise ValueError(f"use must be a compute.PublishedUtilisation, got {type(use).__name__}")
    run = dataclasses.replace(_published(base), name=use.name, gpus=use.gpus, **layout)
    six_n_flops = 6 * run.params * run.tokens_per_step
    seconds = six_n_flops / (use.gpus * use.peak_flops * use.utilisation("6n"))
    return dataclasses.replace(run, step_seconds=seconds)


CALIBRATION_TARGETS = {
    "coverage": 0.90,
    "median error": 0.10,
    "within 1.35": 1.0,
    "fits": 1.0,
    "top 5": 0.70,
}
"""The calibration's targets (issue 12): the share of runs whose published MFU lies in
the range (at least), the median of ``|estimate / published - 1|`` (at most), the share
of ranges no wider than 1.35x, of published layouts that fit, and of published shapes
among the planner's five fastest (at least)."""


def calibration_targets(estimates: Sequence[RunEstimate]) -> dict[str, float]:
    """How ``estimates`` (of :func:`estimate_run`) meet :data:`CALIBRATION_TARGETS`, with
    the widest range (high / low) as well."""
    if not estimates or not all(isinstance(e, RunEstimate) for e in estimates):
        raise ValueError("estimates must be a non-empty sequence of planner.RunEstimate")
    n = len(estimates)
    published = [reported_mfu(e.run) for e in estimates]
    errors = sorted(abs(e.mfu / p - 1) for e, p in zip(estimates, published, strict=True))
    spans = [e.mfu_high / e.mfu_low for e in estimates]
    return {
        "coverage": sum(
            e.mfu_low <= p <= e.mfu_high for e, p in zip(estimates, published, strict=True)
        )
        / n,
        "median error": (errors[(n - 1) // 2] + errors[n // 2]) / 2,
        "within 1.35": sum(span <= 1.35 for span in spans) / n,
        "widest range": max(spans),
        "fits": sum(e.fits for e in estimates) / n,
        "top 5": sum(e.rank is not None and e.rank <= 5 for e in estimates) / n,
    }


GEMM_SHARE = gemm_share(1.0)
"""The central estimate's GEMM share by band (:func:`gemm_share` at the counted tile
overhead): about 0.62, 0.67 and 0.70 of peak, an effective share of a compute-bound
GEMM's main loop on an A100."""


if __name__ == "__main__":  # python -m trainscale.planner: the command line
    from trainscale.planner_cli import main

    raise SystemExit(main())
