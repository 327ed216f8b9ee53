"""The capstone's training loop: one optimiser step after another, with the global
gradient norm, clipping, the learning-rate schedule, the log, checkpoints and the
simulated crash (torchtitan's ``trainer.py`` and ``distributed/utils.py``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainscale import compute, schedule
from trainscale.train.checkpoints import (
    TrainState,
    checkpoint_path,
    load_latest,
    save_checkpoint,
    save_final_weights,
)
from trainscale.train.config import TrainConfig, model_config
from trainscale.train.data import global_batch, micro_batch, tokens_per_step
from trainscale.train.parallelize import Built, _loss, build, torch_context_parallel
from trainscale.transformer import GPT, matmul_weights, parameter_counts

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
    """Make FSDP reduce gradients in this backward only if ``sync``
    (``--local-accumulation``): the micro-steps before the last one accumulate
    unsharded gradients on each rank."""
    for part in parts:
        part.set_requires_gradient_sync(sync)


def gradient_bytes(parts: list[torch.nn.Module]) -> int:
    """Bytes of gradient this rank holds now: its parameters' gradients (their local
    shards) and the whole, unsharded gradients FSDP2 keeps between micro-batches when
    gradient sync is off (read from FSDP2's private ``_unsharded_param``: a measurement,
    not an interface)."""
    held = 0
    for part in parts:
        for p in part.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                held += g.numel() * g.element_size()
        for module in part.modules():
            state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
            group = getattr(state, "_fsdp_param_group", None) if state else None
            for fsdp_param in getattr(group, "fsdp_params", []):
                whole = getattr(fsdp_param, "_unsharded_param", None)
                if whole is not None and whole.grad is not None:
                    g = whole.grad.to_local() if isinstance(whole.grad, DTensor) else whole.grad
                    held += g.numel() * g.element_size()
    return held


def _value(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (``loss_parallel``'s is a replicated DTensor)."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def _step_plain(
    built: Built,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    config: TrainConfig,
    crash: Callable[[], None],
) -> tuple[torch.Tensor, int]:
    """Forward and backward of one optimiser step without pipelining: ``grad_accum``
    micro-batches, accumulated; returns this rank's mean loss and the most gradient
    bytes it held after a micro-batch (:func:`gradient_bytes`).

    FSDP2 reduce-scatters each micro-batch's gradients into the sharded ones, as
    torchtitan does: no rank holds a whole gradient across micro-batches. With
    ``--local-accumulation`` it keeps them whole until the last micro-batch instead.
    """
    (model,) = built.parts
    total = torch.zeros((), device=inputs.device)
    k = config.grad_accum
    peak = 0
    for micro, (x, y) in enumerate(zip(inputs.chunk(k), targets.chunk(k), strict=True)):
        if config.local_accumulation:
            _sync_gradients(built.parts, micro == k - 1)
        with built.loss_context():
            with _autocast(config, inputs.device):
                part = _loss(model(x), y)
            if micro == 0:
                crash()
            (part / k).backward()
        if micro == 0 and config.drop_gradient is not None and built.dp_rank == 0:
            grad = dict(model.named_parameters())[config.drop_gradient].grad  # the planted bug
            (grad.to_local() if isinstance(grad, DTensor) else grad).zero_()
        total += _value(part.detach()) / k
        peak = max(peak, gradient_bytes(built.parts))
    return total, peak


def _step_pipelined(
    built: Built,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    config: TrainConfig,
    crash: Callable[[], None],
) -> tuple[torch.Tensor, int]:
    """Forward and backward of one optimiser step through the pipeline schedule:
    it splits the rank's rows into ``grad_accum`` micro-batches and scales the
    gradients by ``1 / grad_accum``; returns the mean loss (last stage; 0 elsewhere)
    and the gradient bytes held after the step. torch's pipeline stages turn FSDP2's
    gradient sync off until a stage's last micro-batch (``PipelineStage``), so they
    hold whole gradients in between, whatever ``--local-accumulation`` says."""
    crash()
    losses: list[torch.Tensor] = []
    with built.loss_context(), _autocast(config, inputs.device):
        if built.has_first_stage:
            built.schedule.step(inputs, target=targets, losses=losses)
        else:
            built.schedule.step(target=targets, losses=losses)
    held = gradient_bytes(built.parts)
    if not losses:
        return torch.zeros((), device=inputs.device), held
    return torch.stack([_value(loss.detach()).float() for loss in losses]).mean(), held


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
    config = config.for_world(world_size)  # before any collective: a bad layout stops every rank
    layout = config.layout(world_size)
    if config.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    model_shape = model_config(config)
    if config.drop_gradient is not None:
        with torch.device("meta"):
            names = [name for name, _ in GPT(model_shape).named_parameters()]
        if config.drop_gradient not in names:
            raise ValueError(
                f"--drop-gradient must name a parameter ({names[0]}, ...), "
                f"got {config.drop_gradient!r}"
            )
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
    every_param = sum(parameter_counts(model_shape).values())
    # The logged MFU counts 6N FLOPs a token with the planner's N (chapter 16,
    # planner.Model.active_params of a dense model): every parameter, embeddings too.
    params = every_param
    ranks = f"{world_size} rank{'s' * (world_size != 1)} ({dist.get_backend()}, {device.type})"
    pipelined = f", {config.pp_schedule} schedule" if layout.pp > 1 else ""
    _say(
        rank,
        f"model: {every_param:,} parameters ({matmul_weights(model_shape):,} in matrix"
        " products); "
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
    gradient_peak = 0
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
        inputs = torch.cat([x for x, _ in slices]).to(device)
        targets = torch.cat([y for _, y in slices]).to(device)
        crash = functools.partial(_maybe_fail, config, step, rank)
        if layout.cp > 1 and device.type == "cuda":  # torch's ring shards the sequences
            buffers = [inputs, targets, built.positions]
            with torch_context_parallel(built.mesh, buffers, [1, 1, 0]):
                local, held = one_step(built, inputs, targets, config, crash)
        else:
            if built.positions is not None:  # this context-parallel rank's tokens
                mine = built.positions.to(device)
                inputs, targets = inputs[:, mine], targets[:, mine]
            local, held = one_step(built, inputs, targets, config, crash)
        gradient_peak = max(gradient_peak, held)
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
        "gradient_bytes": gradient_peak,
    }


def schedule_lr(step: int, config: TrainConfig) -> float:
    """The learning rate of optimiser step ``step`` (counted from 0): linear warmup,
    then cosine decay to ``lr_floor * lr`` (:func:`trainscale.schedule.learning_rate`)."""
    return schedule.learning_rate(step, config.lr, config.warmup, config.steps, config.lr_floor)
