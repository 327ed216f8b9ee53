"""How much arithmetic a training run needs, and how long it takes (chapters 1, 14, 15).

A dense model with ``N`` parameters spends about 2 FLOPs per parameter per
token in the forward pass (one multiply, one add) and about 4 in the backward
pass (the gradient with respect to the layer's input *and* with respect to its
weights), so training costs ``6 * N * D`` FLOPs for ``D`` tokens
(Kaplan et al., arXiv 2001.08361). Attention's own sequence-squared work is not
in this count; :func:`attention_training_flops` adds it, and chapter 14
measures both against PyTorch's FLOP counter.

Published runs count a token's FLOPs in different ways. :data:`FLOP_CONVENTIONS`
is the book's one table of them (what each counts, who uses it),
:func:`flops_per_token` computes each, :func:`convert_utilisation` restates a
utilisation from one count in another, and :data:`PUBLISHED_UTILISATION` holds
every published utilisation chapters 14 and 15 quote, with its source. The book's
own count is ``6N``: attention's products are work the model needs, which ``6N``
leaves out; only recomputation is not (that is HFU).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainscale import _checks
from trainscale.published import GPUS

FLOPS_PER_PARAM_PER_TOKEN = {"forward": 2, "backward": 4}
"""FLOPs per parameter per token for each pass (multiply and add count as two)."""


def training_flops(params: float, tokens: float) -> int:
    """Total training FLOPs, ``6 * params * tokens``.

    ``params`` is the parameter count ``N`` and ``tokens`` the number of
    training tokens ``D``; both whole numbers ``>= 0``. The result is an exact
    integer, so even ``1e12 * 1e13`` tokens loses no digits.
    """
    n = _checks.count("params", params)
    d = _checks.count("tokens", tokens)
    return sum(FLOPS_PER_PARAM_PER_TOKEN.values()) * n * d


def training_seconds(
    params: float, tokens: float, gpus: int, peak_flops: float, mfu: float
) -> float:
    """Wall-clock seconds to train: ``6ND / (gpus * peak_flops * mfu)``.

    ``peak_flops`` is one GPU's peak throughput in FLOP/s for the precision used
    (e.g. ``989e12`` for an H100's dense bf16); ``mfu`` is the share of that
    peak the job really achieves, in ``(0, 1]``.
    """
    flops = training_flops(params, tokens)
    n_gpus = _checks.count("gpus", gpus, minimum=1)
    peak = _checks.positive("peak_flops", peak_flops)
    utilisation = _checks.positive("mfu", mfu, maximum=1.0)
    return flops / (n_gpus * peak * utilisation)


def attention_training_flops(layers: int, context: int, d_attn: int, tokens: float) -> int:
    """FLOPs of attention's two token-by-token products over ``tokens`` training tokens.

    Per layer, each token's query meets the ``context`` keys of its sequence
    (``2 * context * d_attn`` FLOPs for the scores) and its attention weights
    multiply the ``context`` values (as many again): ``4 * context * d_attn``
    forward, and backward twice that, so ``12 * layers * context * d_attn`` per
    token (the ``s / 6h`` term of Narayanan et al., arXiv 2104.04473, relative to
    ``6N``). These products have no weights, so ``6N`` misses them. This counts
    the whole ``context x context`` score matrix, as a plain implementation
    computes it before masking; a causal kernel that skips the masked half
    does about half the work.
    """
    n_layers = _checks.count("layers", layers)
    n_ctx = _checks.count("context", context)
    width = _checks.count("d_attn", d_attn)
    d = _checks.count("tokens", tokens)
    return 3 * 4 * n_layers * n_ctx * width * d


@dataclass(frozen=True)
class FlopConvention:
    """One way of counting the training FLOPs of a token, as published runs count them.

    ``key`` is what :func:`flops_per_token` takes, ``name`` a short label,
    ``per_token`` the count per token in the symbols of :func:`flops_per_token`,
    ``counts`` what it includes and leaves out, ``model_flops`` whether it counts
    only work the model needs (a model FLOPs utilisation, MFU) or also work the
    hardware repeats for memory's sake (a hardware FLOPs utilisation, HFU), and
    ``used_by`` who publishes figures in it, with sources.
    """

    key: str
    name: str
    per_token: str
    counts: str
    model_flops: bool
    used_by: str


FLOP_CONVENTIONS: dict[str, FlopConvention] = {
    "6n": FlopConvention(
        "6n",
        "6N (this book)",
        "6 N",
        "every product with a weight, forward (2) and backward (4); leaves out attention's "
        "two token-by-token products, which are model work too, so it understates long "
        "contexts",
        True,
        "Kaplan et al. 2020 (arXiv 2001.08361, C = 6ND); this book's MFU and chapter 16's planner",
    ),
    "palm": FlopConvention(
        "palm",
        "6N + attention (PaLM)",
        "6 N + 12 L h s",
        "6N plus attention's scores and their product with the values over the whole "
        "s x s matrix (no causal halving), forward and backward; no recomputation",
        True,
        "PaLM, Chowdhery et al. 2022 (arXiv 2204.02311), appendix B; Llama 3 (arXiv "
        "2407.21783, Table 4); PyTorch's torchtitan; Korthikanti et al. 2022 (arXiv "
        "2205.05198) count the same for a GPT-shaped model, 72 B s l h^2 (1 + s/6h + V/12lh)",
    ),
    "megatron": FlopConvention(
        "megatron",
        "Megatron eq. 3 (with recomputation)",
        "96 L h^2 (1 + s/(6h) + V/(16 L h))",
        "PaLM's count for a GPT-shaped model plus a second forward pass through every "
        "layer, the one full activation recomputation repeats (the logits are not "
        "recomputed): the hardware FLOPs of a fully checkpointed run",
        False,
        "Narayanan et al. 2021 (arXiv 2104.04473), eq. 3 and Table 1; MT-NLG (arXiv "
        "2201.11990); the FLOP/s that Megatron-DeepSpeed and GPT-NeoX log with activation "
        "checkpointing on (BLOOM, GPT-NeoX-20B)",
    ),
    "hfu": FlopConvention(
        "hfu",
        "hardware FLOPs (HFU)",
        "6 N + 12 L h s + r (2 N + 4 L h s)",
        "PaLM's count plus the share r of the forward pass that activation checkpointing "
        "recomputes: r = 0 is PaLM's count, r = 1 a full second forward",
        False,
        "Korthikanti et al. 2022 (arXiv 2205.05198), section 6.3, which names it HFU",
    ),
}
"""The ways published runs count training FLOPs per token; the book's own is ``"6n"``.

Only recomputation inflates a count beyond the model's work (``"megatron"`` and
``"hfu"``); attention's products are work the model needs, which ``"6n"`` leaves out
and ``"palm"`` counts.
"""

FLOPS_CONVENTIONS = tuple(FLOP_CONVENTIONS)
"""The keys of :data:`FLOP_CONVENTIONS`, in order (what :func:`flops_per_token` accepts)."""


def flops_per_token(
    params: float,
    layers: int,
    hidden: int,
    seq_len: int,
    vocab: int,
    convention: str = "6n",
    recomputed: float = 0.0,
) -> float:
    """Training FLOPs per token under a published convention (:data:`FLOP_CONVENTIONS`).

    * ``"6n"``: ``6 N``, the book's count (:func:`training_flops` of one token);
    * ``"palm"``: ``6 N + 12 L h s``, adding the attention scores and their product
      with the values (:func:`attention_training_flops`; PaLM's MFU, Chowdhery et al.,
      arXiv 2204.02311, used by Llama 3);
    * ``"megatron"``: Narayanan et al.'s equation 3 (arXiv 2104.04473) per token,
      ``96 L h^2 (1 + s/(6h) + V/(16 L h))``, which counts four passes through the
      layers (forward, the forward that full recomputation repeats, and backward
      twice as long) and the logits;
    * ``"hfu"``: hardware FLOPs, PaLM's count plus the share ``recomputed`` (0 to 1)
      of the forward pass, ``2 N + 4 L h s``, that activation checkpointing runs again
      (Korthikanti et al., arXiv 2205.05198).

    ``params`` is ``N``, ``layers`` ``L``, ``hidden`` ``h``, ``seq_len`` ``s`` and
    ``vocab`` ``V``; ``recomputed`` is used by ``"hfu"`` only.
    """
    n = _checks.count("params", params)
    n_layers = _checks.count("layers", layers, minimum=1)
    h = _checks.count("hidden", hidden, minimum=1)
    s = _checks.count("seq_len", seq_len, minimum=1)
    v = _checks.count("vocab", vocab, minimum=1)
    kind = _checks.choice("convention", convention, FLOPS_CONVENTIONS)
    share = _checks.fraction("recomputed", recomputed)
    if kind == "megatron":
        return 96 * n_layers * h * h * (1 + s / (6 * h) + v / (16 * n_layers * h))
    six_n = training_flops(n, 1)
    attention = attention_training_flops(n_layers, s, h, 1)
    if kind == "6n":
        return six_n
    if kind == "palm":
        return six_n + attention
    return six_n + attention + share * (six_n + attention) / 3


@dataclass(frozen=True)
class ModelShape:
    """What a FLOP convention needs to know of a model: ``params`` (``N``), ``layers``
    (``L``), ``hidden`` (``h``), ``seq_len`` (``s``, tokens per sequence) and ``vocab``
    (``V``, padded as the run padded it)."""

    params: int
    layers: int
    hidden: int
    seq_len: int
    vocab: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", _checks.count("params", self.params, minimum=1))
        for name in ("layers", "hidden", "seq_len", "vocab"):
            object.__setattr__(self, name, _checks.count(name, getattr(self, name), minimum=1))

    def flops_per_token(self, convention: str = "6n", recomputed: float = 0.0) -> float:
        """:func:`flops_per_token` of this shape."""
        return flops_per_token(
            self.params, self.layers, self.hidden, self.seq_len, self.vocab, convention, recomputed
        )


def convert_utilisation(
    value: float, source: str, target: str, shape: ModelShape, recomputed: float = 0.0
) -> float:
    """A utilisation (MFU or HFU, a share of peak) restated from one convention in another.

    The tokens per second and the peak are the same under every convention; only the
    FLOPs credited to each token differ, so the share scales with them:
    ``value x flops_per_token(target) / flops_per_token(source)``. ``recomputed`` is
    the share of the forward pass recomputed, for ``"hfu"`` on either side.
    """
    share = _checks.positive("value", value)
    if not isinstance(shape, ModelShape):
        raise ValueError(f"shape must be a compute.ModelShape, got {type(shape).__name__}")
    to = shape.flops_per_token(target, recomputed)
    return share * to / shape.flops_per_token(source, recomputed)


def megatron_params(layers: int, hidden: int, seq_len: int, vocab: int) -> int:
    """Parameters of a GPT model as Narayanan et al. count them (arXiv 2104.04473, eq. 2).

    ``12 L h^2 + 13 L h + (V + s) h``: per layer four ``h x h`` attention matrices and
    two ``h x 4h`` MLP matrices with their biases and two layer norms, then the token
    and position embeddings (the output layer shares the token embedding). Their
    Table 1 prints this rounded (its "1.7B" is 1.65e9).
    """
    n_layers = _checks.count("layers", layers, minimum=1)
    h = _checks.count("hidden", hidden, minimum=1)
    s = _checks.count("seq_len", seq_len, minimum=1)
    v = _checks.count("vocab", vocab, minimum=1)
    return 12 * n_layers * h * h + 13 * n_layers * h + (v + s) * h


@dataclass(frozen=True)
class PublishedUtilisation:
    """A utilisation a paper or project publishes, with what it takes to restate it.

    ``flops_per_gpu`` is the FLOP/s per GPU the source reports, counted its way
    (``convention``, a key of :data:`FLOP_CONVENTIONS`; where the source gives a
    share of peak instead, that share times ``peak_flops``); ``peak_flops`` the dense
    bf16 peak of its GPU in FLOP/s; ``shape`` the model as the counts need it;
    ``gpus`` how many GPUs ran it; ``kind`` ``"training run"`` (a model was trained
    with it) or ``"benchmark"`` (timed, not trained to the end); ``source`` cites it.
    """

    name: str
    source: str
    convention: str
    flops_per_gpu: float
    peak_flops: float
    shape: ModelShape
    gpus: int
    kind: str

    def __post_init__(self) -> None:
        _checks.choice("convention", self.convention, FLOPS_CONVENTIONS)
        _checks.choice("kind", self.kind, ("training run", "benchmark"))
        peak = _checks.positive("peak_flops", self.peak_flops)
        _checks.positive("flops_per_gpu", self.flops_per_gpu, maximum=peak)
        if not isinstance(self.shape, ModelShape):
            raise ValueError(f"shape must be a compute.ModelShape, got {type(self.shape).__name__}")
        _checks.count("gpus", self.gpus, minimum=1)

    @property
    def reported(self) -> float:
        """The utilisation as the source counts it: ``flops_per_gpu / peak_flops``."""
        return self.flops_per_gpu / self.peak_flops

    def utilisation(self, convention: str = "6n") -> float:
        """The same run's utilisation in ``convention`` (:func:`convert_utilisation`)."""
        return convert_utilisation(self.reported, self.convention, convention, self.shape)


