"""Small real training runs that go wrong, and the safeguards that keep them right (chapter 13).

A tiny GPT (:mod:`trainscale.transformer`) learns a synthetic language: text
drawn from a random Markov chain over a small vocabulary, whose best possible
loss is known exactly (:func:`best_possible_loss`), so "trained" has a number
attached.
:func:`train` runs it with the book's schedule (:func:`trainscale.schedule.learning_rate`),
with or without warmup and gradient clipping (and, as remedies for spikes,
PaLM's :func:`z_loss`, QK-layernorm through ``GPTConfig.qk_norm``, or
AdamW's ``beta2``), and returns the loss, the gradient norm and the learning
rate of every step. :func:`noise_scale_run` also measures McCandlish et al.'s
gradient noise scale (:mod:`trainscale.batch_size`) at chosen steps of a run.
Runs are deterministic and the same on every CPU: the data and the weights come from seeds (drawn in
float64), every step is computed in float64 on one thread and its result
rounded once to fp32 values (:func:`model`), so the last-bit differences
between CPUs' kernels (about 1e-16) almost never change a stored weight.
Without that rounding they would: a run at a learning rate this high is
chaotic, and a difference of 1e-16 grows to the first printed digit.

:func:`adam_step_sizes` shows that only Adam's first step is the learning rate
whatever the batch. :func:`decay_comparison` shows, with PyTorch's own
optimisers, why Adam with an L2 penalty is not Adam with weight decay (Loshchilov and Hutter,
arXiv 1711.05101).
"""

from __future__ import annotations

import inspect
import math
import statistics
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from trainscale import _checks
from trainscale.batch_size import NoiseEstimate, noise_estimates, per_example_gradients
from trainscale.schedule import learning_rate
from trainscale.transformer import GPT, GPTConfig, gpt

CONFIG = GPTConfig(vocab=32, context=32, d_model=32, layers=2, heads=2)
"""The model of chapter 13's runs: 2 layers of width 32, a vocabulary of 32 tokens."""

OPTIMIZERS = ("sgd", "adamw")

LOSS_LIMIT = 100.0
"""Nats per token beyond which a run has diverged and is stopped.

A uniform guess over chapter 13's 32 tokens scores ln 32 = 3.47; a model 100
nats per token worse is confidently, absurdly wrong. A run that gets there
is blowing up: in float64 it would take many more steps to overflow, and
those last steps are chaotic (the step at which the loss becomes inf differs
between CPUs), so, like a run monitor, :func:`train` does not wait for inf.
"""


def transition_matrix(vocab: int = 32, seed: int = 0, sharpness: float = 3.0) -> torch.Tensor:
    """A random Markov chain over ``vocab`` tokens: row ``i`` is P(next token | token ``i``).

    Each row is the softmax of ``sharpness`` times standard normal draws, so a
    few likely successors take most of a row's probability: the language has
    structure to learn but is not deterministic. float64, rows sum to 1.
    """
    v = _checks.count("vocab", vocab, minimum=2)
    scale = _checks.positive("sharpness", sharpness)
    generator = torch.Generator().manual_seed(_checks.count("seed", seed))
    logits = torch.randn(v, v, generator=generator, dtype=torch.float64)
    return torch.softmax(scale * logits, dim=1)


def _check_chain(transitions: torch.Tensor) -> int:
    if not isinstance(transitions, torch.Tensor) or transitions.dim() != 2:
        raise ValueError("transitions must be a square 2-D torch.Tensor of probabilities")
    v = transitions.shape[0]
    rows_sum_to_one = torch.allclose(
        transitions.sum(dim=1).double(), torch.ones(v, dtype=torch.float64)
    )
    if transitions.shape != (v, v) or bool((transitions < 0).any()) or not rows_sum_to_one:
        raise ValueError("transitions must be square, non-negative, with rows summing to 1")
    return v


