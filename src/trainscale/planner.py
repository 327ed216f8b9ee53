"""The layout planner of chapter 13: which TP x PP x DP layout to start a large run with.

Given a model, a cluster and a global batch, :func:`plan` tries every way of
splitting the GPUs into tensor (TP), pipeline (PP) and data (DP) parallel groups,
with every ZeRO stage, every activation-recomputation mode and every candidate
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
      :func:`trainscale.checkpointing.layer_activation_bytes` (chapter 09), times the
      layers of the stage, times the micro-batches in flight on it (1F1B keeps up to
      ``PP`` of them on the first stage), plus the embedding on the first stage and
      the output layer and its fp32 logits on the last one.

Step time (:func:`evaluate` lists every term)
    compute at ``peak x`` :data:`KERNEL_EFFICIENCY` for the ``6 N`` FLOPs per token
    (chapter 01), plus recomputation (chapter 09); tensor-parallel all-reduces, never
    hidden (ring cost from chapter 04); pipeline sends; the pipeline bubble (chapter
    07); and data-parallel traffic (the bytes of chapter 05's ZeRO stages), which
    hides under one micro-batch's compute and is exposed beyond it. Then
    ``MFU = 6 N x tokens per step / (step time x GPUs x peak)`` (chapter 12).

Placement follows Megatron-LM's rank order: TP ranks are neighbours (inside a
node when ``gpus_per_node`` is a multiple of TP), then DP, then PP. Each link is
charged at the cluster's per-GPU bandwidth of the slowest hop it crosses.

Which layouts are tried: TP over every divisor of the GPU count (it must also
divide the attention heads), PP over every divisor of what is left, DP the
rest. PP need *not* divide the layers: the fullest stage gets ``ceil(L / PP)``
layers, its memory is what must fit and its pace sets the pipeline's (real runs
balance stages by hand, as Llama 3 did by giving the first and last one layer
fewer). The micro-batch must divide the sequences of each DP rank; the number
of micro-batches per step is the gradient accumulation.

What the model leaves out, on purpose: the attention FLOPs in the ``6 N`` count
(chapter 11 measures them), the optimiser step itself, collective latency,
overlap of tensor-parallel traffic, kernels that slow down when a GEMM gets
small, and memory the estimate does not list (CUDA context, NCCL buffers,
fragmentation, the transient buffers of recomputation), for which only
:data:`USABLE_MEMORY` of each GPU is counted as available.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from trainscale import _checks
from trainscale.checkpointing import (
    ACTIVATION_PARTS,
    RECOMPUTE,
    layer_activation_bytes,
    selective_recompute_flops,
)
from trainscale.collectives import ring_factor
from trainscale.compute import FLOPS_PER_PARAM_PER_TOKEN, mfu
from trainscale.memory import GIB, STATE_GROUPS, USABLE_MEMORY, model_state_groups
from trainscale.pipeline import bubble
from trainscale.published import GPUS, PublishedRun, published_runs
from trainscale.sharding import ZERO_COLLECTIVES, zero_collective_bytes

__all__ = [  # this module's public names, and those it re-exports for chapter 13
    "A100_NODE",
    "ACTIVATION_PARTS",
    "EXAMPLE_CLUSTER",
    "EXAMPLE_GLOBAL_BATCH",
    "EXAMPLE_MODEL",
    "H100_NODE",
    "KERNEL_EFFICIENCY",
    "MAX_BUBBLE",
    "MEMORY_PARTS",
    "RECOMPUTE",
    "TIME_PARTS",
    "USABLE_MEMORY",
    "VERDICTS",
    "Cluster",
    "Layout",
    "Model",
    "PublishedRun",
    "activation_bytes_per_gpu",
    "estimate_run",
    "evaluate",
    "layer_activation_bytes",
    "model_state_per_gpu",
    "node_settings",
    "plan",
    "published_cluster",
    "published_model",
    "published_runs",
    "reported_mfu_6n",
    "stage_params",
    "top_layouts",
    "verdict_counts",
]

KERNEL_EFFICIENCY = 0.6
"""Share of peak FLOP/s that a well-tuned transformer layer's kernels sustain
together, before any time is lost to communication or pipeline idling. An
assumption, not a measurement: large bf16 matrix multiplications on A100/H100
reach 70-80 % of peak, and the normalisations, softmax and element-wise kernels
between them pull the average down. Pass ``efficiency=`` to change it."""

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
    "pipeline sends",
    "data-parallel traffic",
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

    def __post_init__(self) -> None:
        for name in ("params", "layers", "hidden", "heads", "seq_len", "vocab"):
            object.__setattr__(self, name, _checks.count(name, getattr(self, name), minimum=1))
        _checks.boolean("tied_embeddings", self.tied_embeddings)
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden must be a multiple of heads ({self.heads}), got {self.hidden}"
            )
        if self.params <= self.embedding_params:
            raise ValueError(
                f"params must exceed the {self.embedding_params:,} parameters of the "
                f"embedding and output layers, got {self.params:,}"
            )

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
    (``inter_node_bandwidth``, e.g. its InfiniBand card).
    """

    nodes: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node"):
            object.__setattr__(self, name, _checks.count(name, getattr(self, name), minimum=1))
        for name in ("memory_bytes", "peak_flops", "intra_node_bandwidth", "inter_node_bandwidth"):
            object.__setattr__(self, name, _checks.positive(name, getattr(self, name)))

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
    ``accumulation`` is ``None``; ``notes`` says what is wrong.
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

    @property
    def gpus(self) -> int:
        """GPUs the layout uses: ``TP x PP x DP``."""
        return self.tp * self.pp * self.dp

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(TP, PP, DP)``."""
        return (self.tp, self.pp, self.dp)

    @property
    def effective_batch(self) -> int | None:
        """Sequences per optimiser step: micro-batch x accumulation steps x DP."""
        if self.accumulation is None:
            return None
        return self.micro_batch * self.accumulation * self.dp

    @property
    def name(self) -> str:
        """``"TP 8 x PP 4 x DP 2"``."""
        return f"TP {self.tp} \u00d7 PP {self.pp} \u00d7 DP {self.dp}"

    @property
    def settings(self) -> str:
        """``"ZeRO-1, selective recompute, micro-batch 1"``."""
        recompute = "no recompute" if self.recompute == "none" else f"{self.recompute} recompute"
        return f"ZeRO-{self.zero_stage}, {recompute}, micro-batch {self.micro_batch}"


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
    if p * v > model.layers:
        raise ValueError(f"pp x virtual_stages must be <= layers ({model.layers}), got {p * v}")
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


@functools.lru_cache(maxsize=4096)
def _state(per_gpu: int, dp: int, zero_stage: int) -> tuple[tuple[str, int], ...]:
    return tuple(model_state_groups(per_gpu, gpus=dp, zero_stage=zero_stage).items())


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
) -> float:
    """Activation bytes on the fullest pipeline stage (see :func:`activation_bytes_per_gpu`)."""
    s, h, a, vocab = model.seq_len, model.hidden, model.heads, model.vocab
    per_layer = layer_activation_bytes(s, b, h, a, t, sp, mode)
    t_sp = t if sp else 1
    embedding = s * b * h / t_sp  # 1-byte dropout mask on the embedding output
    output = 4 * s * b * h / t_sp + 4 * s * b * vocab / t  # final norm, output input, fp32 logits
    per_chunk, per_stage, _, _ = _stage(model, p, v)
    if p == 1:
        return per_stage * per_layer + embedding + output
    if v == 1:
        first_chunks, last_chunks = min(p, m), 1
    else:  # Megatron's interleaved warm-up: (v-1) p + 2 (p-1) chunk forwards before a backward
        first_chunks, last_chunks = min(v * p + p - 1, v * m), min((v - 1) * p + 1, v * m)
    first = first_chunks * per_chunk * per_layer + min(p, m) * embedding
    last = last_chunks * per_chunk * per_layer + output
    return max(first, last)


def activation_bytes_per_gpu(
    model: Model,
    tp: int,
    pp: int,
    micro_batch: int,
    micro_batches: int,
    recompute: str = "none",
    sequence_parallel: bool = True,
    virtual_stages: int = 1,
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
    Without pipelining all of it lands on one stage, once.
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
    if p * v > model.layers:
        raise ValueError(f"pp x virtual_stages must be <= layers ({model.layers}), got {p * v}")
    return _activations(model, t, p, b, m, mode, sp, v)


@dataclass(frozen=True)
class _Options:
    sequence_parallel: bool
    virtual_stages: int
    efficiency: float
    usable_memory: float
    max_bubble: float


def _options(
    sequence_parallel: object,
    virtual_stages: object,
    efficiency: object,
    usable_memory: object,
    max_bubble: object,
) -> _Options:
    return _Options(
        sequence_parallel=_checks.boolean("sequence_parallel", sequence_parallel),
        virtual_stages=_checks.count("virtual_stages", virtual_stages, minimum=1),
        efficiency=_checks.positive("efficiency", efficiency, maximum=1.0),
        usable_memory=_checks.positive("usable_memory", usable_memory, maximum=1.0),
        max_bubble=_checks.fraction("max_bubble", max_bubble),
    )


def _invalid(t, p, d, zero, mode, b, batch, problems, notes) -> Layout:
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
    )


def _data_parallel_seconds(
    per_gpu: int, dp: int, zero: int, link: float, forward: float, backward: float
) -> tuple[float, float]:
    """Data-parallel seconds not hidden under compute: ``(per micro-batch, once per step)``.

    The bytes of each collective come from :func:`trainscale.sharding.zero_collective_bytes`
    (16-bit weights and gradients of the stage's ``per_gpu`` parameters over ``dp``
    GPUs), which ones run every micro-batch from :data:`trainscale.sharding.ZERO_COLLECTIVES`.
    Collectives that hide under the backward pass share one micro-batch's ``backward``
    (recomputation included); those that hide under the forward pass share one
    ``forward``; what they take beyond it is exposed.
    """
    runs = zero_collective_bytes(per_gpu, dp, zero)
    seconds: dict[tuple[bool, str], float] = {}
    for c in ZERO_COLLECTIVES[zero]:
        key = (c.per_micro_batch, c.hides_under)
        seconds[key] = seconds.get(key, 0.0) + runs[c.name] / link
    window = {"forward": forward, "backward": backward}
    exposed = {True: 0.0, False: 0.0}
    for (every, phase), busy in seconds.items():
        exposed[every] += max(0.0, busy - window[phase])
    return exposed[True], exposed[False]


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
) -> Layout:
    v = opt.virtual_stages if p > 1 else 1  # without a pipeline there is nothing to interleave
    notes = []
    if model.heads % t:
        notes.append(f"TP {t} does not divide the {model.heads} attention heads")
    if p * v > model.layers:
        notes.append(f"{p * v} pipeline chunks for {model.layers} layers")
    if batch % d:
        notes.append(f"DP {d} does not divide the global batch of {batch} sequences")
    elif (batch // d) % b:
        notes.append(f"micro-batch {b} does not divide the {batch // d} sequences per DP rank")
    tp_across = cluster.gpus_per_node % t != 0
    across = (
        f"TP {t} spans nodes of {cluster.gpus_per_node} GPUs: its all-reduces cross the network"
    )
    if notes:
        if tp_across:
            return _invalid(
                t, p, d, zero, mode, b, batch, ["invalid", "TP across nodes"], [*notes, across]
            )
        return _invalid(t, p, d, zero, mode, b, batch, ["invalid"], notes)

    m = batch // (d * b)
    s, h, gpn = model.seq_len, model.hidden, cluster.gpus_per_node
    intra, inter = cluster.intra_node_bandwidth, cluster.inter_node_bandwidth

    # Memory on the fullest stage.
    _, per_stage, imbalance, stage_total = _stage(model, p, v)
    per_gpu = -(-stage_total // t)
    state = dict(_state(per_gpu, d, zero))
    activations = _activations(model, t, p, b, m, mode, opt.sequence_parallel, v)
    memory_parts = {**state, "activations": activations}
    memory = sum(memory_parts.values())

    # Compute of one micro-batch on the slowest stage, at the achievable FLOP rate.
    rate = cluster.peak_flops * opt.efficiency
    six = sum(FLOPS_PER_PARAM_PER_TOKEN.values())
    compute = six * model.params * b * s / (p * t) * imbalance / rate
    forward = compute * FLOPS_PER_PARAM_PER_TOKEN["forward"] / six
    backward = compute - forward
    if mode == "full":
        recompute = forward  # one more forward pass
    elif mode == "selective":  # the attention scores of every layer, again
        recompute = selective_recompute_flops(s, b, h, t) * per_stage / rate
    else:
        recompute = 0.0

    # Tensor parallelism: 2 all-reduces forward, 2 backward (and 2 more when the
    # forward is recomputed), of s x b x h 16-bit values, per layer and micro-batch.
    tp_link = inter if tp_across else intra
    collectives = 6 if mode == "full" else 4
    tensor = per_stage * collectives * ring_factor(t) * 2 * s * b * h / tp_link

    # Pipeline: each micro-batch sends its activations forward and its gradient
    # back, 1/t of them per GPU (Megatron's scatter/gather), once per model chunk.
    pp_link = intra if cluster.nodes == 1 else inter
    sends = 0.0 if p == 1 else 2 * v * 2 * s * b * h / t / pp_link

    # Data parallelism over the 16-bit gradients and weights of the stage.
    dp_link = intra if gpn % (t * d) == 0 else inter
    window = backward + recompute  # what one micro-batch's backward phase lasts
    dp_each, dp_once = _data_parallel_seconds(per_gpu, d, zero, dp_link, forward, window)

    per_micro = compute + recompute + tensor + sends + dp_each
    busy = m * per_micro
    idle_share = bubble(p, m, v)
    times = {
        "compute": m * compute,
        "recomputation": m * recompute,
        "tensor-parallel traffic": m * tensor,
        "pipeline sends": m * sends,
        "data-parallel traffic": m * dp_each + dp_once,
        "pipeline bubble": busy * idle_share / (1 - idle_share),  # idle = busy x b / (1 - b)
    }
    step = sum(times.values())
    bubble_share = times["pipeline bubble"] / step
    utilisation = mfu(batch * s / step, model.params, t * p * d, cluster.peak_flops)

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
    efficiency: float = KERNEL_EFFICIENCY,
    usable_memory: float = USABLE_MEMORY,
    max_bubble: float = MAX_BUBBLE,
) -> Layout:
    """Estimate memory per GPU, step time and MFU of one layout.

    ``global_batch`` is in sequences; ``tp * pp * dp`` must equal the cluster's
    GPUs. The pipeline runs ``m = global_batch / (micro_batch * dp)`` micro-batches
    per step (the accumulation steps), each taking on the slowest stage:

    * compute: ``6 N b s / (pp tp)`` FLOPs at ``peak * efficiency``, times the
      layer imbalance when ``pp`` does not divide the layers;
    * recomputation: full, one more forward pass (a third more compute); selective,
      the attention scores again
      (:func:`trainscale.checkpointing.selective_recompute_flops`, ``2 b s^2 h / t``
      FLOPs per layer);
    * tensor parallelism: per layer 4 all-reduces of ``2 s b h`` bytes (6 with full
      recomputation), :func:`trainscale.collectives.ring_factor` (``2 (t-1)/t``) of
      them sent per GPU, over NVLink if TP fits in
      a node and over the network otherwise; not overlapped;
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
      the traffic of the others.

    Then the pipeline idles :func:`trainscale.pipeline.bubble`, ``(p-1)/(v m + p - 1)``,
    of its time (chapter 07): ``(pp - 1) / virtual_stages`` micro-batch slots. The verdict is
    ``out of memory`` beyond ``usable_memory`` of the GPU, ``TP across nodes``
    when a TP group spans nodes, ``bubble too large`` beyond ``max_bubble``, and
    ``invalid`` when TP does not divide the heads, the chunks outnumber the layers,
    or DP and the micro-batch do not divide the batch.
    """
    batch = _check_inputs(model, cluster, global_batch)
    t = _checks.count("tp", tp, minimum=1)
    p = _checks.count("pp", pp, minimum=1)
    d = _checks.count("dp", dp, minimum=1)
    if t * p * d != cluster.gpus:
        raise ValueError(
            f"tp x pp x dp must equal the cluster's {cluster.gpus} GPUs, got {t}x{p}x{d}"
        )
    zero = _zero("zero_stage", zero_stage)
    mode = _recompute("recompute", recompute)
    b = _checks.count("micro_batch", micro_batch, minimum=1)
    opt = _options(sequence_parallel, virtual_stages, efficiency, usable_memory, max_bubble)
    return _evaluate(model, cluster, batch, t, p, d, zero, mode, b, opt)


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
    efficiency: float = KERNEL_EFFICIENCY,
    usable_memory: float = USABLE_MEMORY,
    max_bubble: float = MAX_BUBBLE,
) -> list[Layout]:
    """Every layout of ``cluster.gpus`` GPUs, estimated and ranked.

    TP runs over every divisor of the GPU count, PP over every divisor of what TP
    leaves, DP takes the rest, so ``TP x PP x DP`` always equals the GPU count;
    each shape is tried with every ZeRO stage, recomputation mode and micro-batch
    size given. Pipeline stages need not divide the layers evenly (see
    :func:`stage_params`). Layouts that break a rule are kept with the verdict
    ``invalid`` so a reader can see why they were rejected.

    Ranked: layouts that fit without any problem first, fastest estimated step
    first, ties going to less memory; then all the others, the same way; the
    ``invalid`` ones last. Each entry is what :func:`evaluate` returns.
    """
    batch = _check_inputs(model, cluster, global_batch)
    micros = _subset("micro_batches", micro_batches, _micro, "whole numbers >= 1")
    stages = _subset("zero_stages", zero_stages, _zero, "ZeRO stages 0-3")
    modes = _subset("recompute", recompute, _recompute, f"modes from {RECOMPUTE}")
    opt = _options(sequence_parallel, virtual_stages, efficiency, usable_memory, max_bubble)
    gpus = cluster.gpus
    layouts = [
        _evaluate(model, cluster, batch, t, p, gpus // (t * p), zero, mode, b, opt)
        for t in _divisors(gpus)
        for p in _divisors(gpus // t)
        for zero in stages
        for mode in modes
        for b in micros
    ]
    return sorted(layouts, key=_sort_key)


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


def published_model(run: PublishedRun) -> Model:
    """The planner's :class:`Model` of a published run.

    Tied embeddings are read off the published parameter count
    (:attr:`trainscale.published.PublishedRun.tied_embeddings`). Grouped-query
    attention and a gated MLP change only how the parameters are counted, which
    ``params`` already does; the activation count stays GPT-style (an approximation).
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


