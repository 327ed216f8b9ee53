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
      ZeRO sharding over the DP group exactly as :func:`trainscale.memory.model_state_parts`
      does it (chapters 02 and 05);
    * activations per Korthikanti et al. (arXiv 2205.05198; bib key korthikanti2022reducing),
      built from :data:`ACTIVATION_PARTS` by :func:`layer_activation_bytes`, times the
      layers of the stage, times the micro-batches in flight on it (1F1B keeps up to
      ``PP`` of them on the first stage), plus the embedding on the first stage and
      the output layer and its fp32 logits on the last one.

Step time (:func:`evaluate` lists every term)
    compute at ``peak x`` :data:`KERNEL_EFFICIENCY` for the ``6 N`` FLOPs per token
    (chapter 01), plus recomputation; tensor-parallel all-reduces, never hidden;
    pipeline sends; the pipeline bubble; and data-parallel traffic, which hides
    under the backward pass of one micro-batch and is exposed beyond it. Then
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
from trainscale.compute import FLOPS_PER_PARAM_PER_TOKEN
from trainscale.memory import OPTIMIZER_STATE, model_state_parts

KERNEL_EFFICIENCY = 0.6
"""Share of peak FLOP/s that a well-tuned transformer layer's kernels sustain
together, before any time is lost to communication or pipeline idling. An
assumption, not a measurement: large bf16 matrix multiplications on A100/H100
reach 70-80 % of peak, and the normalisations, softmax and element-wise kernels
between them pull the average down. Pass ``efficiency=`` to change it."""

USABLE_MEMORY = 0.9
"""Share of a GPU's memory the estimate may fill; the rest is left for what it
does not count (CUDA context, NCCL buffers, allocator fragmentation)."""

MAX_BUBBLE = 0.25
"""A pipeline that idles more than this share of the step is flagged."""

RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation modes: keep everything; recompute only the attention
scores (Korthikanti et al.'s *selective* recomputation, which is what
FlashAttention does inside its kernel); keep only each layer's input and rerun
its forward pass during backward (*full* recomputation, chapter 09)."""

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

MEMORY_PARTS = ("weights", "gradients", "optimiser state", "activations")
"""The terms of :attr:`Layout.memory_parts`, which add up to the memory per GPU."""

ACTIVATION_PARTS: tuple[tuple[str, int, int, bool], ...] = (
    # Attention block
    ("layer-norm output, input of the QKV projection", 2, 0, False),
    ("queries and keys, inputs of Q K^T", 4, 0, True),
    ("softmax output", 0, 2, True),
    ("attention dropout mask", 0, 1, True),
    ("attention dropout output, input of the product with V", 0, 2, True),
    ("values", 2, 0, True),
    ("input of the output projection", 2, 0, True),
    ("attention-block dropout mask", 1, 0, False),
    # MLP block
    ("layer-norm output, input of the first linear layer", 2, 0, False),
    ("GELU input", 8, 0, True),
    ("GELU output, input of the second linear layer", 8, 0, True),
    ("MLP dropout mask", 1, 0, False),
    # The two layer norms keep their inputs
    ("inputs of the two layer norms", 4, 0, False),
)
"""What one GPT-style transformer layer keeps for backward, per Korthikanti et al.
(arXiv 2205.05198, section 4.1), in 16-bit activations with 1-byte dropout masks.

