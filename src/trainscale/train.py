"""The capstone of chapter 13: a small GPT trained on several processes, restartably.

The model is the book's decoder (:mod:`trainscale.transformer`) with fused
attention and an untied head. One script puts the book's techniques together:
data parallelism (``--parallel
ddp``) or fully sharded data parallelism (``--parallel fsdp``, FSDP2's
``fully_shard``), activation checkpointing, bf16 autocast, gradient
accumulation, warmup plus cosine decay, global-norm clipping, a log of loss,
gradient norm, learning rate, throughput and MFU, and checkpoints it resumes
from after a crash. Two CPU processes on a laptop (gloo)::

    GLOO_SOCKET_IFNAME=lo TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \\
    torchrun --nnodes=1 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29500 --max-restarts=1 \\
        -m trainscale.train --parallel fsdp --ckpt-dir /tmp/capstone

The same command with ``--nproc-per-node=8`` on a node with eight GPUs runs on
NCCL, one GPU per process (:func:`trainscale.distributed.backend_and_device`).

What makes a restart exact:

* the data of optimiser step ``s`` is a function of ``(seed, s)`` alone
  (:func:`global_batch`), so the data loader's whole state is the step count;
* a checkpoint holds the model, the optimiser (Adam's moments and step
  counts), the step, from which the learning rate follows, and the data
  position. ``torch.distributed.checkpoint`` writes each rank's shards in
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
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

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
from torch.nn import functional as F

from trainscale import _checks, compute, schedule
from trainscale.distributed import backend_and_device, torchrun_main
from trainscale.transformer import GPTConfig, gpt, matmul_weights, parameter_counts

FAIL_EXIT_CODE = 17
"""Exit status of the rank that ``--fail-at-step`` makes crash."""

CHECKPOINT_PREFIX = "step_"
"""A complete checkpoint is the folder ``step_<8-digit step>``; one being written
carries the suffix ``.partial`` until every rank has finished writing it."""


# --------------------------------------------------------------------------- arguments


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m trainscale.train`` (run under ``torchrun``)."""
    p = argparse.ArgumentParser(
        prog="python -m trainscale.train",
        description="Train a small GPT on synthetic data, restartably (run it with torchrun).",
    )
    add = p.add_argument
    add("--parallel", default="ddp", help="ddp (replicate) or fsdp (FSDP2 fully_shard)")
    add("--steps", type=int, default=100, help="optimiser steps in the whole run")
    add("--micro-batch", type=int, default=8, help="sequences per rank per forward pass")
    add("--grad-accum", type=int, default=1, help="micro-batches accumulated per step")
    add("--lr", type=float, default=3e-3, help="peak learning rate")
    add("--warmup", type=int, default=10, help="steps of linear warmup before cosine decay")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; a bad value raises ``ValueError`` naming it."""
    args = parser().parse_args(argv)
    _checks.choice("--parallel", args.parallel, ("ddp", "fsdp"))
    _checks.count("--steps", args.steps, minimum=1)
    _checks.count("--micro-batch", args.micro_batch, minimum=1)
    _checks.count("--grad-accum", args.grad_accum, minimum=1)
    _checks.positive("--lr", args.lr)
    if _checks.count("--warmup", args.warmup) >= args.steps:
        raise ValueError(f"--warmup must be in [0, --steps) = [0, {args.steps}), got {args.warmup}")
    _checks.fraction("--lr-floor", args.lr_floor)
    _checks.non_negative("--weight-decay", args.weight_decay)
    _checks.non_negative("--clip", args.clip)  # 0: no clipping
    _checks.count("--seed", args.seed)
    _checks.count("--vocab", args.vocab, minimum=2)
    _checks.count("--seq-len", args.seq_len, minimum=1)
    _checks.count("--heads", args.heads, minimum=1)
    _checks.count("--layers", args.layers, minimum=1)
    if _checks.count("--width", args.width, minimum=1) % args.heads:
        raise ValueError(f"--width must be a multiple of --heads={args.heads}, got {args.width}")
    if not 1 <= args.strides < args.vocab:
        raise ValueError(
            f"--strides must be in [1, --vocab) = [1, {args.vocab}), got {args.strides}"
        )
    _checks.count("--log-every", args.log_every, minimum=1)
    if args.peak_flops is not None:
        _checks.positive("--peak-flops", args.peak_flops)
    _checks.count("--ckpt-every", args.ckpt_every, minimum=1)
    _checks.count("--keep-checkpoints", args.keep_checkpoints, minimum=1)
    if args.fail_at_step is not None:
        _checks.count("--fail-at-step", args.fail_at_step, minimum=1)
    _checks.count("--fail-rank", args.fail_rank)
    return args


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The model the arguments describe: fused attention (``scaled_dot_product_attention``),
    an untied head, no dropout, and each block recomputed in backward if
    ``--checkpoint-activations``."""
    return GPTConfig(
        vocab=args.vocab,
        context=args.seq_len,
        d_model=args.width,
        layers=args.layers,
        heads=args.heads,
        tied=False,
        attention="sdpa",
        recompute="full" if args.checkpoint_activations else "none",
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


def tokens_per_step(args: argparse.Namespace, world_size: int) -> int:
    """Tokens the whole job trains on in one optimiser step (the effective batch)."""
    return world_size * args.grad_accum * args.micro_batch * args.seq_len


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

    ``get_state_dict`` / ``set_state_dict`` give the model and optimiser state
    under the plain module's parameter names, whether the model is wrapped by
    DDP (each rank holds everything; only one copy is written) or sharded by
    FSDP2 (each rank writes and reads its own shards).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, progress: dict):
        self.model, self.optimizer, self.progress = model, optimizer, progress

    def state_dict(self) -> dict[str, Any]:
        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer, "progress": dict(self.progress)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
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