def estimate_run(run: PublishedRun, **options) -> Layout | None:
    """The planner's best layout with a published run's TP, PP and DP.

    ``options`` go to :func:`plan` (e.g. ``virtual_stages=2``); the run's own
    ``recompute`` and ``zero_stage``, where published, restrict the modes and stages
    tried unless ``options`` name them. Sequence parallelism, interleaving and the
    micro-batch stay the planner's to choose (its defaults), as for any layout.
    The fastest layout that fits is returned; if none fits, the fastest that is only
    flagged (bubble, TP across nodes), then the fastest that runs out of memory, so
    the estimate can still be compared. ``None`` only if the run's shape is invalid
    for the planner.
    """
    run = _published(run)
    if run.cp not in (None, 1):
        raise ValueError(f"run {run.name!r} uses context parallelism, which the planner lacks")
    if run.recompute is not None and "recompute" not in options:
        options["recompute"] = (run.recompute,)
    if run.zero_stage is not None and "zero_stages" not in options:
        options["zero_stages"] = (run.zero_stage,)
    shape = (run.tp, run.pp, run.dp)
    order = ("fits", "bubble too large", "TP across nodes", "out of memory")
    candidates = [
        lay
        for lay in plan(published_model(run), published_cluster(run), run.global_batch, **options)
        if lay.shape == shape and lay.verdict != "invalid"
    ]
    candidates.sort(key=lambda lay: (order.index(lay.verdict), lay.step_seconds))
    return candidates[0] if candidates else None