_A100 = GPUS["A100-80GB"].peak_flops  # 312e12 FLOP/s dense bf16; the 40 GB A100 has the same
_H100 = GPUS["H100-80GB"].peak_flops  # 989e12 FLOP/s dense bf16


def _megatron_gpt(layers: int, hidden: int) -> ModelShape:
    """The GPT models of Narayanan et al. and Korthikanti et al.: s = 2,048, V = 51,200."""
    return ModelShape(megatron_params(layers, hidden, 2048, 51200), layers, hidden, 2048, 51200)


def _llama3_405b(seq_len: int) -> ModelShape:
    """Llama 3 405B (arXiv 2407.21783, section 3.2): 126 layers, width 16,384, V = 128,000."""
    return ModelShape(405_000_000_000, 126, 16_384, seq_len, 128_000)


_NARAYANAN = (
    "Narayanan et al. 2021 (arXiv 2104.04473; narayanan2021efficient), Table 1: {tflops} "
    "TFLOP/s per GPU on {gpus:,} A100s, counted with their eq. 3, which includes the "
    "forward pass full recomputation repeats; s = 2,048, V = 51,200, N from their eq. 2. "
    "Benchmark runs, measured end to end, not trained to convergence (Megatron-LM's README)"
)
_TABLE_1 = (  # (layers, hidden, GPUs, TFLOP/s per GPU): Narayanan et al. 2021, Table 1
    (24, 2304, 32, 137),
    (30, 3072, 64, 138),
    (36, 4096, 128, 142),
    (40, 6144, 256, 135),
    (48, 8192, 512, 138),
    (60, 10240, 1024, 140),
    (80, 12288, 1536, 148),
    (96, 16384, 1920, 155),
    (105, 20480, 2520, 163),
    (128, 25600, 3072, 163),
)
_KORTHIKANTI = (
    "Korthikanti et al. 2022 (arXiv 2205.05198; korthikanti2022reducing), {where}: MFU "
    "{mfu:.1%} of 312 TFLOP/s, {how}. Their model FLOPs, 72 B s l h^2 (1 + s/6h + V/12lh), "
    "are PaLM's count for this GPT model. A benchmark"
)
_MT_NLG = (
    "Smith et al. 2022, MT-NLG 530B (arXiv 2201.11990; smith2022megatronturing), section "
    "2.4: {tflops} TFLOP/s per GPU on {nodes} DGX A100 nodes ({gpus:,} GPUs), global batch "
    "1,920, counted with Narayanan et al.'s eq. 3 (recomputation included); model as "
    "Table 1's 529.6B (105 layers, h = 20,480)"
)
_LLAMA3 = (
    "Llama 3 (arXiv 2407.21783; dubey2024llama3), Table 4: {tflops} TFLOP/s per GPU on "
    "{gpus:,} H100s at {seq:,} tokens per sequence, BF16 MFU {mfu}; section 3.3.2 counts "
    "MFU as PaLM does (Chowdhery et al.)"
)