Each row is ``(what, bytes per s*b*h, bytes per a*s*s*b, split by tensor parallelism)``
for sequence length ``s``, micro-batch ``b``, hidden size ``h`` and ``a`` heads.
The rows add up to ``34 s b h + 5 a s^2 b`` bytes, the paper's ``sbh(34 + 5as/h)``.
Tensor parallelism splits the rows inside the attention and MLP blocks by ``t``
(the ``24 s b h`` and the ``5 a s^2 b``); the other ``10 s b h`` stay whole on every
TP rank unless sequence parallelism splits them along the sequence too."""


def _is_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


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
        _is_bool("tied_embeddings", self.tied_embeddings)
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


def layer_activation_bytes(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Bytes one transformer layer keeps for backward on one GPU (Korthikanti et al.).

    With ``s = seq_len``, ``b = micro_batch``, ``h = hidden``, ``a = heads`` and
    ``t = tp`` this is the paper's Table 2 (arXiv 2205.05198), derived here from
    :data:`ACTIVATION_PARTS`:

    * no parallelism: ``sbh (34 + 5as/h)``;
    * tensor parallelism: ``sbh (10 + 24/t + 5as/(ht))``;
    * tensor and sequence parallelism: ``sbh (34/t + 5as/(ht))``;
    * selective recomputation drops the ``5as/h`` term (the attention scores are
      recomputed): ``sbh (10 + 24/t)``, or ``sbh 34/t`` with sequence parallelism;
    * full recomputation keeps only the layer's 16-bit input: ``2 sbh``, or
      ``2 sbh / t`` with sequence parallelism, which shards that input along the
      sequence (as Megatron-LM stores it).
    """
    s = _checks.count("seq_len", seq_len, minimum=1)
    b = _checks.count("micro_batch", micro_batch, minimum=1)
    h = _checks.count("hidden", hidden, minimum=1)
    a = _checks.count("heads", heads, minimum=1)
    t = _checks.count("tp", tp, minimum=1)
    sp = _is_bool("sequence_parallel", sequence_parallel)
    mode = _recompute("recompute", recompute)
    return _layer_activation_bytes(s, b, h, a, t, sp, mode)