def best_possible_loss(transitions: torch.Tensor, seq: int) -> float:
    """The lowest mean loss (nats per token) any model can reach on
    :func:`sample_batches` text of ``seq`` predicted tokens per sequence.

    Predicting token ``t + 1`` from token ``t``, no model can beat the entropy
    of row ``t`` of the chain, ``-sum_j P[t, j] log P[t, j]``. Token ``t`` is
    distributed as ``u P^t`` (``u`` uniform: sequences start anywhere), so the
    best loss is the mean over positions ``t = 0 .. seq - 1`` of ``u P^t``
    times those entropies: a model that has learnt the chain exactly reaches it.
    """
    _check_chain(transitions)
    length = _checks.count("seq", seq, minimum=1)
    p = transitions.double()
    plogp = torch.where(p > 0, p * p.log(), torch.zeros_like(p))
    row_entropy = -plogp.sum(dim=1)
    distribution = torch.full((p.shape[0],), 1.0 / p.shape[0], dtype=torch.float64)
    total = 0.0
    for _ in range(length):
        total += float(distribution @ row_entropy)
        distribution = distribution @ p
    return total / length


def sample_batches(
    transitions: torch.Tensor, steps: int, batch: int, seq: int, seed: int = 0
) -> torch.Tensor:
    """``steps`` batches of ``batch`` sequences of ``seq + 1`` tokens drawn from the chain.

    Shape ``(steps, batch, seq + 1)``: a model reads tokens ``[:-1]`` and
    predicts ``[1:]``. The first token of each sequence is uniform.
    """
    v = _check_chain(transitions)
    n_steps = _checks.count("steps", steps, minimum=1)
    n_batch = _checks.count("batch", batch, minimum=1)
    length = _checks.count("seq", seq, minimum=1)
    generator = torch.Generator().manual_seed(_checks.count("seed", seed))
    # Inverse-CDF sampling: the next token is the first whose cumulative
    # probability exceeds a uniform draw (clamped against rounding at the end).
    cumulative = transitions.double().cumsum(dim=1)
    draws = torch.rand(length, n_steps * n_batch, 1, generator=generator, dtype=torch.float64)
    tokens = torch.empty(n_steps * n_batch, length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(v, (n_steps * n_batch,), generator=generator)
    for t in range(length):
        following = torch.searchsorted(cumulative[tokens[:, t]], draws[t], right=True)
        tokens[:, t + 1] = following.squeeze(1).clamp_(max=v - 1)
    return tokens.view(n_steps, n_batch, length + 1)


@dataclass(frozen=True)
class Run:
    """What a training run logged, one entry per step taken.

    ``grad_norms`` are global gradient norms *before* clipping (what a run
    should log); ``lrs`` the learning rate each step used. A run stops at the
    first step whose loss is not finite or above :data:`LOSS_LIMIT` (that loss
    is kept), so a diverged run is shorter than the ``steps`` it asked for.
    """

    losses: tuple[float, ...]
    grad_norms: tuple[float, ...]
    lrs: tuple[float, ...]
    steps: int

    @property
    def diverged(self) -> bool:
        """True if the loss became inf or NaN, or passed :data:`LOSS_LIMIT`."""
        return not self.losses[-1] <= LOSS_LIMIT

    def final_loss(self, last: int = 20) -> float:
        """Mean loss of the ``last`` steps (inf if the run diverged)."""
        n = _checks.count("last", last, minimum=1)
        if self.diverged:
            return math.inf
        return statistics.fmean(self.losses[-n:])


def outcome(run: Run, best_loss: float) -> str:
    """One line on how ``run`` ended: the step at which it passed :data:`LOSS_LIMIT`,
    or its :meth:`Run.final_loss` (nats per token) and how far that is above
    ``best_loss`` (e.g. :func:`best_possible_loss`), as a percentage."""
    best = _checks.positive("best_loss", best_loss)
    if run.diverged:
        return f"diverged, loss above {LOSS_LIMIT:g} nats at step {len(run.losses) - 1}"
    final = run.final_loss()
    return f"final loss {final:.3f} nats, {final / best - 1:.1%} above the best"


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch on one thread (same operation order every time), then restore."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _round_to_fp32(params: Sequence[torch.Tensor]) -> None:
    """Round float64 ``params`` in place to the nearest fp32 values (exactly
    representable in float64), the same on every CPU."""
    with torch.no_grad():
        for p in params:
            p.copy_(p.float())


def model(config: GPTConfig = CONFIG, seed: int = 0) -> GPT:
    """The model :func:`train` starts from: ``gpt(config, seed)`` drawn and held
    in float64 (its arithmetic is float64), each weight rounded to fp32.

    Draws in float64 are the same on every CPU; fp32 values keep the weights
    on a grid 2**29 times coarser than float64's rounding, so a kernel's
    last-bit difference in a step almost never moves a weight to another value.
    """
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    fresh = gpt(config, _checks.count("seed", seed), dtype=torch.float64)
    _round_to_fp32(list(fresh.parameters()))
    return fresh


def train(
    peak: float,
    warmup: int = 0,
    clip: float | None = None,
    *,
    steps: int = 150,
    optimizer: str = "sgd",
    batch: int = 16,
    config: GPTConfig = CONFIG,
    seed: int = 0,
    z_loss: float = 0.0,
    beta2: float = 0.95,
) -> Run:
    """Train a fresh tiny GPT on the Markov language for ``steps`` steps.

    The learning rate follows ``learning_rate(step, peak, warmup, steps)``:
    linear warmup over ``warmup`` steps (0: none), then cosine decay to a tenth
    of the peak. ``clip`` is the largest global gradient norm allowed
    (``torch.nn.utils.clip_grad_norm_``); ``None`` clips nothing.
    ``optimizer`` is ``"sgd"`` (momentum 0.9) or ``"adamw"`` (betas 0.9 and
    ``beta2``, no weight decay). ``z_loss`` adds PaLM's auxiliary loss,
    ``z_loss`` times the mean over tokens of ``log(Z)^2`` (``Z``: the sum of the
    exponentiated output logits), to the loss that is differentiated; the
    logged loss stays the cross-entropy alone. ``config.qk_norm`` switches on
    QK-layernorm. ``seed`` fixes the weights, the chain and the data;
    every batch is fresh text (``batch`` sequences of ``config.context`` tokens).
    The model is :func:`model`'s: every step is computed in float64 and the
    weights are rounded to fp32 values after it, so a run is the same on every
    CPU. It stops early if its loss is not finite or above :data:`LOSS_LIMIT`.
    """
    return _train(
        peak, warmup, clip, steps, optimizer, batch, config, seed, z_loss, beta2, watch=None
    )


def train_many(runs: Mapping[str, Mapping[str, Any]], threads: int | None = None) -> dict[str, Run]:
    """Several :func:`train` runs side by side, ``threads`` at a time (``None``: all of
    them at once): the same runs, bit for bit, as calling :func:`train` on each in turn,
    in about ``1/threads`` of the time on as many cores.

    All at once is the default because runs differ in length (a diverging run stops
    early): with a thread per run the cores stay busy until the longest run ends,
    while with as many threads as cores the last run may start late and finish alone.
    On two cores, three runs take about half their total time instead of two thirds;
    time-sharing costs a few per cent of CPU time.

    ``runs`` maps a name to :func:`train`'s keyword arguments (``peak`` among them);
    the result maps the same names to their :class:`Run`. Each run is computed on a
    thread of its own, and torch computes each operation on one thread (the one that
    calls it; the intra-op pool is set to one thread for all of them), so every run
    does the same arithmetic in the same order as alone. The models are drawn one at
    a time (drawing uses torch's global generator). A run whose config has dropout
    draws from that generator at every step, so those runs go first, one after
    another, as :func:`train` would run them.
    """
    n = len(runs) if threads is None else _checks.count("threads", threads, minimum=1)
    signature = inspect.signature(train)
    for name, kwargs in runs.items():
        try:
            signature.bind(**kwargs)
        except TypeError as error:
            raise ValueError(f"runs[{name!r}] are not train()'s arguments: {error}") from None
    together = {
        k: v for k, v in runs.items() if _checked_config(v.get("config", CONFIG)).dropout == 0
    }
    with _one_thread():
        done = {name: _train_from(kwargs) for name, kwargs in runs.items() if name not in together}
        with ThreadPoolExecutor(max_workers=max(n, 1)) as pool:
            started = {name: pool.submit(_train_from, kwargs) for name, kwargs in together.items()}
            done |= {name: future.result() for name, future in started.items()}
    return {name: done[name] for name in runs}


def _train_from(kwargs: Mapping[str, Any]) -> Run:
    """:func:`train` with these keyword arguments, on the calling thread as it is set."""
    arguments = inspect.signature(train).bind(**kwargs)
    arguments.apply_defaults()
    a = arguments.arguments
    return _train(
        a["peak"], a["warmup"], a["clip"], a["steps"], a["optimizer"], a["batch"], a["config"],
        a["seed"], a["z_loss"], a["beta2"], watch=None, own_thread_setting=False,
    )  # fmt: skip


_GLOBAL_GENERATOR = threading.Lock()
"""Held while a model is drawn: :func:`trainscale.transformer.gpt` seeds torch's global
generator (inside ``fork_rng``), which threads would otherwise share mid-draw."""


def _checked_config(config: object) -> GPTConfig:
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    return config


def _train(
    peak: float,
    warmup: int,
    clip: float | None,
    steps: int,
    optimizer: str,
    batch: int,
    config: GPTConfig,
    seed: int,
    z_loss: float,
    beta2: float,
    watch: Callable[[int, GPT], None] | None,
    own_thread_setting: bool = True,
) -> Run:
    """:func:`train`'s loop; ``watch(step, net)``, if given, sees the weights
    before each step and once more after the last one (``step == steps``).
    ``own_thread_setting``: set torch to one thread for the run and restore it after
    (:func:`train_many` sets it once for all its runs instead)."""
    lr_peak = _checks.positive("peak", peak)
    n_steps = _checks.count("steps", steps, minimum=1)
    w = _checks.count("warmup", warmup)
    if w >= n_steps:
        raise ValueError(f"warmup must be in [0, steps) = [0, {n_steps}), got {warmup!r}")
    max_norm = math.inf if clip is None else _checks.positive("clip", clip)
    kind = _checks.choice("optimizer", optimizer, OPTIMIZERS)
    config = _checked_config(config)
    seed = _checks.count("seed", seed)
    z_weight = _checks.non_negative("z_loss", z_loss)
    b2 = _checks.fraction("beta2", beta2)
    if b2 == 1.0:
        raise ValueError(f"beta2 must be a number in [0, 1), got {beta2!r}")
    chain = transition_matrix(config.vocab, seed)
    data = sample_batches(chain, n_steps, batch, config.context, seed + 1)
    losses, norms, lrs = [], [], []
    with _one_thread() if own_thread_setting else nullcontext():
        with _GLOBAL_GENERATOR:
            net = model(config, seed)
        params = list(net.parameters())
        if kind == "sgd":
            opt = torch.optim.SGD(params, lr=lr_peak, momentum=0.9)
        else:
            opt = torch.optim.AdamW(params, lr=lr_peak, betas=(0.9, b2), weight_decay=0.0)
        for step, tokens in enumerate(data):
            if watch is not None:
                watch(step, net)
            lr = learning_rate(step, lr_peak, w, n_steps)
            for group in opt.param_groups:
                group["lr"] = lr
            loss, language_loss = _losses(net, tokens, z_weight)
            opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            losses.append(language_loss)
            norms.append(norm.item())
            lrs.append(lr)
            if not losses[-1] <= LOSS_LIMIT:  # inf, NaN or above the limit
                break
            opt.step()
            _round_to_fp32(params)
        else:
            if watch is not None:
                watch(n_steps, net)
    return Run(tuple(losses), tuple(norms), tuple(lrs), n_steps)


def _losses(net: GPT, tokens: torch.Tensor, z_weight: float) -> tuple[torch.Tensor, float]:
    """The loss to differentiate and the cross-entropy to log (nats per token)."""
    if z_weight == 0.0:
        loss = net.loss(tokens[:, :-1], tokens[:, 1:])
        return loss, loss.item()
    logits = net(tokens[:, :-1]).flatten(0, -2)
    cross_entropy = F.cross_entropy(logits, tokens[:, 1:].flatten())
    return cross_entropy + z_weight * z_loss(logits), cross_entropy.item()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """PaLM's auxiliary z-loss before its coefficient: the mean over positions of
    ``log(Z)^2``, where ``Z = sum_j exp(logits_j)`` over the vocabulary (last dim).

    Zero when every softmax normaliser is 1; it pulls ``log Z`` towards 0, so the
    output logits cannot drift far up or down together (PaLM weighted it 1e-4).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1:
        raise ValueError("logits must be a tensor whose last dimension is the vocabulary")
    return torch.logsumexp(logits, dim=-1).pow(2).mean()


def sequence_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (..., vocab) against ``targets`` (...): the
    loss of :meth:`GPT.loss`, for :func:`trainscale.batch_size.per_example_gradients`."""
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


@dataclass(frozen=True)
class NoiseScaleRun:
    """A :func:`train` run and, at each of the steps ``at``, McCandlish et al.'s
    estimates from per-sequence gradients on held-out text (``estimates[i]`` at
    ``at[i]``: the weights after that many steps), the mean loss on that
    text (``held_out_losses[i]``, nats per token), and the same estimates from
    each half of the held-out sequences on its own (``halves[i]``): how far
    apart those two land shows how noisy the estimate is."""

    run: Run
    at: tuple[int, ...]
    estimates: tuple[NoiseEstimate, ...]
    held_out_losses: tuple[float, ...]
    halves: tuple[tuple[NoiseEstimate, NoiseEstimate], ...]

    @property
    def noise_scales(self) -> tuple[float, ...]:
        """``B_simple`` at each step of ``at``, in sequences of ``config.context`` tokens."""
        return tuple(e.simple_noise_scale for e in self.estimates)


def noise_scale_run(
    peak: float,
    warmup: int = 0,
    clip: float | None = None,
    *,
    at: Sequence[int],
    examples: int = 256,
    steps: int = 150,
    optimizer: str = "sgd",
    batch: int = 16,
    config: GPTConfig = CONFIG,
    seed: int = 0,
) -> NoiseScaleRun:
    """A :func:`train` run (same arguments, same result) that also measures the
    gradient noise scale of its weights after each number of steps in ``at``.

    At each such point, ``examples`` held-out sequences (drawn from the same
    chain with seed ``seed + 2``, the same sequences every time) each give the
    gradient of their own mean loss (:func:`trainscale.batch_size.per_example_gradients`,
    in float64), and :func:`trainscale.batch_size.noise_estimates` turns them into
    unbiased estimates of ``|G|^2`` and ``tr(Sigma)``. One example is one
    sequence: the batch sizes that come out are counted in sequences.
    """
    n_steps = _checks.count("steps", steps, minimum=1)
    wanted = sorted({_checks.count("at", s) for s in at})
    if not wanted or wanted[-1] > n_steps:
        raise ValueError(f"at must hold steps in [0, steps] = [0, {n_steps}], got {list(at)!r}")
    n = _checks.count("examples", examples, minimum=4)
    config = _checked_config(config)
    chain = transition_matrix(config.vocab, _checks.count("seed", seed))
    held_out = sample_batches(chain, 1, n, config.context, seed + 2)[0]
    found: dict[int, tuple[NoiseEstimate, float, tuple[NoiseEstimate, NoiseEstimate]]] = {}

    def measure(step: int, net: GPT) -> None:
        if step in wanted:
            inputs, targets = held_out[:, :-1], held_out[:, 1:]
            grads = per_example_gradients(net, inputs, targets, sequence_loss)
            with torch.no_grad():
                loss = net.loss(inputs, targets).item()
            halves = (noise_estimates(grads[: n // 2]), noise_estimates(grads[n // 2 :]))
            found[step] = (noise_estimates(grads), loss, halves)

    run = _train(
        peak, warmup, clip, n_steps, optimizer, batch, config, seed, 0.0, 0.95, watch=measure
    )
    if len(found) < len(wanted):
        raise ValueError(f"the run diverged at step {len(run.losses) - 1}, before every step in at")
    return NoiseScaleRun(
        run,
        tuple(wanted),
        tuple(found[s][0] for s in wanted),
        tuple(found[s][1] for s in wanted),
        tuple(found[s][2] for s in wanted),
    )


def first_rise(values: Sequence[float], factor: float = 2.0, window: int = 10) -> int | None:
    """The first index whose value exceeds ``factor`` times the median of the
    ``window`` values before it (a non-finite value always does); ``None`` if
    none does. The alarm a run monitor would raise on a logged curve."""
    f = _checks.positive("factor", factor)
    n = _checks.count("window", window, minimum=1)
    for i in range(n, len(values)):
        if not math.isfinite(values[i]) or values[i] > f * statistics.median(values[i - n : i]):
            return i
    return None


def linear_scaling_gap(lr: float, k: int = 8, batch: int = 32, seed: int = 0) -> float:
    """How far ``k`` SGD steps on batches of ``batch`` at ``lr`` land from one
    step on all ``k * batch`` examples at ``k * lr`` (the linear scaling rule).

    The model is least-squares linear regression on 16 random features (float64,
    seeded). Both start from the same weights; the result is the distance
    between the two endpoints divided by the distance the large step moved.
    The ``k`` small steps each see the gradient at a point the previous steps
    already moved, so the gap grows with ``lr`` (it is second order in it): the
    rule holds while the gradient changes little over ``k`` steps.
    """
    rate = _checks.positive("lr", lr)
    n_steps = _checks.count("k", k, minimum=1)
    n = _checks.count("batch", batch, minimum=1)
    generator = torch.Generator().manual_seed(_checks.count("seed", seed))
    features = torch.randn(n_steps, n, 16, generator=generator, dtype=torch.float64)
    targets = features @ torch.randn(16, generator=generator, dtype=torch.float64)
    start = torch.zeros(16, dtype=torch.float64)

    def gradient(w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Gradient of the mean of (x w - y)^2 / 2 over the rows of x."""
        return x.T @ (x @ w - y) / len(y)

    small = start.clone()
    for x, y in zip(features, targets, strict=True):
        small = small - rate * gradient(small, x, y)
    large = start - n_steps * rate * gradient(start, features.flatten(0, 1), targets.flatten())
    return float((small - large).norm() / (large - start).norm())


def adam_step_sizes(
    batches: Sequence[int],
    *,
    steps: int = 200,
    signal: float = 1.0,
    noise: float = 8.0,
    weights: int = 10_000,
    beta2: float = 0.95,
    seed: int = 0,
) -> dict[int, tuple[float, float]]:
    """How far AdamW moves weights at its first step and later, for each batch size.

    Every weight's true gradient is ``signal``; one example's gradient adds
    standard normal noise times ``noise``, so a batch of ``B`` examples gives
    ``signal + noise * z / sqrt(B)`` (``z`` drawn in float64, seeded; the
    weights do not change the gradients). ``torch.optim.AdamW`` (betas 0.9 and
    ``beta2``, learning rate 1, no weight decay) runs ``steps`` steps on them.
    The result maps each batch size to ``(first, late)``: the median over the
    weights of ``|step|`` at the first step, and the mean over the weights and
    the last half of the steps of the step along the true gradient (its
    useful part), both in units of the learning rate.
    """
    sizes = [_checks.count("batches", b, minimum=1) for b in batches]
    if not sizes:
        raise ValueError("batches must hold at least one batch size, got none")
    n_steps = _checks.count("steps", steps, minimum=2)
    g = _checks.positive("signal", signal)
    sigma = _checks.non_negative("noise", noise)
    n = _checks.count("weights", weights, minimum=1)
    b2 = _checks.fraction("beta2", beta2)
    generator_seed = _checks.count("seed", seed)
    with _one_thread():
        return {size: _adam_steps(size, n_steps, g, sigma, n, b2, generator_seed) for size in sizes}


def _adam_steps(
    size: int, n_steps: int, g: float, sigma: float, n: int, b2: float, seed: int
) -> tuple[float, float]:
    """:func:`adam_step_sizes` for one batch size."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.zeros(n, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.AdamW([w], lr=1.0, betas=(0.9, b2), weight_decay=0.0)
    useful = []
    first = 0.0
    for step in range(n_steps):
        z = torch.randn(n, generator=generator, dtype=torch.float64)
        before = w.detach().clone()
        w.grad = g + sigma * z / math.sqrt(size)
        opt.step()
        moved = w.detach() - before
        if step == 0:
            first = float(moved.abs().median())
        if step >= n_steps // 2:
            useful.append(float(-moved.mean()))  # along -gradient: the true descent
    return first, statistics.fmean(useful)


def decay_comparison(
    scales: Sequence[float] = (1.0, 1e-3),
    *,
    lr: float = 1e-3,
    weight_decay: float = 0.1,
    steps: int = 1000,
    seed: int = 0,
) -> dict[str, list[float]]:
    """How much a penalty shrinks weights whose gradients differ in size, under
    Adam with an L2 penalty and under AdamW (decoupled weight decay).

    Weight ``i`` starts at 1 and receives ``scales[i] * noise[t]`` as its
    gradient at step ``t``: the same zero-mean noise for every weight, only
    scaled, so without any penalty Adam (which divides by the gradient's size)
    moves them all identically. Each optimiser is run with the penalty and
    without it on the same gradients; the result is, per weight, the final
    weight divided by the final weight without the penalty. 1 means the
    penalty did nothing. ``torch.optim.Adam(weight_decay=...)`` adds
    ``weight_decay * w`` to the gradient (L2); ``torch.optim.AdamW`` shrinks
    ``w`` by ``lr * weight_decay * w`` outside Adam's normalisation.
    """
    if len(scales) == 0:
        raise ValueError("scales must hold at least one gradient scale, got none")
    sizes = torch.tensor([_checks.positive("scales", s) for s in scales], dtype=torch.float64)
    rate = _checks.positive("lr", lr)
    decay = _checks.positive("weight_decay", weight_decay)
    n_steps = _checks.count("steps", steps, minimum=1)
    generator = torch.Generator().manual_seed(_checks.count("seed", seed))
    noise = torch.randn(n_steps, generator=generator, dtype=torch.float64)

    def final(kind: type[torch.optim.Optimizer], penalty: float) -> torch.Tensor:
        w = torch.ones(len(sizes), dtype=torch.float64, requires_grad=True)
        opt = kind([w], lr=rate, weight_decay=penalty)
        for g in noise:
            w.grad = sizes * g
            opt.step()
        return w.detach()

    return {
        name: (final(kind, decay) / final(kind, 0.0)).tolist()
        for name, kind in (("Adam + L2", torch.optim.Adam), ("AdamW", torch.optim.AdamW))
    }