PUBLISHED_UTILISATION: tuple[PublishedUtilisation, ...] = (
    *(
        PublishedUtilisation(
            f"GPT {megatron_params(layers, hidden, 2048, 51200) / 1e9:.1f}B on {gpus:,} A100s",
            _NARAYANAN.format(tflops=tflops, gpus=gpus),
            "megatron",
            tflops * 1e12,
            _A100,
            _megatron_gpt(layers, hidden),
            gpus,
            "benchmark",
        )
        for layers, hidden, gpus, tflops in _TABLE_1
    ),
    PublishedUtilisation(
        "GPT 530B on 2,240 A100s, full recompute",
        _KORTHIKANTI.format(where="abstract", mfu=0.421, how="with full recomputation"),
        "palm",
        0.421 * _A100,
        _A100,
        _megatron_gpt(105, 20480),
        2240,
        "benchmark",
    ),
    PublishedUtilisation(
        "GPT 530B on 2,240 A100s, selective recompute",
        _KORTHIKANTI.format(
            where="abstract", mfu=0.542, how="with sequence parallelism and selective recomputation"
        ),
        "palm",
        0.542 * _A100,
        _A100,
        _megatron_gpt(105, 20480),
        2240,
        "benchmark",
    ),
    PublishedUtilisation(
        "GPT 1T on 512 A100s (DP 1), selective recompute",
        _KORTHIKANTI.format(
            where="as Megatron-LM's README tabulates it ('measured using a data parallel size "
            "of one')",
            mfu=0.563,
            how="HFU 57.0 %; 512 GPUs, Table 1's 8-way tensor by 64-way pipeline layout for "
            "this model at data parallel size 1",
        ),
        "palm",
        0.563 * _A100,
        _A100,
        _megatron_gpt(128, 25600),
        512,
        "benchmark",
    ),
    *(
        PublishedUtilisation(
            f"MT-NLG 530B on {8 * nodes:,} A100s",
            _MT_NLG.format(tflops=tflops, nodes=nodes, gpus=8 * nodes),
            "megatron",
            tflops * 1e12,
            _A100,
            _megatron_gpt(105, 20480),
            8 * nodes,
            "training run",
        )
        for nodes, tflops in ((280, 126), (350, 121), (420, 113))
    ),
    PublishedUtilisation(
        "BLOOM 176B on 384 A100s",
        "BigScience Workshop 2022, BLOOM (arXiv 2211.05100; bigscience2022bloom): 176,247M "
        "parameters, 70 layers, h = 14,336, s = 2,048, vocabulary padded to 250,880, 48 nodes "
        "of 8 A100 80GB. 156 TFLOP/s per GPU sustained (GENCI's account of the run; the "
        "BigScience model page says about 150), as Megatron-DeepSpeed logs it: eq. 3 of "
        "Narayanan et al. with the factor 4 of --checkpoint-activations, which the run's "
        "launch script (bigscience train/tr11-176B-ml) sets",
        "megatron",
        156e12,
        _A100,
        ModelShape(176_247_000_000, 70, 14_336, 2048, 250_880),
        384,
        "training run",
    ),
    PublishedUtilisation(
        "GPT-NeoX-20B on 96 A100s",
        "Black et al. 2022, GPT-NeoX-20B (arXiv 2204.06745; black2022gptneox): 117 TFLOP/s per "
        "GPU on 96 A100 40GB; 20,556,201,984 parameters, 44 layers, h = 6,144, s = 2,048, "
        "vocabulary padded to 50,432. GPT-NeoX logs Megatron-DeepSpeed's eq. 3 with "
        "recomputation (its get_flops; activation checkpointing was on)",
        "megatron",
        117e12,
        _A100,
        ModelShape(20_556_201_984, 44, 6144, 2048, 50_432),
        96,
        "training run",
    ),
    *(
        PublishedUtilisation(
            f"Llama 3 405B on {gpus:,} H100s, {seq // 1024}K tokens",
            _LLAMA3.format(tflops=tflops, gpus=gpus, seq=seq, mfu=mfu),
            "palm",
            tflops * 1e12,
            _H100,
            _llama3_405b(seq),
            gpus,
            "training run",
        )
        for gpus, seq, tflops, mfu in (
            (8192, 8192, 430, "43%"),
            (16384, 8192, 400, "41%"),
            (16384, 131072, 380, "38%"),
        )
    ),
)
"""Every published utilisation chapters 14 and 15 quote, each with its source and count.

Six of these runs are also rows of ``data/published_runs.json`` (chapter 16's
planner), which records their step times instead; both give the same utilisation
(tests/test_compute.py checks it).
"""


