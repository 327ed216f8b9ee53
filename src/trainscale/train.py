"""The capstone of chapters 13 and 16: a small GPT trained on any layout, restartably.

The model is the book's decoder (:mod:`trainscale.transformer`) with fused
attention and an untied head. One script puts the book's techniques together,
composed as torchtitan composes them, over one ``DeviceMesh`` whose dimensions
are ``["pp", "dp_replicate", "dp_shard", "cp", "tp"]``:

* pipeline parallelism (``--pp``): the decoder split by layers into stages
  (the first holds the embeddings, the last the final norm and head), run by
  ``torch.distributed.pipelining`` with ``Schedule1F1B`` or
  ``ScheduleInterleaved1F1B`` (``--pp-schedule``, ``--virtual-stages``);
* tensor parallelism with sequence parallelism (``--tp``) on each stage's
  blocks (DTensor ``parallelize_module``), then activation checkpointing
  (``--checkpoint-activations``);
* context parallelism (``--cp``): each sequence split over the ``cp`` ranks,
  attention computed as ring attention (chapter 14,
  :func:`trainscale.workers.context.ring_attention`);
* FSDP2's ``fully_shard`` over the data-parallel ranks (``--dp-shard``, and the
  ``cp`` ranks with them, whose gradients are averaged too), HSDP when
  ``--dp-replicate`` > 1; ``--parallel ddp`` and ``--parallel fsdp`` are
  shorthand for ``--dp-replicate WORLD`` and ``--dp-shard WORLD``;

and bf16 autocast, gradient accumulation (the pipeline's micro-batches under
``--pp``), warmup plus cosine decay, global-norm clipping, a log of loss,
gradient norm, learning rate, throughput and MFU, and checkpoints it resumes
from after a crash, on the same layout or another. Eight CPU processes on a
laptop (gloo), started by the package's launcher, which keeps every listening
socket on 127.0.0.1 (:mod:`trainscale.launch`; plain ``torchrun`` listens on
every interface)::

    python -m trainscale.launch --nproc-per-node=8 --max-restarts=1 \\
        -m trainscale.train --tp 2 --pp 2 --dp-shard 2 --grad-accum 4 --ckpt-dir /tmp/capstone

The same command on a node with eight GPUs runs on NCCL, one GPU per process
(:func:`trainscale.distributed.backend_and_device`). Whatever the layout, the
job trains on the same data as one process would (:func:`global_batch`), and
its loss is the mean over every token of the global batch.

Run alone, without a launcher, ``python -m trainscale.train --steps 4`` trains as
one process (a layout of several ranks says, in one line, how to launch it), and a
bad flag ends it with one line naming the flag (:func:`main`). ``--warmup`` and
``--grad-accum`` default to what the other flags allow: ``min(10, --steps // 10)``
warmup steps, and one micro-batch per step, or one per pipeline stage with ``--pp``
(:func:`default_warmup`, :func:`default_grad_accum`).

What makes a restart exact:

* the data of optimiser step ``s`` is a function of ``(seed, s)`` alone
  (:func:`global_batch`), so the data loader's whole state is the step count;
* a checkpoint holds the model, the optimiser (Adam's moments and step
  counts), the step, from which the learning rate follows, and the data
  position, every tensor under its name in the unsplit model
  (:class:`TrainState`), so that another layout can load it, each rank
  reading the pieces it needs. ``torch.distributed.checkpoint`` writes each rank's shards in
  parallel; the folder is renamed to its final name only once every rank has
  finished, so a crash mid-save leaves no checkpoint that looks complete;
* the model has no dropout and the same seed initialises it on every rank.

``--fail-at-step K --fail-rank R`` makes rank ``R`` exit abruptly in the middle
of step ``K`` (counted from 0), on the first attempt only: ``torchrun`` counts
its restarts in ``TORCHELASTIC_RESTART_COUNT``. With ``--max-restarts=1``,
torchrun then stops the other ranks, starts them all again, and the run resumes
from its latest complete checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from trainscale import _checks, compute, schedule
from trainscale.distributed import backend_and_device, run_alone, torchrun_main
from trainscale.transformer import GPT, GPTConfig, gpt, matmul_weights, parameter_counts

FAIL_EXIT_CODE = 17
"""Exit status of the rank that ``--fail-at-step`` makes crash."""

LOSS_RTOL = 1e-5
"""How closely (relative) the per-step losses of two layouts of the same run agree.

