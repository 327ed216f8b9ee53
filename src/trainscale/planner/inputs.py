"""What the planner is given: a model, a cluster, and the worked examples of chapter 16.

:class:`Model` (a dense transformer or a mixture of experts) and :class:`Cluster` (nodes
of GPUs and the links between them); :func:`node_settings` reads one node of a GPU type
off :data:`trainscale.published.GPUS` (:data:`H100_NODE`, :data:`A100_NODE`); the worked
examples (:data:`EXAMPLE_MODEL` on :data:`EXAMPLE_CLUSTER` with
:data:`EXAMPLE_GLOBAL_BATCH`, :data:`LONG_CONTEXT_MODEL`, :data:`MOE_MODEL`); the
planner's model and cluster of a published run (:func:`published_model`,
:func:`published_cluster`); and the argument checks the planner's other modules share.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from trainscale import _checks
from trainscale.checkpointing import RECOMPUTE
from trainscale.published import GPUS, PublishedRun
from trainscale.software import DEFAULT_SOFTWARE, Software, software


def _recompute(name: str, value: object) -> str:
    return str(_checks.choice(name, value, RECOMPUTE))


def _zero(name: str, value: object) -> int:
    return int(_checks.choice(name, value, (0, 1, 2, 3)))  # type: ignore[call-overload]


def _software(value: object) -> Software:
    """A :class:`Software` record, or the preset of that name (``None``: the default)."""
    return DEFAULT_SOFTWARE if value is None else software(value)


def _check_inputs(model: object, cluster: object, global_batch: object) -> int:
    if not isinstance(model, Model):
        raise ValueError(f"model must be a planner.Model, got {type(model).__name__}")
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster must be a planner.Cluster, got {type(cluster).__name__}")
    return _checks.count("global_batch", global_batch, minimum=1)


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
    Those two are the software's (:class:`trainscale.software.Software`, given to
    :func:`plan`, :func:`evaluate` and :func:`estimate_run`) when left ``None``; a value
    here is this model's own and wins (Llama 3's layers have no dropout on any stack).
    :meth:`under` fills them in.

    A mixture of experts (chapter 11): ``experts`` MLPs of width ``expert_ffn_hidden``
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
    fused_attention: bool | None = None
    dropout: bool | None = None
    experts: int | None = None
    top_k: int = 1
    expert_ffn_hidden: int | None = None

    def __post_init__(self) -> None:
        for name in ("params", "layers", "hidden", "heads", "seq_len", "vocab", "top_k"):
            object.__setattr__(self, name, _checks.count(name, getattr(self, name), minimum=1))
        for name in ("kv_heads", "ffn_hidden", "experts", "expert_ffn_hidden"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _checks.count(name, getattr(self, name), minimum=1))
        for name in ("tied_embeddings", "gated_mlp"):
            _checks.boolean(name, getattr(self, name))
        for name in ("fused_attention", "dropout"):
            if getattr(self, name) is not None:
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

    def under(self, stack: Software) -> Model:
        """This model on ``stack``: ``fused_attention`` and ``dropout`` left ``None`` are
        the software's."""
        if not isinstance(stack, Software):
            raise ValueError(f"software must be a Software record, got {type(stack).__name__}")
        changes = {
            name: getattr(stack, name)
            for name in ("fused_attention", "dropout")
            if getattr(self, name) is None
        }
        return dataclasses.replace(self, **changes) if changes else self

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
        ``6 N`` FLOPs per token, chapter 1, and of MFU)."""
        if self.experts is None:
            return self.params
        unused = self.expert_params_per_layer // self.experts * (self.experts - self.top_k)
        return self.params - self.layers * unused

    @functools.cached_property
    def layer_shape(self) -> dict[str, object]:
        """The keyword arguments of :func:`trainscale.checkpointing.layer_activation_bytes`
        that describe this model's layer (grouped-query attention, MLP width and gating,
        fused attention, dropout: where left ``None``, those of
        :data:`trainscale.software.DEFAULT_SOFTWARE`)."""
        ffn = self.ffn_hidden if self.experts is None else self.top_k * self.expert_width
        resolved = self.under(DEFAULT_SOFTWARE)
        return {
            "kv_heads": self.kv_heads,
            "ffn_hidden": ffn,
            "gated_mlp": self.gated_mlp,
            "fused_attention": resolved.fused_attention,
            "dropout": resolved.dropout,
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
class _Problem:
    """What a layout is planned for: a model, a cluster and a global batch in sequences
    (checked by :func:`_check_inputs`)."""

    model: Model
    cluster: Cluster
    batch: int


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
    ``peak_flops_low`` is the lowest sustained peak a power limit may hold a GPU to
    (``None``: its ``peak_flops``) and ``attention_share`` the span of shares of peak a
    fused attention kernel sustains on it (``None``: the GEMMs' share); both are unknowns
    whose span the planner's range covers (:mod:`trainscale.planner.unknowns`).
    ``fp8_peak_flops`` and ``fp8_max_matmul_share`` are the GPU's dense FP8 peak and its
    fastest measured FP8 GEMM's share of it (``None``: no FP8, or not measured), for a
    stack whose linear layers run in FP8.
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
    peak_flops_low: float | None = None
    attention_share: tuple[float, float] | None = None
    fp8_peak_flops: float | None = None
    fp8_max_matmul_share: float | None = None

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
        if self.peak_flops_low is not None:
            low = _checks.positive("peak_flops_low", self.peak_flops_low, maximum=self.peak_flops)
            object.__setattr__(self, "peak_flops_low", low)
        if self.attention_share is not None:
            low, high = (
                _checks.positive("attention_share", x, maximum=1.0) for x in self.attention_share
            )
            if low > high:
                raise ValueError(
                    f"attention_share must be (slowest, fastest), got {self.attention_share}"
                )
            object.__setattr__(self, "attention_share", (low, high))
        if self.fp8_peak_flops is not None:
            fp8 = _checks.positive("fp8_peak_flops", self.fp8_peak_flops)
            object.__setattr__(self, "fp8_peak_flops", fp8)
        if self.fp8_max_matmul_share is not None:
            share = _checks.positive("fp8_max_matmul_share", self.fp8_max_matmul_share, maximum=1.0)
            object.__setattr__(self, "fp8_max_matmul_share", share)

    @property
    def gpus(self) -> int:
        """GPUs in the whole cluster."""
        return self.nodes * self.gpus_per_node


# ---------------------------------------------------------------------------
# The worked example of chapter 16, and published runs to compare with.


EXAMPLE_MODEL = Model(params=70e9, layers=80, hidden=8192, heads=64, seq_len=4096, vocab=32000)
"""The book's 70B worked example: 80 layers, hidden size 8,192, 64 heads,
sequences of 4,096 tokens, a 32,000-token vocabulary (Llama 2 70B's shape,
with plain multi-head attention assumed)."""

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
which 12.9B are active: the example where expert parallelism pays (chapters 16 and 11)."""


