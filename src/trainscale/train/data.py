"""The capstone's data: every step's global batch from ``(seed, step)`` alone, and each
rank's slice of it.

Whatever the layout, the job trains on the same data as one process would
(:func:`global_batch`), so the data loader's whole state is the step count.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from trainscale import _checks
from trainscale.train.config import Layout, TrainConfig


def global_batch(
    seed: int, step: int, sequences: int, seq_len: int, vocab: int, strides: int
) -> torch.Tensor:
    """Every rank's data for optimiser step ``step``: ``sequences`` rows of
    ``seq_len + 1`` token ids (inputs are a row without its last token, targets
    without its first).

    Each row counts up from a random start by a random stride in
    ``1..strides``, modulo ``vocab`` (stride 3: 61, 0, 3, 6, ...). The first
    target of a row cannot be foreseen; every later one follows from the two
    tokens before it, so the best possible loss is :func:`loss_floor`. The
    random draws come from a generator seeded with ``(seed, step)`` alone: the
    same step always gets the same batch, whichever process asks and whenever.
    """
    rng = np.random.default_rng([_checks.count("seed", seed), _checks.count("step", step)])
    count = _checks.count("sequences", sequences, minimum=1)
    v = _checks.count("vocab", vocab, minimum=2)
    if not 1 <= _checks.count("strides", strides, minimum=1) < v:
        raise ValueError(f"strides must be in [1, vocab) = [1, {v}), got {strides!r}")
    length = _checks.count("seq_len", seq_len, minimum=1)
    start = rng.integers(0, v, size=(count, 1))
    stride = rng.integers(1, strides + 1, size=(count, 1))
    return torch.from_numpy((start + stride * np.arange(length + 1)) % v)


def micro_batch(
    batch: torch.Tensor, rank: int, world_size: int, grad_accum: int, micro_step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(inputs, targets)`` that rank ``rank`` trains on in micro-step ``micro_step``.

    ``batch`` (from :func:`global_batch`) has ``world_size * grad_accum * b``
    rows: rank ``r`` owns the ``r``-th of ``world_size`` equal blocks and takes
    the ``micro_step``-th of ``grad_accum`` slices of ``b`` rows from it. The
    slices of all ranks and micro-steps cover the batch exactly once.
    """
    n = _checks.count("world_size", world_size, minimum=1)
    k = _checks.count("grad_accum", grad_accum, minimum=1)
    r = _checks.count("rank", rank)
    m = _checks.count("micro_step", micro_step)
    if r >= n:
        raise ValueError(f"rank must be in [0, world_size) = [0, {n}), got {rank!r}")
    if m >= k:
        raise ValueError(f"micro_step must be in [0, grad_accum) = [0, {k}), got {micro_step!r}")
    if batch.ndim != 2 or batch.shape[0] % (n * k) or batch.shape[1] < 2:
        raise ValueError(
            f"batch must have a multiple of world_size * grad_accum = {n * k} rows "
            f"and at least 2 columns, got shape {tuple(batch.shape)}"
        )
    b = batch.shape[0] // (n * k)
    rows = batch[(r * k + m) * b : (r * k + m + 1) * b]
    return rows[:, :-1], rows[:, 1:]


def loss_floor(seq_len: int, strides: int) -> float:
    """The lowest mean cross-entropy (nats per token) a model can reach on
    :func:`global_batch` data: ``ln(strides)`` for a row's first target, which
    only the unseen stride decides, and 0 for the ``seq_len - 1`` others."""
    length = _checks.count("seq_len", seq_len, minimum=1)
    return math.log(_checks.count("strides", strides, minimum=1)) / length


def tokens_per_step(config: TrainConfig, layout: Layout) -> int:
    """Tokens the whole job trains on in one optimiser step (the effective batch):
    every data-parallel rank's ``grad_accum`` micro-batches of ``micro_batch``
    sequences of ``seq_len`` tokens."""
    return layout.dp * config.grad_accum * config.micro_batch * config.seq_len