@dataclass(frozen=True)
class Budget:
    """What a training run costs: FLOPs, wall-clock seconds, GPU-hours and money."""

    flops: int
    seconds: float
    gpu_hours: float
    cost: float

    @property
    def days(self) -> float:
        """Wall-clock days (86,400 s each)."""
        return self.seconds / 86_400


def utilisation_band(max_seq_len: int = 8192) -> tuple[float, float]:
    """``(lowest, highest)`` 6N utilisation of the published *training runs* of
    :data:`PUBLISHED_UTILISATION` (not benchmarks) at up to ``max_seq_len`` tokens per
    sequence: the band chapter 15 holds a measured MFU against, and chapter 16 a planned
    one."""
    longest = _checks.count("max_seq_len", max_seq_len, minimum=1)
    shares = [
        run.utilisation("6n")
        for run in PUBLISHED_UTILISATION
        if run.kind == "training run" and run.shape.seq_len <= longest
    ]
    if not shares:
        raise ValueError(f"max_seq_len leaves no published training run, got {max_seq_len}")
    return min(shares), max(shares)


def training_budget(
    params: float,
    tokens: float,
    gpus: int,
    peak_flops: float,
    mfu: float,
    price_per_gpu_hour: float,
) -> Budget:
    """FLOPs, time, GPU-hours and cost of training ``params`` parameters on ``tokens``.

    Time is :func:`training_seconds`; GPU-hours are that time multiplied by the
    number of GPUs, because every GPU is busy (and billed) for all of it; cost is
    GPU-hours times ``price_per_gpu_hour`` (an assumption: say which price).
    """
    seconds = training_seconds(params, tokens, gpus, peak_flops, mfu)
    price = _checks.positive("price_per_gpu_hour", price_per_gpu_hour)
    gpu_hours = seconds * int(gpus) / 3600
    return Budget(training_flops(params, tokens), seconds, gpu_hours, gpu_hours * price)