def shape_params(
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    *,
    kv_heads: int | None = None,
    ffn_hidden: int | None = None,
    gated_mlp: bool = False,
    experts: int | None = None,
    tied_embeddings: bool = False,
    norms: bool = False,
) -> int:
    """Parameters of a decoder of this shape: per layer ``2 h^2`` (query, output) +
    ``2 h (h / heads) kv_heads`` (keys, values) + 2 (3 if gated) ``h x ffn`` matrices
    per expert; plus the embedding and output layer, ``2 vocab h`` (once if tied).
    ``norms``: also two norm weights per layer and a final one (``2 h`` per layer +
    ``h``, what a model card counts); otherwise norms and biases are left out (under
    0.01 %)."""
    kv = kv_heads or heads
    ffn = ffn_hidden or 4 * hidden
    mlp = (3 if gated_mlp else 2) * hidden * ffn * (experts or 1)
    layer = 2 * hidden * hidden + 2 * hidden * (hidden // heads) * kv + mlp
    embeddings = (1 if tied_embeddings else 2) * vocab * hidden
    if norms:
        return layers * (layer + 2 * hidden) + embeddings + hidden
    return layers * layer + embeddings


def _llama3(layers: int, hidden: int, heads: int, ffn: int) -> Model:
    """A Llama 3 shape (Dubey et al. 2024, arXiv 2407.21783, Table 3: 8 key-value heads,
    SwiGLU, a 128,256-token vocabulary, untied), 8,192 tokens per sequence (the main
    pre-training stage), its parameters counted from the shape with the norms: 8,030,261,248,
    70,553,706,496 and 405,853,388,800, the model cards' counts."""
    shape = {"kv_heads": 8, "ffn_hidden": ffn, "gated_mlp": True}
    params = shape_params(layers, hidden, heads, 128_256, **shape, norms=True)
    return Model(params, layers, hidden, heads, 8192, 128_256, **shape, dropout=False)


LLAMA3 = {
    "8B": _llama3(32, 4096, 32, 14_336),
    "70B": _llama3(80, 8192, 64, 28_672),
    "405B": _llama3(126, 16_384, 128, 53_248),
}
"""Llama 3's three dense shapes (:func:`_llama3`), by size."""

GPT3_175B = Model(
    shape_params(96, 12_288, 96, 50_257, tied_embeddings=True) + 2048 * 12_288,
    *(96, 12_288, 96, 2048, 50_257),
    tied_embeddings=True,
)
"""GPT-3 175B (Brown et al. 2020, arXiv 2005.14165, Table 2.1: 96 layers, width 12,288, 96
heads of 128, 2,048-token context; GPT-2's 50,257-token vocabulary, its input and output
embeddings tied, and 2,048 learned positions): 174.6B parameters by this count, the
175.0B the paper rounds to."""

LONG_CONTEXT_MODEL = dataclasses.replace(LLAMA3["8B"], seq_len=131_072)
"""Llama 3 8B's shape (Meta's model card and the paper's Table 3, arXiv 2407.21783:
8.03B parameters, 32 layers, width 4,096, 32 heads and 8 key-value heads, SwiGLU of
width 14,336, a 128,256-token vocabulary, no dropout) at 131,072 tokens per sequence:
the example where context parallelism pays (chapters 16 and 10)."""


def node_settings(gpu: str, inter_node_bandwidth: float) -> dict[str, object]:
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
        "peak_flops_low": spec.peak_flops_low,
        "attention_share": spec.attention_share,
        "fp8_peak_flops": spec.fp8_peak_flops,
        "fp8_max_matmul_share": spec.fp8_max_matmul_share,
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
    (:attr:`trainscale.published.PublishedRun.tied_embeddings`); grouped-query
    attention, the MLP width and its gating go to the roofline step time; the attention
    kernel and dropout are left to the run's software (:attr:`PublishedRun.software`,
    which :func:`estimate_run` plans it on). Activation memory stays GPT-style
    (Korthikanti et al.'s count, an approximation for gated MLPs).
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
    )


def published_cluster(run: PublishedRun) -> Cluster:
    """The planner's :class:`Cluster` of a published run: its GPUs, in nodes of its GPU type."""
    run = _published(run)
    if run.inter_node_bandwidth is None:
        raise ValueError(f"run {run.name!r} does not publish inter_node_bandwidth")
    settings = node_settings(run.gpu, run.inter_node_bandwidth)
    return Cluster(nodes=run.gpus // settings["gpus_per_node"], **settings)