# --------------------------------------------------------------------------- training


def build(
    args: argparse.Namespace, device: torch.device, world_size: int
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (the same initial weights on every rank), wrapped for ``--parallel``,
    and its AdamW optimiser (weight decay on every parameter, for simplicity)."""
    model = gpt(model_config(args), seed=args.seed).to(device)
    if args.parallel == "ddp":
        ids = [device] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world_size,))
        for block in model.blocks:  # one all-gather per block, freed after use
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the embeddings, final norm and head
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )
    return model, optimizer


def _gradient_sync(model: torch.nn.Module, parallel: str, sync: bool):
    """A context in which backward reduces gradients across ranks only if ``sync``:
    the micro-steps before the last one just accumulate locally."""
    if parallel == "fsdp":
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else model.no_sync()


def _grad_norm(model: torch.nn.Module, clip: float) -> float:
    """The global gradient norm before clipping; scales gradients down to ``clip`` if
    ``clip > 0``. Under FSDP each rank holds a shard of every gradient, and the
    norm is reduced across ranks."""
    params = [p for p in model.parameters() if p.grad is not None]
    if clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
        norm = norm.full_tensor()
    return norm.item()


def _maybe_fail(args: argparse.Namespace, step: int, rank: int) -> None:
    """Crash this process, as a lost machine would, if ``--fail-at-step`` says so."""
    first_try = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    if first_try and step + 1 == args.fail_at_step and rank == args.fail_rank:
        # Steps are logged from 1, so the crash is reported the same way.
        print(f"rank {rank}: simulated crash in step {step + 1}", flush=True)
        os._exit(FAIL_EXIT_CODE)  # no clean-up, no goodbye to the other ranks


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def train(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> dict:
    """Train in an initialised process group; return a summary (rank 0's is complete)."""
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    config = model_config(args)
    model, optimizer = build(args, device, world_size)
    batch_rows = world_size * args.grad_accum * args.micro_batch
    progress = {
        "step": 0,
        "sequences_seen": 0,
        "seed": args.seed,
        "global_batch": batch_rows,
        "total_steps": args.steps,
    }
    state = TrainState(model, optimizer, progress)
    params = matmul_weights(config)  # the N of 6N FLOPs per token
    every_param = sum(parameter_counts(config).values())
    ranks = f"{world_size} rank{'s' * (world_size != 1)} ({dist.get_backend()}, {device.type})"
    _say(
        rank,
        f"model: {every_param:,} parameters ({params:,} in matrix products); "
        f"{ranks}, --parallel {args.parallel}; global batch {batch_rows} sequences "
        f"x {args.seq_len} tokens = {tokens_per_step(args, world_size):,} tokens",
    )
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    resumed = load_latest(state, args.ckpt_dir)
    if resumed is None:
        _say(rank, f"attempt {attempt}: starting from step 0")
    else:
        where = checkpoint_path(args.ckpt_dir, resumed).name
        _say(rank, f"attempt {attempt}: resumed from step {resumed} (checkpoint {where})")
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if args.bf16 else contextlib.nullcontext()
    )
    step = progress["step"]
    loss = grad_norm = lr = math.nan
    busy, window, started = 0.0, 0, time.perf_counter()
    while step < args.steps:
        tick = time.perf_counter()
        lr = schedule.learning_rate(step, args.lr, args.warmup, args.steps, args.lr_floor)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = global_batch(args.seed, step, batch_rows, args.seq_len, args.vocab, args.strides)
        total = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            inputs, targets = (
                t.to(device) for t in micro_batch(batch, rank, world_size, args.grad_accum, micro)
            )
            with _gradient_sync(model, args.parallel, micro == args.grad_accum - 1):
                with autocast:
                    logits = model(inputs)
                    part = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                if micro == 0:
                    _maybe_fail(args, step, rank)
                (part / args.grad_accum).backward()
            total += part.detach() / args.grad_accum
        grad_norm = _grad_norm(model, args.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        progress.update(step=step, sequences_seen=step * batch_rows)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        busy, window = busy + time.perf_counter() - tick, window + 1
        if step % args.log_every == 0 or step == args.steps:
            dist.all_reduce(total)  # the mean loss over the whole global batch
            loss = total.item() / world_size
            rate = window * tokens_per_step(args, world_size) / busy
            line = (
                f"step {step:>5}/{args.steps} | loss {loss:.4f} | grad norm {grad_norm:.4f} | "
                f"lr {lr:.2e} | {rate:,.0f} tokens/s (measured)"
            )
            if args.peak_flops:
                share = compute.mfu(rate, params, world_size, args.peak_flops)
                line += f" | MFU {100 * share:.2f} % (measured)"
            _say(rank, line)
            busy, window = 0.0, 0
        if args.ckpt_dir and (step % args.ckpt_every == 0 or step == args.steps):
            saving = time.perf_counter()  # how long training stalls for the save
            save_checkpoint(state, args.ckpt_dir, args.keep_checkpoints)
            saved = time.perf_counter() - saving
            _say(rank, f"saved checkpoint step_{step:08d} in {saved:.4f} s (measured)")
    took = time.perf_counter() - started
    _say(rank, f"finished at step {step}; this attempt trained for {took:.1f} s (measured)")
    if args.final_weights:
        save_final_weights(model, args.final_weights)
    return {"resumed_from": resumed, "steps": step, "loss": loss, "grad_norm": grad_norm, "lr": lr}


def save_final_weights(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Gather the full weights (every rank calls this) and let rank 0 save them with
    ``torch.save``, under the plain model's parameter names."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = target.with_name(target.name + ".partial")
        torch.save(weights, scratch)
        scratch.replace(target)
    dist.barrier()


def worker(rank: int, world_size: int, argv: list[str] | None = None) -> dict:
    """One rank of the training job, in an initialised process group: run it with
    ``torchrun`` (``python -m trainscale.train``) or
    ``trainscale.distributed.run_ranks(worker, 2, [...])``."""
    args = parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", rank))
    return train(args, rank, world_size, backend_and_device(local)[1])


def main(argv: list[str] | None = None) -> dict:
    """Entry point under ``torchrun``: check the arguments, join the job
    (:func:`trainscale.distributed.torchrun_main`), train."""
    parse_args(argv)  # a bad argument stops every rank before they meet
    return torchrun_main(worker, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
