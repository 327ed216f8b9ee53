"""How much arithmetic a training run needs, and how long it takes (chapters 01, 11, 12).

A dense model with ``N`` parameters spends about 2 FLOPs per parameter per
token in the forward pass (one multiply, one add) and about 4 in the backward
pass (the gradient with respect to the layer's input *and* with respect to its
weights), so training costs ``6 * N * D`` FLOPs for ``D`` tokens
(Kaplan et al., arXiv 2001.08361). Attention's own sequence-squared work is not
in this count; :func:`attention_training_flops` adds it, and chapter 11
measures both against PyTorch's FLOP counter.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainscale import _checks

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


FLOPS_CONVENTIONS = ("6n", "palm", "megatron")
"""The ways published runs count training FLOPs per token (see :func:`flops_per_token`)."""


def flops_per_token(
    params: float, layers: int, hidden: int, seq_len: int, vocab: int, convention: str = "6n"
) -> float:
    """Training FLOPs per token under a published convention.

    * ``"6n"``: ``6 N``, the book's count (:func:`training_flops` of one token);
    * ``"palm"``: ``6 N + 12 L h s``, adding the attention scores and their product
      with the values (:func:`attention_training_flops`; PaLM's MFU, Chowdhery et al.,
      arXiv 2204.02311, used by Llama 3);
    * ``"megatron"``: Narayanan et al.'s equation 3 (arXiv 2104.04473) per token,
      ``96 L h^2 (1 + s/(6h) + V/(16 L h))``, which counts four passes through the
      layers (forward, the forward that full recomputation repeats, and backward
      twice as long) and the logits.

    ``params`` is ``N``, ``layers`` ``L``, ``hidden`` ``h``, ``seq_len`` ``s`` and
    ``vocab`` ``V``.
    """
    n = _checks.count("params", params)
    n_layers = _checks.count("layers", layers, minimum=1)
    h = _checks.count("hidden", hidden, minimum=1)
    s = _checks.count("seq_len", seq_len, minimum=1)
    v = _checks.count("vocab", vocab, minimum=1)
    kind = _checks.choice("convention", convention, FLOPS_CONVENTIONS)
    if kind == "6n":
        return training_flops(n, 1)
    if kind == "palm":
        return training_flops(n, 1) + attention_training_flops(n_layers, s, h, 1)
    return 96 * n_layers * h * h * (1 + s / (6 * h) + v / (16 * n_layers * h))


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
    ``peak_flops`` one GPU's peak in FLOP/s. Only the ``6N`` FLOPs the model
    needs per token count: recomputation from activation checkpointing does not,
    which is what makes MFU comparable between runs.
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