def mfu(tokens_per_second: float, params: float, gpus: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: the share of the GPUs' peak spent on the model's maths.

    ``tokens_per_second`` is the whole job's throughput (all GPUs together),
    ``peak_flops`` one GPU's peak in FLOP/s. Each token is credited with the
    book's ``6N`` FLOPs (:data:`FLOP_CONVENTIONS`): recomputation from activation
    checkpointing is not credited, which is what makes MFU comparable between
    runs; neither is attention's sequence-dependent work, which the model does
    need (:func:`convert_utilisation` restates the result in PaLM's count, which
    credits it).
    """
    throughput = _checks.positive("tokens_per_second", tokens_per_second)
    n = _checks.count("params", params)
    n_gpus = _checks.count("gpus", gpus, minimum=1)
    peak = _checks.positive("peak_flops", peak_flops)
    return sum(FLOPS_PER_PARAM_PER_TOKEN.values()) * n * throughput / (n_gpus * peak)


@dataclass(frozen=True)
class Phase:
    """One bar of a step timeline: ``name`` runs from ``start`` to ``end`` (seconds)."""

    name: str
    start: float
    end: float


def step_timeline(
    forward: float, backward: float, all_reduce: float, optimizer: float, overlap: float
) -> list[Phase]:
    """The phases of one data-parallel training step on a single GPU, in seconds.

    Forward runs first, then backward. The gradient all-reduce may start before
    backward ends: ``overlap`` is the share of the all-reduce (``0`` to ``1``)
    hidden under backward, because gradients of the last layers are ready first.
    It cannot start before backward does. The optimiser step waits for both.
    With one GPU there is nothing to reduce: pass ``all_reduce=0``.
    """
    for name, value in {"forward": forward, "backward": backward, "optimizer": optimizer}.items():
        _checks.positive(name, value)
    if all_reduce != 0:
        _checks.positive("all_reduce", all_reduce)
    hidden = _checks.fraction("overlap", overlap) * all_reduce
    backward_end = forward + backward
    comm_start = max(forward, backward_end - hidden)
    comm_end = comm_start + all_reduce
    optimizer_start = max(backward_end, comm_end)
    phases = [Phase("forward", 0.0, forward), Phase("backward", forward, backward_end)]
    if all_reduce:
        phases.append(Phase("all-reduce", comm_start, comm_end))
    phases.append(Phase("optimiser", optimizer_start, optimizer_start + optimizer))
    return phases