Both train the same data from the same weights; only the order of float32
additions differs (matrix products split by tensor parallelism, gradients
summed by reduce-scatter across data-parallel ranks, micro-batches summed in
another grouping, attention's softmax computed block by block by context
parallelism's ring attention). Each float32 addition rounds to within
``2**-24`` ~ 6e-8 relative, so sums taken in another order typically differ by
a few such units, and AdamW steps carry the differences into the weights.
Measured over 4-10 steps of the book's tiny models against one process: at
most 3e-7 relative without context parallelism, 1e-6 with it. 1e-5 keeps a
margin of 10 over that, and stays far below what a real mistake does: losing
the gradient of one micro-batch in eight (measured, same model) moves the next
steps' losses by 4e-3 to 9e-3 relative.
"""

GRAD_NORM_RTOL = 1e-3
"""How closely (relative) the gradient norms of two layouts agree. The norm sums the
squares of every gradient entry, each carrying the differences above plus the
rounding of the backward pass's own sums: measured within 6e-6
relative without context parallelism and 5e-5 with it (ring attention's
blockwise softmax). 1e-3 leaves a margin of 20; losing the gradient of one
micro-batch in eight changes the norm by 6 % to 30 % (measured)."""

CHECKPOINT_PREFIX = "step_"
"""A complete checkpoint is the folder ``step_<8-digit step>``; one being written
carries the suffix ``.partial`` until every rank has finished writing it."""


# --------------------------------------------------------------------------- arguments

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The device mesh's dimensions, outermost first, in torchtitan's order: pipeline
stages, replicated data parallelism, sharded data parallelism, context
parallelism, tensor parallelism (the innermost, whose collectives are the most
frequent, on the ranks that are closest)."""

PP_SCHEDULES = ("1f1b", "interleaved")
"""Pipeline schedules: ``Schedule1F1B`` (one stage per rank) or
``ScheduleInterleaved1F1B`` (``--virtual-stages`` stages per rank)."""


PROG = "python -m trainscale.train"

WARMUP_CAP = 10
"""``--warmup``'s default never exceeds this many steps (:func:`default_warmup`)."""


def default_warmup(steps: int) -> int:
    """``--warmup``'s default for a run of ``steps`` optimiser steps: a tenth of the run,
    at most :data:`WARMUP_CAP` steps, ``min(10, steps // 10)``. The default run of 100
    steps warms up for 10, one of 20 for 2, one of fewer than 10 steps (a first try,
    ``--steps 4``) not at all; it is always below ``steps``, as the schedule requires."""
    n = _checks.count("steps", steps, minimum=1)
    return min(WARMUP_CAP, n // 10)


def default_grad_accum(pp: int | None) -> int:
    """``--grad-accum``'s default: 1 micro-batch per step without a pipeline; with
    ``--pp P`` > 1, ``P``, the fewest either schedule takes (1F1B needs at least one
    micro-batch per stage, the interleaved schedule a multiple of the stages). More
    micro-batches shrink the pipeline's bubble (chapter 7) at the price of a larger
    global batch."""
    stages = 1 if pp is None else _checks.count("pp", pp, minimum=1)
    return stages


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``prog: error: message``: the
    usage of 34 flags would bury it (``--help`` shows them)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m trainscale.train``: under ``torchrun`` (or
    ``python -m trainscale.launch``), or alone as one process."""
    p = _Parser(
        prog=PROG,
        description=(
            "Train a small GPT on synthetic data, restartably: one process when run alone,"
            " or as many as python -m trainscale.launch (or torchrun) starts."
        ),
    )
    add = p.add_argument
    add(
        "--parallel",
        default=None,
        help="shorthand: ddp (--dp-replicate WORLD), fsdp (--dp-shard WORLD)",
    )
    add("--tp", type=int, default=None, help="tensor-parallel ranks (with sequence parallelism)")
    add("--pp", type=int, default=None, help="pipeline stages (ranks)")
    add("--dp-replicate", type=int, default=None, help="replicated data-parallel groups (HSDP)")
    add("--dp-shard", type=int, default=None, help="ranks the model state is sharded over (FSDP)")
    add("--cp", type=int, default=None, help="context-parallel ranks (ring attention)")
    add("--pp-schedule", default="1f1b", help="1f1b or interleaved")
    add("--virtual-stages", type=int, default=1, help="model chunks per pipeline rank")
    add("--steps", type=int, default=100, help="optimiser steps in the whole run")
    add("--micro-batch", type=int, default=8, help="sequences per rank per forward pass")
    add(
        "--grad-accum",
        type=int,
        default=None,
        help="micro-batches per step (pipelined: per stage); default: 1, or --pp if --pp > 1",
    )
    add("--lr", type=float, default=3e-3, help="peak learning rate")
    add(
        "--warmup",
        type=int,
        default=None,
        help="steps of linear warmup before cosine decay; default: min(10, --steps // 10)",
    )
    add("--lr-floor", type=float, default=0.1, help="final learning rate, as a share of --lr")
    add("--weight-decay", type=float, default=0.1, help="AdamW's decoupled weight decay")
    add("--clip", type=float, default=1.0, help="clip the global gradient norm (0: never)")
    add("--bf16", action="store_true", help="compute in bfloat16 under autocast")
    add("--checkpoint-activations", action="store_true", help="recompute each block in backward")
    add("--seed", type=int, default=0, help="seeds the weights and the data")
    add("--vocab", type=int, default=64, help="vocabulary size")
    add("--seq-len", type=int, default=32, help="tokens per sequence")
    add("--width", type=int, default=64, help="model width")
    add("--heads", type=int, default=4, help="attention heads per block")
    add("--layers", type=int, default=2, help="transformer blocks")
    add("--strides", type=int, default=4, help="the data's sequences step by 1..strides")
    add("--log-every", type=int, default=10, help="print a log line every this many steps")
    add("--peak-flops", type=float, default=None, help="one device's peak FLOP/s, for MFU")
    add("--ckpt-dir", default=None, help="folder for checkpoints (none: no checkpoints)")
    add("--ckpt-every", type=int, default=10, help="save a checkpoint every this many steps")
    add("--keep-checkpoints", type=int, default=2, help="complete checkpoints kept on disk")
    add("--final-weights", default=None, help="rank 0 saves the full final weights here")
    add("--fail-at-step", type=int, default=None, help="crash during this step, first try only")
    add("--fail-rank", type=int, default=0, help="the rank that --fail-at-step crashes")
    add("--deterministic", action="store_true", help="deterministic kernels (for GPUs)")
    return p


@dataclass(frozen=True)
class Layout:
    """How ``world`` ranks split the work: a size for each of :data:`DIMS`.

    Their product is the number of ranks. ``dp`` (= ``dp_replicate * dp_shard``)
    ranks see different data; the ``pp * cp * tp`` ranks of one data-parallel
    group see the same.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        """The mesh's shape, in the order of :data:`DIMS`."""
        return tuple(getattr(self, name) for name in DIMS)

    @property
    def world(self) -> int:
        """Ranks the layout needs."""
        return math.prod(self.sizes)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many different slices of the global batch run at once."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        """``TP 2 x PP 2 x DP 2 (replicate 1 x shard 2)``: the layout in words."""
        dp = f"DP {self.dp} (replicate {self.dp_replicate} x shard {self.dp_shard})"
        cp = f" x CP {self.cp}" if self.cp > 1 else ""
        return f"TP {self.tp} x PP {self.pp} x {dp}{cp}"


@dataclass(frozen=True)
class TrainConfig:
    """Everything one run needs, checked: built from the command line by :func:`parse_args`.

    The layout's sizes that were not given are ``None`` here; :meth:`layout`
    completes them for a number of ranks. ``warmup`` and ``grad_accum`` left ``None``
    take defaults that follow the other flags (:func:`default_warmup`,
    :func:`default_grad_accum`), so every field holds a number once the config is
    built. ``micro_batch`` is in sequences per
    data-parallel rank and micro-step, ``lr`` in units of the AdamW update,
    ``peak_flops`` in FLOP/s per device, ``ckpt_every`` and ``log_every`` in
    optimiser steps.
    """

    parallel: str | None = None
    tp: int | None = None
    pp: int | None = None
    dp_replicate: int | None = None
    dp_shard: int | None = None
    cp: int | None = None
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    steps: int = 100
    micro_batch: int = 8
    grad_accum: int | None = None
    lr: float = 3e-3
    warmup: int | None = None
    lr_floor: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    bf16: bool = False
    checkpoint_activations: bool = False
    seed: int = 0
    vocab: int = 64
    seq_len: int = 32
    width: int = 64
    heads: int = 4
    layers: int = 2
    strides: int = 4
    log_every: int = 10
    peak_flops: float | None = None
    ckpt_dir: str | None = None
    ckpt_every: int = 10
    keep_checkpoints: int = 2
    final_weights: str | None = None
    fail_at_step: int | None = None
    fail_rank: int = 0
    deterministic: bool = False

    def __post_init__(self) -> None:
        self._fill_defaults()
        self._check_training()
        self._check_model()
        self._check_layout()

    def _fill_defaults(self) -> None:
        """Give ``warmup`` and ``grad_accum`` their defaults where they were not given;
        a ``--steps`` or ``--pp`` out of range is left for the checks to name."""
        if self.warmup is None:
            with contextlib.suppress(ValueError):
                object.__setattr__(self, "warmup", default_warmup(self.steps))
        if self.grad_accum is None:
            pipelined = isinstance(self.pp, int) and self.pp > 1
            object.__setattr__(
                self, "grad_accum", default_grad_accum(self.pp if pipelined else None)
            )

    def _check_training(self) -> None:
        _checks.count("--steps", self.steps, minimum=1)
        _checks.count("--micro-batch", self.micro_batch, minimum=1)
        _checks.count("--grad-accum", self.grad_accum, minimum=1)
        _checks.positive("--lr", self.lr)
        if _checks.count("--warmup", self.warmup) >= self.steps:
            raise ValueError(
                f"--warmup must be in [0, --steps) = [0, {self.steps}), got {self.warmup}"
            )
        _checks.fraction("--lr-floor", self.lr_floor)
        _checks.non_negative("--weight-decay", self.weight_decay)
        _checks.non_negative("--clip", self.clip)  # 0: no clipping
        _checks.count("--seed", self.seed)
        _checks.count("--log-every", self.log_every, minimum=1)
        if self.peak_flops is not None:
            _checks.positive("--peak-flops", self.peak_flops)
        _checks.count("--ckpt-every", self.ckpt_every, minimum=1)
        _checks.count("--keep-checkpoints", self.keep_checkpoints, minimum=1)
        if self.fail_at_step is not None:
            _checks.count("--fail-at-step", self.fail_at_step, minimum=1)
        _checks.count("--fail-rank", self.fail_rank)

    def _check_model(self) -> None:
        _checks.count("--vocab", self.vocab, minimum=2)
        _checks.count("--seq-len", self.seq_len, minimum=1)
        _checks.count("--heads", self.heads, minimum=1)
        _checks.count("--layers", self.layers, minimum=1)
        if _checks.count("--width", self.width, minimum=1) % self.heads:
            raise ValueError(
                f"--width must be a multiple of --heads={self.heads}, got {self.width}"
            )
        if not 1 <= self.strides < self.vocab:
            raise ValueError(
                f"--strides must be in [1, --vocab) = [1, {self.vocab}), got {self.strides}"
            )

    def _check_layout(self) -> None:
        given = [name for name in DIMS if getattr(self, name) is not None]
        if self.parallel is not None:
            _checks.choice("--parallel", self.parallel, ("ddp", "fsdp"))
            if given:
                flag = "--" + given[0].replace("_", "-")
                raise ValueError(
                    f"--parallel must not be combined with {flag}: it is shorthand for "
                    "--dp-replicate WORLD (ddp) or --dp-shard WORLD (fsdp)"
                )
        for name in given:
            _checks.count("--" + name.replace("_", "-"), getattr(self, name), minimum=1)
        _checks.choice("--pp-schedule", self.pp_schedule, PP_SCHEDULES)
        v = _checks.count("--virtual-stages", self.virtual_stages, minimum=1)
        if self.pp_schedule == "1f1b" and v != 1:
            raise ValueError(f"--virtual-stages must be 1 with --pp-schedule 1f1b, got {v}")
        if self.pp_schedule == "interleaved" and v < 2:
            raise ValueError(
                f"--virtual-stages must be >= 2 with --pp-schedule interleaved, got {v}"
            )
        tp, pp, cp = (getattr(self, name) or 1 for name in ("tp", "pp", "cp"))
        if self.layers % (pp * v):
            raise ValueError(
                f"--layers must be a multiple of --pp x --virtual-stages = {pp * v}, "
                f"got {self.layers}"
            )
        if self.heads % tp:
            raise ValueError(f"--heads must be a multiple of --tp={tp}, got {self.heads}")
        if self.seq_len % (cp * tp):
            raise ValueError(
                f"--seq-len must be a multiple of --cp x --tp = {cp * tp} (context and "
                f"sequence parallelism split it), got {self.seq_len}"
            )
        if v > 1 and pp < 2:
            raise ValueError(f"--pp must be >= 2 with --pp-schedule interleaved, got {pp}")
        if pp > 1 and v == 1 and self.grad_accum < pp:
            raise ValueError(
                f"--grad-accum must be >= --pp={pp} for 1F1B (it is the number of "
                f"micro-batches in the pipeline), got {self.grad_accum}"
            )
        if v > 1 and self.grad_accum % pp:
            raise ValueError(
                f"--grad-accum must be a multiple of --pp={pp} for the interleaved "
                f"schedule (it is the number of micro-batches in the pipeline), "
                f"got {self.grad_accum}"
            )

    def layout(self, world_size: int) -> Layout:
        """The layout on ``world_size`` ranks; raises ``ValueError`` if the sizes'
        product is not ``world_size``. Sizes not given are 1, except that with no
        size given at all (or ``--parallel``) the ranks do data parallelism."""
        world = _checks.count("world_size", world_size, minimum=1)
        sizes = {name: getattr(self, name) for name in DIMS}
        parallel = self.parallel
        if parallel is None and all(size is None for size in sizes.values()):
            parallel = "ddp"
        if parallel is not None:
            sizes["dp_replicate" if parallel == "ddp" else "dp_shard"] = world
        layout = Layout(**{name: size or 1 for name, size in sizes.items()})
        if layout.world != world:
            flags = " x ".join(
                f"--{n.replace('_', '-')} {s}" for n, s in zip(DIMS, layout.sizes, strict=True)
            )
            raise ValueError(
                f"the layout's sizes must multiply to the number of ranks, {world}: "
                f"got {flags} = {layout.world}"
            )
        return layout


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse and check the command line; a bad value raises ``ValueError`` naming it."""
    return TrainConfig(**vars(parser().parse_args(argv)))


def model_config(config: TrainConfig) -> GPTConfig:
    """The model the arguments describe: fused attention (``scaled_dot_product_attention``),
    an untied head, the ``qkv`` matrix stored head by head (so tensor parallelism
    splits it into whole heads), no dropout, and each block recomputed in backward
    if ``--checkpoint-activations``."""
    return GPTConfig(
        vocab=config.vocab,
        context=config.seq_len,
        d_model=config.width,
        layers=config.layers,
        heads=config.heads,
        tied=False,
        attention="sdpa",
        recompute="full" if config.checkpoint_activations else "none",
        qkv_layout="by_head",
    )


# --------------------------------------------------------------------------- data


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


# --------------------------------------------------------------------------- checkpoints


def checkpoint_path(folder: str | os.PathLike, step: int) -> Path:
    """Where the complete checkpoint taken after ``step`` optimiser steps lives."""
    return Path(folder) / f"{CHECKPOINT_PREFIX}{_checks.count('step', step):08d}"


def complete_checkpoints(folder: str | os.PathLike | None) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint in ``folder``, oldest first.

    Folders still called ``step_<N>.partial`` were not finished (a rank died
    while writing) and are ignored, as is anything else in the folder.
    """
    if folder is None or not Path(folder).is_dir():
        return []
    found = []
    for entry in Path(folder).iterdir():
        digits = entry.name.removeprefix(CHECKPOINT_PREFIX)
        if entry.is_dir() and entry.name.startswith(CHECKPOINT_PREFIX) and digits.isdigit():
            found.append((int(digits), entry))
    return sorted(found)


def latest_checkpoint(folder: str | os.PathLike | None) -> tuple[int, Path] | None:
    """``(step, path)`` of the newest complete checkpoint in ``folder``, or ``None``."""
    found = complete_checkpoints(folder)
    return found[-1] if found else None


class TrainState(Stateful):
    """What a checkpoint holds: model, optimiser and progress (step, data position).

    ``parts`` are the model chunks this rank holds (one, or one per pipeline
    stage it runs) and ``optimizers`` their optimisers. ``get_state_dict`` names
    every tensor by its place in the *unsplit* model (``blocks.3.mlp.0.weight``;
    the optimiser's state flattened to ``state.<name>.exp_avg`` and
    ``param_groups.<name>.lr``), whatever the layout: under DDP each rank holds
    everything and one copy is written; under FSDP and tensor parallelism each
    rank writes and reads its own shards (DTensors); under pipelining each rank
    holds its stages' names only. So a checkpoint written at one layout loads
    into any other: ``torch.distributed.checkpoint`` reads each rank's pieces.
    """

    OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
    LOAD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)

    def __init__(
        self,
        parts: list[torch.nn.Module],
        optimizers: list[torch.optim.Optimizer],
        progress: dict,
    ):
        self.parts, self.optimizers, self.progress = parts, optimizers, progress

    def state_dict(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        optimizer: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            weights, moments = get_state_dict(part, opt, options=self.OPTIONS)
            model.update(weights)
            optimizer.update(moments)
        return {"model": model, "optimizer": optimizer, "progress": dict(self.progress)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Each part takes its own names from what this rank asked for (strict=False:
        # the other parts' names are there too).
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            set_state_dict(
                part,
                opt,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=self.LOAD_OPTIONS,
            )
        self.progress.update(state["progress"])


def save_checkpoint(state: TrainState, folder: str | os.PathLike, keep: int) -> Path:
    """Write ``state`` to ``folder/step_<N>`` (every rank calls this), then delete all
    but the ``keep`` newest complete checkpoints."""
    rank = dist.get_rank()
    final = checkpoint_path(folder, state.progress["step"])
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left over from a crash
        partial.mkdir(parents=True)
    dist.barrier()
    dcp.save({"train": state}, checkpoint_id=partial)
    dist.barrier()  # every rank has written its shards: now the checkpoint is complete
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for _, old in complete_checkpoints(folder)[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def load_latest(state: TrainState, folder: str | os.PathLike | None) -> int | None:
    """Load the newest complete checkpoint into ``state`` (every rank calls this);
    return its step, or ``None`` if there is none. Rank 0 picks the checkpoint,
    so all ranks load the same one."""
    found = [latest_checkpoint(folder) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return None
    step, path = found[0]
    expected = dict(state.progress)
    dcp.load({"train": state}, checkpoint_id=path)
    for key in ("seed", "global_batch", "total_steps"):
        if state.progress[key] != expected[key]:
            raise ValueError(
                f"checkpoint {path} was written with {key}={state.progress[key]}, "
                f"but this run has {key}={expected[key]}: use another --ckpt-dir"
            )
    return step


# --------------------------------------------------------------------------- the layout


def build_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    """One ``DeviceMesh`` over every rank, shaped :attr:`Layout.sizes` and named
    :data:`DIMS` (size-1 dimensions are kept, so every layout has every name)."""
    return init_device_mesh(device.type, layout.sizes, mesh_dim_names=DIMS)


def stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The pipeline stages rank ``pp_rank`` runs: ``pp_rank``, ``pp_rank + pp``, ...
    (the looped order of ``ScheduleInterleaved1F1B``; one stage for 1F1B)."""
    return [pp_rank + chunk * pp for chunk in range(virtual_stages)]


def stage_layers(stage: int, stages: int, layers: int) -> range:
    """The blocks of stage ``stage`` of ``stages``: an equal, contiguous share of ``layers``."""
    per = layers // stages
    return range(stage * per, (stage + 1) * per)


class Stage(torch.nn.Module):
    """A contiguous run of the decoder's blocks, the first stage with the embeddings and
    the last with the final norm and head; with one stage, the whole model.

    The blocks sit in a ``ModuleDict`` keyed by their index in the whole model, so
    every parameter keeps the unsplit model's name (``blocks.3.attention.qkv.weight``):
    a checkpoint written by one split loads into any other. ``forward`` computes
    what :class:`trainscale.transformer.GPT` computes over these blocks.

    Under tensor parallelism (``tp_mesh`` set by :func:`apply_tensor_parallel`)
    the activations between the blocks are split by sequence position: the
    stage splits its input after the embeddings (each rank keeps its positions,
    no communication) and all-gathers its output after the last block, so what
    a stage receives and sends is whole on every tensor-parallel rank.
    """

    def __init__(self, model: GPT, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.token_embedding = model.token_embedding if first else None
        self.position_embedding = model.position_embedding if first else None
        self.blocks = torch.nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.final_norm = model.final_norm if last else None
        self.head = model.head if last else None
        self.tp_mesh: DeviceMesh | None = None
        self.first_position = 0  # of this rank's tokens, under context parallelism

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.token_embedding is not None:  # token ids -> (batch, seq, d_model)
            first = self.first_position
            positions = torch.arange(first, first + x.shape[-1], device=x.device)
            x = self.token_embedding(x) + self.position_embedding(positions)
        recompute = self.config.recompute == "full" and torch.is_grad_enabled()
        if self.tp_mesh is not None:  # whole -> this rank's sequence positions
            x = _relayout(x, self.tp_mesh, Replicate(), Shard(1))
        for block in self.blocks.values():
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        if self.tp_mesh is not None:  # this rank's positions -> whole (a fresh tensor)
            x = _relayout(x, self.tp_mesh, Shard(1), Replicate()).clone()
        if self.head is not None:  # -> logits (batch, seq, vocab)
            x = self.head(self.final_norm(x))
        return x


def _relayout(x: torch.Tensor, mesh: DeviceMesh, now: Placement, wanted: Placement):
    """This rank's part of ``x`` laid out as ``now`` over ``mesh``, redistributed to ``wanted``."""
    return DTensor.from_local(x, mesh, (now,)).redistribute(mesh, (wanted,)).to_local()


def split_model(model: GPT, stages: list[int], total: int) -> list[Stage]:
    """This rank's chunks of ``model``: one :class:`Stage` for each of ``stages`` out of
    ``total`` (the chunks share their modules with ``model``)."""
    layers = model.config.layers
    return [
        Stage(model, stage_layers(s, total, layers), first=s == 0, last=s == total - 1)
        for s in stages
    ]


def tensor_parallel_plan() -> dict[str, ParallelStyle]:
    """Megatron-style tensor parallelism of one block, with sequence parallelism.

    Between the matrix products the block's activations are split by sequence
    position (``Shard(1)``): the layer norms run on each rank's positions. Before
    attention and the MLP they are all-gathered; ``qkv`` and the MLP's first
    matrix are split by output columns (whole heads: the ``qkv`` rows are stored
    head by head), ``proj`` and the MLP's second matrix by input rows, and
    their partial sums are reduce-scattered back to positions.
    """
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "norm1": SequenceParallel(),
        "attention": gather,
        "attention.qkv": ColwiseParallel(),
        "attention.proj": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "mlp": gather,
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(output_layouts=Shard(1)),
    }


def apply_tensor_parallel(part: Stage, tp_mesh: DeviceMesh) -> None:
    """Split each block of ``part`` over ``tp_mesh`` (:func:`tensor_parallel_plan`).

    The stage's input and output stay whole on every tensor-parallel rank
    (:class:`Stage`). Embeddings, final norm and head are not split: each
    tensor-parallel rank computes them whole, on the same data.
    """
    for block in part.blocks.values():
        parallelize_module(block, tp_mesh, tensor_parallel_plan())
    part.tp_mesh = tp_mesh


def apply_context_parallel(part: Stage, mesh: DeviceMesh, tokens_per_rank: int) -> None:
    """Split each sequence of ``part`` over the mesh's ``cp`` ranks: rank ``c`` takes
    tokens ``c L .. (c + 1) L - 1`` (``L = tokens_per_rank``), and every block's
    attention becomes ring attention over the ``cp`` group (chapter 14): keys and
    values pass round the ring, each rank computing its queries' rows."""
    from trainscale.workers.context import ring_attention  # only context parallelism needs it

    ring = functools.partial(ring_attention, group=mesh.get_group("cp"), causal=True)
    for block in part.blocks.values():
        block.attention.attend_fn = ring
    part.first_position = mesh.get_local_rank("cp") * tokens_per_rank


def fsdp_mesh(mesh: DeviceMesh, layout: Layout) -> DeviceMesh:
    """The ranks FSDP2 shards over and averages gradients across: the ``dp_shard`` and
    ``cp`` ranks (context-parallel ranks compute gradients of different tokens of
    the same sequences, which must be averaged too, as torchtitan does), and, for
    HSDP, the ``dp_replicate`` groups as a second, outer dimension."""
    shard = "dp_shard"
    if layout.cp > 1:
        shard = "dp_shard_cp"
        mesh["dp_shard", "cp"]._flatten(shard)  # a private API, as torchtitan uses it
    return mesh["dp_replicate", shard] if layout.dp_replicate > 1 else mesh[shard]


def apply_fsdp(part: Stage, dp_mesh: DeviceMesh, reshard_after_forward: bool) -> None:
    """Shard ``part`` over ``dp_mesh`` with FSDP2 (HSDP if the mesh is two-dimensional):
    one all-gather per block, and one for the rest (embeddings, final norm, head)."""
    for block in part.blocks.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(part, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)


@dataclass
class Built:
    """What :func:`build` made for one rank: its model chunks, their optimisers,
    the pipeline schedule (``None`` without pipelining) and where this rank sits."""

    parts: list[torch.nn.Module]
    optimizers: list[torch.optim.Optimizer]
    schedule: Any
    mesh: DeviceMesh
    layout: Layout

    @property
    def coordinate(self) -> dict[str, int]:
        """This rank's index along each mesh dimension."""
        return {name: self.mesh.get_local_rank(name) for name in DIMS}

    @property
    def dp_rank(self) -> int:
        """Which slice of the global batch this rank trains on."""
        c = self.coordinate
        return c["dp_replicate"] * self.layout.dp_shard + c["dp_shard"]

    @property
    def has_first_stage(self) -> bool:
        return any(getattr(p, "token_embedding", None) is not None for p in self.parts)

    @property
    def has_last_stage(self) -> bool:
        return any(getattr(p, "head", None) is not None for p in self.parts)

    @property
    def reports_loss(self) -> bool:
        """Whether this rank's loss enters the logged mean: one rank per data slice and
        context-parallel share of the sequence."""
        c = self.coordinate
        return self.has_last_stage and c["tp"] == 0

    @property
    def first_position(self) -> int:
        """The first of this rank's token positions (0 without context parallelism)."""
        return self.parts[0].first_position

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def parameters_held(self) -> int:
        """How many parameter values this rank stores: its shards' local elements."""
        return sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() for p in self.parameters()
        )


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of a micro-batch, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build(config: TrainConfig, layout: Layout, device: torch.device) -> Built:
    """Build this rank's part of the model, in torchtitan's order.

    Every rank draws the same whole model from the seed, then keeps its pipeline
    stages (:func:`split_model`), splits each stage's blocks by tensor
    parallelism, wraps them for activation checkpointing (the stage's forward
    does it, per block), shards each stage over the data-parallel ranks with
    FSDP2 (HSDP when ``dp_replicate > 1``), and, with ``pp > 1``, hands the
    stages to a pipeline schedule. Each chunk gets its AdamW (weight decay on
    every parameter, for simplicity).
    """
    mesh = build_mesh(layout, device)
    model = gpt(model_config(config), seed=config.seed).to(device)
    pp_rank = mesh.get_local_rank("pp")
    total = layout.pp * config.virtual_stages
    ids = stage_ids(pp_rank, layout.pp, config.virtual_stages)
    parts = split_model(model, ids, total)
    dp_mesh = fsdp_mesh(mesh, layout)
    for part in parts:
        if layout.tp > 1:
            apply_tensor_parallel(part, mesh["tp"])
        if layout.cp > 1:
            apply_context_parallel(part, mesh, config.seq_len // layout.cp)
        apply_fsdp(part, dp_mesh, reshard_after_forward=layout.pp == 1)
    optimizers = [
        torch.optim.AdamW(
            part.parameters(),
            lr=config.lr,
            betas=(0.9, 0.95),
            weight_decay=config.weight_decay,
            foreach=False,  # one parameter at a time, the same way in every layout
        )
        for part in parts
    ]
    pipeline = None
    if layout.pp > 1:
        # Imported here: ~0.8 CPU-s per rank that a run without pipelining saves.
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleInterleaved1F1B,
        )

        group = mesh.get_group("pp")
        stages = [
            PipelineStage(part, stage, total, device, group=group)
            for part, stage in zip(parts, ids, strict=True)
        ]
        if config.pp_schedule == "interleaved":
            pipeline = ScheduleInterleaved1F1B(stages, config.grad_accum, loss_fn=_loss)
        else:
            pipeline = Schedule1F1B(stages[0], config.grad_accum, loss_fn=_loss)
    return Built(parts, optimizers, pipeline, mesh, layout)


# --------------------------------------------------------------------------- one step


def _grad_norm(
    params: list[torch.nn.Parameter] | torch.nn.Module,
    clip: float,
    pp_group: dist.ProcessGroup | None = None,
) -> float:
    """The global gradient norm before clipping, summed in float64; scales gradients
    down to ``clip`` if ``clip > 0`` (the factor ``clip / (norm + 1e-6)``, as
    ``clip_grad_norm_``). A sharded gradient (a DTensor) adds the squares of its
    local shard, summed over the mesh dimensions it is sharded along; a replicated
    one counts once; ``pp_group`` adds the squares of the other pipeline stages."""
    if isinstance(params, torch.nn.Module):
        params = list(params.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    squares: dict[tuple, torch.Tensor] = {}
    for g in grads:
        key: tuple = ()
        local = g
        if isinstance(g, DTensor):
            local = g.to_local()
            key = tuple(
                g.device_mesh.get_group(dim)
                for dim, placement in enumerate(g.placements)
                if not placement.is_replicate()  # Shard, or FSDP's _StridedShard over TP
            )
        part = local.detach().double().pow(2).sum()
        squares[key] = squares.get(key, 0) + part
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
    for groups, value in squares.items():
        for group in groups:
            dist.all_reduce(value, group=group)
        total += value
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = math.sqrt(total.item())
    if clip > 0 and clip / (norm + 1e-6) < 1:
        factor = clip / (norm + 1e-6)
        for g in grads:
            g.mul_(factor)
    return norm


def _sync_gradients(parts: list[torch.nn.Module], sync: bool) -> None:
    """Make FSDP reduce gradients in this backward only if ``sync``: the micro-steps
    before the last one just accumulate locally."""
    for part in parts:
        part.set_requires_gradient_sync(sync)


def _step_plain(
    built: Built,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    config: TrainConfig,
    crash: Callable[[], None],
) -> torch.Tensor:
    """Forward and backward of one optimiser step without pipelining: ``grad_accum``
    micro-batches, accumulated; returns this rank's mean loss."""
    (model,) = built.parts
    total = torch.zeros((), device=inputs.device)
    k = config.grad_accum
    for micro, (x, y) in enumerate(zip(inputs.chunk(k), targets.chunk(k), strict=True)):
        _sync_gradients(built.parts, micro == k - 1)
        with _autocast(config, inputs.device):
            part = _loss(model(x), y)
        if micro == 0:
            crash()
        (part / k).backward()
        total += part.detach() / k
    return total


def _step_pipelined(
    built: Built,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    config: TrainConfig,
    crash: Callable[[], None],
) -> torch.Tensor:
    """Forward and backward of one optimiser step through the pipeline schedule:
    it splits the rank's rows into ``grad_accum`` micro-batches and scales the
    gradients by ``1 / grad_accum``; returns the mean loss (last stage; 0 elsewhere)."""
    crash()
    losses: list[torch.Tensor] = []
    with _autocast(config, inputs.device):
        if built.has_first_stage:
            built.schedule.step(inputs, target=targets, losses=losses)
        else:
            built.schedule.step(target=targets, losses=losses)
    if not losses:
        return torch.zeros((), device=inputs.device)
    return torch.stack([loss.detach().float() for loss in losses]).mean()


def _autocast(config: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast if ``--bf16``, else nothing."""
    if config.bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _maybe_fail(config: TrainConfig, step: int, rank: int) -> None:
    """Crash this process, as a lost machine would, if ``--fail-at-step`` says so."""
    first_try = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if first_try and step + 1 == config.fail_at_step and rank == config.fail_rank:
        # Steps are logged from 1, so the crash is reported the same way.
        print(f"rank {rank}: simulated crash in step {step + 1}", flush=True)
        os._exit(FAIL_EXIT_CODE)  # no clean-up, no goodbye to the other ranks


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


# --------------------------------------------------------------------------- training


def train(config: TrainConfig, rank: int, world_size: int, device: torch.device) -> dict:
    """Train in an initialised process group; return a summary (rank 0's is complete).

    The summary holds the last logged ``loss``, ``grad_norm`` and ``lr``, the
    step it ``resumed_from`` (or ``None``), ``history``: for every step this
    attempt trained, ``(loss, grad norm)``, the loss being the mean over every
    token of the global batch, and ``parameters_held``, the parameter values
    this rank stores (its shards).
    """
    layout = config.layout(world_size)  # before any collective: a bad layout stops every rank
    if config.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    model_shape = model_config(config)
    built = build(config, layout, device)
    batch_rows = layout.dp * config.grad_accum * config.micro_batch
    progress = {
        "step": 0,
        "sequences_seen": 0,
        "seed": config.seed,
        "global_batch": batch_rows,
        "total_steps": config.steps,
    }
    state = TrainState(built.parts, built.optimizers, progress)
    params = matmul_weights(model_shape)  # the N of 6N FLOPs per token
    every_param = sum(parameter_counts(model_shape).values())
    ranks = f"{world_size} rank{'s' * (world_size != 1)} ({dist.get_backend()}, {device.type})"
    pipelined = f", {config.pp_schedule} schedule" if layout.pp > 1 else ""
    _say(
        rank,
        f"model: {every_param:,} parameters ({params:,} in matrix products); "
        f"{ranks}, {layout.describe()}{pipelined}; global batch {batch_rows} sequences "
        f"x {config.seq_len} tokens = {tokens_per_step(config, layout):,} tokens",
    )
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    resumed = load_latest(state, config.ckpt_dir)
    if resumed is None:
        _say(rank, f"attempt {attempt}: starting from step 0")
    else:
        where = checkpoint_path(config.ckpt_dir, resumed).name
        _say(rank, f"attempt {attempt}: resumed from step {resumed} (checkpoint {where})")
    one_step = _step_pipelined if layout.pp > 1 else _step_plain
    pp_group = built.mesh.get_group("pp") if layout.pp > 1 else None
    step = progress["step"]
    loss = grad_norm = lr = math.nan
    history: dict[int, tuple[float, float]] = {}
    busy, window, started = 0.0, 0, time.perf_counter()
    while step < config.steps:
        tick = time.perf_counter()
        lr = schedule_lr(step, config)
        for optimizer in built.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
        batch = global_batch(
            config.seed, step, batch_rows, config.seq_len, config.vocab, config.strides
        )
        # This data-parallel rank's micro-batches, one after another (the pipeline
        # schedule and _step_plain split them again).
        slices = [
            micro_batch(batch, built.dp_rank, layout.dp, config.grad_accum, micro)
            for micro in range(config.grad_accum)
        ]
        tokens = slice(built.first_position, built.first_position + config.seq_len // layout.cp)
        inputs = torch.cat([x for x, _ in slices])[:, tokens].to(device)
        targets = torch.cat([y for _, y in slices])[:, tokens].to(device)
        local = one_step(
            built, inputs, targets, config, functools.partial(_maybe_fail, config, step, rank)
        )
        grad_norm = _grad_norm(built.parameters(), config.clip, pp_group)
        for optimizer in built.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        step += 1
        progress.update(step=step, sequences_seen=step * batch_rows)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        busy, window = busy + time.perf_counter() - tick, window + 1
        # The mean loss over the whole global batch: one rank per data slice adds its own.
        total = local.detach().float() if built.reports_loss else torch.zeros((), device=device)
        dist.all_reduce(total)
        loss = total.item() / (layout.dp * layout.cp)  # equal shares: a mean of means
        history[step] = (loss, grad_norm)
        if step % config.log_every == 0 or step == config.steps:
            rate = window * tokens_per_step(config, layout) / busy
            line = (
                f"step {step:>5}/{config.steps} | loss {loss:.4f} | grad norm {grad_norm:.4f} | "
                f"lr {lr:.2e} | {rate:,.0f} tokens/s (measured)"
            )
            if config.peak_flops:
                share = compute.mfu(rate, params, world_size, config.peak_flops)
                line += f" | MFU {100 * share:.2f} % (measured)"
            _say(rank, line)
            busy, window = 0.0, 0
        if config.ckpt_dir and (step % config.ckpt_every == 0 or step == config.steps):
            saving = time.perf_counter()  # how long training stalls for the save
            save_checkpoint(state, config.ckpt_dir, config.keep_checkpoints)
            saved = time.perf_counter() - saving
            _say(rank, f"saved checkpoint step_{step:08d} in {saved:.4f} s (measured)")
    took = time.perf_counter() - started
    _say(rank, f"finished at step {step}; this attempt trained for {took:.1f} s (measured)")
    if config.final_weights:
        save_final_weights(built, config.final_weights)
    return {
        "resumed_from": resumed,
        "steps": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "history": history,
        "parameters_held": built.parameters_held(),
    }


def schedule_lr(step: int, config: TrainConfig) -> float:
    """The learning rate of optimiser step ``step`` (counted from 0): linear warmup,
    then cosine decay to ``lr_floor * lr`` (:func:`trainscale.schedule.learning_rate`)."""
    return schedule.learning_rate(step, config.lr, config.warmup, config.steps, config.lr_floor)


def save_final_weights(built: Built, path: str | os.PathLike) -> None:
    """Gather the full weights (every rank calls this) and let rank 0 save them with
    ``torch.save``, under the unsplit model's parameter names, in its order."""
    options = StateDictOptions(full_state_dict=True)
    weights: dict[str, torch.Tensor] = {}
    # Gathering a tensor sharded by both FSDP and TP takes two all-gathers, and
    # torch logs a warning that says so: expected here, and no concern for a save.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        for part in built.parts:
            full = get_model_state_dict(part, options=options)
            weights.update({name: t.detach().cpu() for name, t in full.items()})
    finally:
        redistribute_log.setLevel(level)
    c = built.coordinate
    mine = weights if c["dp_replicate"] == c["dp_shard"] == c["tp"] == c["cp"] == 0 else {}
    pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, pieces, dst=0)
    if dist.get_rank() == 0:
        merged = {name: t for piece in pieces for name, t in piece.items()}
        order = [name for name, _ in gpt(built.parts[0].config).named_parameters()]
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = target.with_name(target.name + ".partial")
        torch.save({name: merged[name] for name in order}, scratch)
        scratch.replace(target)
    dist.barrier()


def worker(rank: int, world_size: int, argv: list[str] | None = None) -> dict:
    """One rank of the training job, in an initialised process group: run it with
    ``torchrun`` (``python -m trainscale.train``) or
    ``trainscale.distributed.run_ranks(worker, 8, [...])``."""
    config = parse_args(argv)
    config.layout(world_size)  # every rank refuses a bad layout before any collective
    local = int(os.environ.get("LOCAL_RANK", rank))
    return train(config, rank, world_size, backend_and_device(local)[1])


TORCHRUN_ENVIRONMENT = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What ``torchrun`` tells every rank, and :func:`main` looks for to tell whether it runs
under it: all of them, or none (one process alone)."""


def ranks_needed(config: TrainConfig) -> int:
    """How many ranks the flags' layout needs: the product of the sizes given, or 1 with
    none (or ``--parallel``), since data parallelism then fills whatever ranks there are."""
    if config.parallel is not None:
        return 1
    return math.prod(getattr(config, name) or 1 for name in DIMS)


def runs_alone(argv: list[str]) -> bool:
    """Check ``argv`` and the environment before any process group exists; return whether
    this process runs alone (not under ``torchrun``). Raises ``ValueError`` with the one
    line to say: a bad flag, a layout that does not fit ``WORLD_SIZE`` (or, alone, one
    process, saying how to launch it), a torchrun environment with parts missing."""
    config = parse_args(argv)
    found = [name for name in TORCHRUN_ENVIRONMENT if name in os.environ]
    if found and len(found) < len(TORCHRUN_ENVIRONMENT):
        missing = [name for name in TORCHRUN_ENVIRONMENT if name not in os.environ]
        raise ValueError(
            f"the environment sets {', '.join(found)} but not {', '.join(missing)}: start"
            " the job with python -m trainscale.launch (or torchrun), or unset them to run"
            " one process"
        )
    if found:
        config.layout(int(os.environ["WORLD_SIZE"]))
        return False
    needed = ranks_needed(config)
    if needed > 1:
        raise ValueError(
            f"this layout needs {needed} ranks and this is one process (no torchrun): run"
            f" python -m trainscale.launch --nproc-per-node={needed} -m trainscale.train"
            f" {shlex.join(argv)}"
        )
    config.layout(1)
    return True


def main(argv: list[str] | None = None) -> dict:
    """``python -m trainscale.train``: check the arguments, then train.

    Under ``torchrun`` (or ``python -m trainscale.launch``, which runs it), with
    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set: check the
    layout against ``WORLD_SIZE``, join the job
    (:func:`trainscale.distributed.torchrun_main`) and train as one of its ranks.
    Alone, with none of them set: train as a job of one process
    (:func:`trainscale.distributed.run_alone`), if the layout fits one. A bad flag,
    or a layout that needs more ranks than there are, ends the program with
    argparse's one-line error (status 2) before any process group exists; for a
    layout of several ranks run alone, the line says how to launch it.
    """
    arguments = sys.argv[1:] if argv is None else list(argv)
    p = parser()
    try:
        alone = runs_alone(arguments)
    except ValueError as error:
        p.exit(2, f"{p.prog}: error: {error}\n")
    if alone:
        return run_alone(worker, arguments)
    return torchrun_main(worker, arguments)


if __name__ == "__main__":
    main(sys.argv[1:])