def _layer_activation_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool, mode: str) -> float:
    sbh, as2b = s * b * h, a * s * s * b
    if mode == "full":
        return 2 * sbh / (t if sp else 1)
    total = 0.0
    for _, per_sbh, per_as2b, split in ACTIVATION_PARTS:
        size = per_sbh * sbh + (0 if mode == "selective" else per_as2b * as2b)
        total += size / t if split or sp else size
    return total


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
    shards them over DP with :func:`trainscale.memory.model_state_parts`.
    """
    per_gpu = stage_params(model, tp, pp, virtual_stages)
    return dict(_state(per_gpu, _checks.count("dp", dp, minimum=1), zero_stage))


@functools.lru_cache(maxsize=4096)
def _state(per_gpu: int, dp: int, zero_stage: int) -> tuple[tuple[str, int], ...]:
    parts = model_state_parts(per_gpu, gpus=dp, zero_stage=zero_stage)
    optimiser = sum(parts[p] for p in OPTIMIZER_STATE)
    return (
        ("weights", parts["weights"]),
        ("gradients", parts["gradients"]),
        ("optimiser state", optimiser),
    )


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
    per_layer = _layer_activation_bytes(s, b, h, a, t, sp, mode)
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
    sp = _is_bool("sequence_parallel", sequence_parallel)
    v = _checks.count("virtual_stages", virtual_stages, minimum=1) if p > 1 else 1
    if p * v > model.layers:
        raise ValueError(f"pp x virtual_stages must be <= layers ({model.layers}), got {p * v}")
    return _activations(model, t, p, b, m, mode, sp, v)


def ring_factor(ranks: int, collective: str = "all-reduce") -> float:
    """Bytes each rank sends, per byte of the tensor, in a ring collective of ``ranks``.

    ``2 (N-1) / N`` for an all-reduce, ``(N-1) / N`` for a reduce-scatter or an
    all-gather (chapter 04).
    """
    n = _checks.count("ranks", ranks, minimum=1)
    kind = _checks.choice("collective", collective, ("all-reduce", "reduce-scatter", "all-gather"))
    return (2 if kind == "all-reduce" else 1) * (n - 1) / n


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
        sequence_parallel=_is_bool("sequence_parallel", sequence_parallel),
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
    elif mode == "selective":
        recompute = 4 * b * s * s * h * per_stage / t / rate  # Q K^T and scores x V, again
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
    gather = ring_factor(d, "all-gather") * 2 * per_gpu / dp_link
    scatter = ring_factor(d, "reduce-scatter") * 2 * per_gpu / dp_link
    window = backward + recompute  # what one micro-batch's backward phase lasts
    if zero == 0:  # one all-reduce per step, bucket by bucket under the last backward
        dp_each, dp_once = 0.0, max(0.0, gather + scatter - window)
    elif zero == 1:  # its two halves: gradients under the last backward, weights under a forward
        dp_each, dp_once = 0.0, max(0.0, scatter - window) + max(0.0, gather - forward)
    elif zero == 2:  # sharded gradients: reduce-scatter after every micro-batch
        dp_each = max(0.0, scatter - window)
        dp_once = max(0.0, gather - forward)
    else:  # and sharded weights: gathered for every forward and every backward
        dp_each = max(0.0, gather - forward) + max(0.0, gather + scatter - window)
        dp_once = 0.0

    per_micro = compute + recompute + tensor + sends + dp_each
    idle_slots = (p - 1) / v
    times = {
        "compute": m * compute,
        "recomputation": m * recompute,
        "tensor-parallel traffic": m * tensor,
        "pipeline sends": m * sends,
        "data-parallel traffic": m * dp_each + dp_once,
        "pipeline bubble": idle_slots * per_micro,
    }
    step = sum(times.values())
    bubble = times["pipeline bubble"] / step
    tokens = batch * s
    mfu = six * model.params * tokens / (step * t * p * d * cluster.peak_flops)

    problems = []
    if memory > opt.usable_memory * cluster.memory_bytes:
        problems.append("out of memory")
        notes.append(
            f"{memory / 1e9:.1f} GB per GPU, over {opt.usable_memory:.0%} of "
            f"{cluster.memory_bytes / 1e9:.0f} GB"
        )
    if tp_across:
        problems.append("TP across nodes")
        notes.append(across)
    if bubble > opt.max_bubble:
        problems.append("bubble too large")
        notes.append(f"pipeline idle {bubble:.0%} of the step with {m} micro-batches")
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
        mfu=mfu,
        bubble=bubble,
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
      the attention scores again (``4 b s^2 h`` FLOPs per layer, over ``tp``);
    * tensor parallelism: per layer 4 all-reduces of ``2 s b h`` bytes (6 with full
      recomputation), ``2 (t-1)/t`` of them sent per GPU, over NVLink if TP fits in
      a node and over the network otherwise; not overlapped;
    * pipeline sends: the activation forward and its gradient back, ``2 s b h / t``
      bytes each, per model chunk;
    * data-parallel traffic that did not hide under compute, each collective
      moving ``(d-1)/d x 2`` bytes per parameter of the stage (16-bit), twice for
      an all-reduce. Without ZeRO, one gradient all-reduce per step, started bucket
      by bucket during the last micro-batch's backward and hidden under it as far
      as it lasts. ZeRO-1 splits it into a reduce-scatter of the gradients (under
      that backward) and an all-gather of the updated weights (prefetched under
      the next forward). ZeRO-2 keeps only a shard of the gradients, so it must
      reduce-scatter them after *every* micro-batch (holding the full gradient
      until the last one is what ZeRO-1 does). ZeRO-3 also all-gathers the weights
      before every forward and every backward: with one micro-batch, 1.5 times
      the traffic of the others.

    Then the pipeline adds ``(pp - 1) / virtual_stages`` idle micro-batch slots
    (the bubble, ``(p-1)/(v m + p - 1)`` of the step, chapter 07). The verdict is
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

H100_NODE = {
    "gpus_per_node": 8,
    "memory_bytes": 80e9,
    "peak_flops": 989e12,
    "intra_node_bandwidth": 450e9,
    "inter_node_bandwidth": 50e9,
}
"""Assumptions for an 8 x H100 SXM node: 80 GB per GPU (counted as 80e9 bytes,
the book's convention), 989 TFLOP/s dense bf16, NVLink 4 at 900 GB/s both
directions together (450e9 B/s each way), one 400 Gb/s InfiniBand or RoCE card
per GPU (50e9 B/s)."""

EXAMPLE_CLUSTER = Cluster(nodes=8, **H100_NODE)
"""The worked example's cluster: 8 nodes x 8 H100 = 64 GPUs."""

EXAMPLE_GLOBAL_BATCH = 64
"""The worked example's global batch, in sequences of 4,096 tokens."""

A100_NODE = {
    "gpus_per_node": 8,
    "memory_bytes": 80e9,
    "peak_flops": 312e12,
    "intra_node_bandwidth": 300e9,
    "inter_node_bandwidth": 25e9,
}
"""Assumptions for a DGX A100 80 GB node as in Narayanan et al.'s Selene runs:
312 TFLOP/s dense bf16/fp16, NVLink 3 at 600 GB/s both directions together,
eight 200 Gb/s HDR InfiniBand cards per node (25e9 B/s per GPU)."""


def _megatron_run(params, heads, hidden, layers, tp, pp, gpus, batch, tflops, share):
    return {
        "name": f"GPT {params / 1e9:g}B on {gpus:,} A100s",
        "cite": "narayanan2021efficient",
        "source": "Narayanan et al. 2021 (arXiv 2104.04473), Table 1",
        "model": Model(
            params=params,
            layers=layers,
            hidden=hidden,
            heads=heads,
            seq_len=2048,
            vocab=51200,
            tied_embeddings=True,
        ),
        "cluster": Cluster(nodes=gpus // 8, **A100_NODE),
        "global_batch": batch,
        "tp": tp,
        "pp": pp,
        "dp": gpus // (tp * pp),
        "reported_tflops_per_gpu": tflops,
        "reported_share_of_peak": share,
        "flops_counted": "megatron",
        "recompute": "full",
        "zero_stage": 0,
    }


PUBLISHED_RUNS: tuple[dict, ...] = (
    _megatron_run(18.4e9, 48, 6144, 40, 8, 1, 256, 1024, 135, 0.43),
    _megatron_run(145.6e9, 96, 12288, 80, 8, 8, 1536, 2304, 148, 0.47),
    _megatron_run(529.6e9, 128, 20480, 105, 8, 35, 2520, 2520, 163, 0.52),
    _megatron_run(1008.0e9, 160, 25600, 128, 8, 64, 3072, 3072, 163, 0.52),
    *(
        {
            "name": f"Llama 3 405B on {gpus:,} H100s",
            "cite": "dubey2024llama3",
            "source": "Llama 3 (arXiv 2407.21783), Table 4",
            "model": Model(
                params=405e9, layers=126, hidden=16384, heads=128, seq_len=8192, vocab=128000
            ),
            "cluster": Cluster(nodes=gpus // 8, **H100_NODE),
            "global_batch": dp * per_dp,
            "tp": 8,
            "pp": 16,
            "dp": dp,
            "reported_tflops_per_gpu": tflops,
            "reported_share_of_peak": mfu,
            "flops_counted": "palm",
            "recompute": "selective",
            "zero_stage": 2,
        }
        for gpus, dp, per_dp, tflops, mfu in (
            (8192, 64, 32, 430, 0.43),
            (16384, 128, 16, 400, 0.41),
        )
    ),
)
"""Published large runs, to set the planner's estimates against (sequences per batch
in ``global_batch``; ``tp * pp * dp`` GPUs).

Megatron-LM, Narayanan et al. 2021 (arXiv 2104.04473; bib key narayanan2021efficient),
Table 1: GPT models (tied embeddings) with a 51,200-token vocabulary and 2,048-token
sequences on Selene's DGX A100 nodes; the reported throughput is end to end, and
its FLOP count includes
the attention, the output layer *and the forward pass that activation
recomputation repeats* (their equation 3), so the reported share of peak is a
hardware utilisation, higher than the MFU of the ``6 N`` count: see
:func:`reported_mfu_6n`. Their FLOP count assumes full recomputation, so
``recompute`` is ``"full"``; the runs replicate the optimiser state over DP
(``zero_stage`` 0); micro-batch sizes and schedules are not in the table.

Llama 3 405B (arXiv 2407.21783; bib key dubey2024llama3), Table 4, the two
8,192-token stages without context parallelism: 16M tokens per batch, TP 8,
PP 16, BF16 MFU as defined by PaLM (Chowdhery et al., arXiv 2204.02311), which
adds the attention FLOPs to ``6 N``.
Meta used FSDP, an interleaved pipeline schedule with one layer fewer on the
first and last stages, and no activation checkpointing at 8K tokens. Their
FSDP shards optimiser state and gradients but keeps the gathered weights from
forward to backward, which in memory is ZeRO stage 2 (``zero_stage``). The
planner's closest mode is ``"selective"`` (``recompute`` below): a fused
attention kernel keeps no score matrix and recomputes it in backward. Their
model has grouped-query attention and a SwiGLU MLP, which the planner's
GPT-style activation count only approximates; the number of interleaved
stages is not given."""


def flops_per_token(model: Model, convention: str) -> float:
    """Training FLOPs per token under a published convention.

    * ``"6n"``: ``6 N``, the book's count (chapter 01);
    * ``"palm"``: ``6 N + 12 L h s``, adding the attention scores and their
      product with the values (PaLM's MFU, used by Llama 3);
    * ``"megatron"``: Narayanan et al.'s equation 3 per token,
      ``96 L h^2 (1 + s/(6h) + V/(16 L h))``, which counts four passes through the
      layers (forward, recomputed forward, backward twice as long) and the logits.
    """
    if not isinstance(model, Model):
        raise ValueError(f"model must be a planner.Model, got {type(model).__name__}")
    kind = _checks.choice("convention", convention, ("6n", "palm", "megatron"))
    n, layers, h, s = model.params, model.layers, model.hidden, model.seq_len
    if kind == "6n":
        return 6 * n
    if kind == "palm":
        return 6 * n + 12 * layers * h * s
    return 96 * layers * h * h * (1 + s / (6 * h) + model.vocab / (16 * layers * h))


def reported_mfu_6n(run: Mapping) -> float:
    """A published run's reported utilisation restated in the book's ``6 N`` convention.

    The reported share of peak is scaled by ``6 N`` over the FLOPs per token the
    authors counted (:func:`flops_per_token`), so it compares with :attr:`Layout.mfu`.
    """
    try:
        model, share, convention = run["model"], run["reported_share_of_peak"], run["flops_counted"]
    except (KeyError, TypeError) as missing:
        raise ValueError(
            "run must be a dict like those of PUBLISHED_RUNS, with model, "
            f"reported_share_of_peak and flops_counted; missing {missing}"
        ) from None
    return _checks.fraction("reported_share_of_peak", share) * (
        flops_per_token(model, "6n") / flops_per_token(model, convention)
    )


def estimate_run(run: Mapping, **options) -> Layout | None:
    """The planner's best layout with a published run's TP, PP and DP.

    ``options`` go to :func:`plan` (e.g. ``virtual_stages=2``); the run's own
    ``recompute`` and ``zero_stage`` settings, where it records them, restrict
    the modes and stages tried unless ``options`` name them. The fastest layout
    that fits is returned; if none fits, the fastest that is only flagged (bubble,
    TP across nodes), then the fastest that runs out of memory, so the estimate
    can still be compared.
    ``None`` only if the run's shape is invalid for the planner.
    """
    try:
        model, cluster, batch = run["model"], run["cluster"], run["global_batch"]
        shape = (run["tp"], run["pp"], run["dp"])
    except (KeyError, TypeError) as missing:
        raise ValueError(
            "run must be a dict like those of PUBLISHED_RUNS, with model, cluster, "
            f"global_batch, tp, pp and dp; missing {missing}"
        ) from None
    if "recompute" in run and "recompute" not in options:
        options["recompute"] = (run["recompute"],)
    if "zero_stage" in run and "zero_stages" not in options:
        options["zero_stages"] = (run["zero_stage"],)
    order = ("fits", "bubble too large", "TP across nodes", "out of memory")
    candidates = [
        lay
        for lay in plan(model, cluster, batch, **options)
        if lay.shape == shape and lay.verdict != "invalid"
    ]
    candidates.sort(key=lambda lay: (order.index(lay.verdict), lay.step_seconds))
    return candidates[0] if candidates else None
