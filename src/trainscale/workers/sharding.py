"""FSDP2 on real processes (chapter 7).

:func:`worker` shards the chapter's model with ``torch.distributed.fsdp.fully_shard``
(FSDP2, PyTorch's ZeRO-3), runs one training step with Adam on each rank's slice
of the batch, and returns what the chapter checks against its formulas:

* the bytes of weights, gradients and Adam state this rank holds (the local
  shards of the ``DTensor`` parameters, ``.to_local()``), and the bytes it
  allocates for its weight shards, padding included;
* every all-gather and reduce-scatter FSDP issued, in order, with the layer it
  served and the size of the full tensor, logged by counting wrappers handed to
  FSDP through ``set_custom_all_gather`` / ``set_custom_reduce_scatter``;
* which layers were whole (unsharded) when each layer's forward ran;
* on rank 0, the full gradient (to compare with one process on the whole batch)
  and how far the sharded Adam update is from one device's update;
* the same step with bf16 mixed precision: the dtypes FSDP gathers and keeps;
* the bytes this rank holds at every moment of a later step (:func:`memory_step`),
  with FSDP2's default prefetching and with explicit forward prefetching.

:func:`accumulation_worker` runs one step of ``k`` micro-batches under DDP and under
FSDP2 set up as ZeRO-2 and ZeRO-3, and counts the bytes of every collective issued.

:func:`check_zero1_exercise` is the chapter's "write it yourself" exercise: a reader's
ZeRO-1 optimiser step (reduce-scatter the gradients, update the local slice with Adam,
all-gather the weights) run on real ranks and checked against one process.

The same file runs on a GPU node, one process per GPU, with NCCL::

    torchrun --nproc-per-node=8 -m trainscale.workers.sharding
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from trainscale import _checks
from trainscale.distributed import RankError, device, run_ranks, torchrun_main
from trainscale.memory import mlp_stack
from trainscale.workers.exercise import (
    ExerciseError,
    ExerciseReport,
    load_reader_function,
    rank_failure,
    reader_source,
    watch_communication,
)

loss_fn = nn.functional.mse_loss
"""The loss of the step: mean squared error over the batch."""


def sharded_model(
    width: int = 256, blocks: int = 4, head: int = 10, seed: int = 0
) -> nn.Sequential:
    """The chapter's model: ``mlp_stack(width, blocks)`` then a ``Linear(width, head)`` head.

    The blocks' dimensions divide by 4; the head's 10 outputs do not, so on 4
    ranks its weight rows split 3, 3, 3, 1 and FSDP pads the last shard. The
    weights come from ``seed`` without touching the global random state.
    """
    w = _checks.count("width", width, minimum=1)
    out = _checks.count("head", head, minimum=1)
    model = mlp_stack(w, blocks, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_checks.count("seed", seed) + 1)
        model.append(nn.Linear(w, out))
    return model


def step_data(
    batch: int = 16, width: int = 256, head: int = 10, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of the step: ``batch`` inputs of ``width`` and targets of ``head``."""
    g = torch.Generator().manual_seed(_checks.count("seed", seed))
    size = _checks.count("batch", batch, minimum=1)
    return (
        torch.randn(size, _checks.count("width", width, minimum=1), generator=g),
        torch.randn(size, _checks.count("head", head, minimum=1), generator=g),
    )


def _sharded(layer: nn.Module) -> bool:
    """Whether ``layer``'s parameters are shards (``DTensor``) rather than whole tensors."""
    return isinstance(next(layer.parameters()), DTensor)


class _Log:
    """What one rank saw: each collective FSDP issued, and which layers were whole."""

    def __init__(self, model: nn.Sequential) -> None:
        self.model = model
        self.collectives: list[dict] = []
        self.whole_in_forward: list[list[int]] = []

    def whole(self) -> list[int]:
        return [i for i, layer in enumerate(self.model) if not _sharded(layer)]

    def add(self, kind: str, layer: int, full: torch.Tensor) -> None:
        self.collectives.append(
            {
                "kind": kind,
                "layer": layer,
                "bytes": full.nbytes,  # the whole (gathered or unreduced) tensor
                "dtype": str(full.dtype).removeprefix("torch."),
                "whole before": self.whole(),
            }
        )


class _CountingAllGather:
    """FSDP's all-gather, logged: ``dist.all_gather_single`` as FSDP calls it."""

    def __init__(self, log: _Log, layer: int) -> None:
        self.log, self.layer = log, layer

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.log.add("all-gather", self.layer, output_tensor)
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountingReduceScatter:
    """FSDP's reduce-scatter, logged: ``dist.reduce_scatter_single`` as FSDP calls it."""

    def __init__(self, log: _Log, layer: int) -> None:
        self.log, self.layer = log, layer

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.log.add("reduce-scatter", self.layer, input_tensor)
        return dist.reduce_scatter_single(
            output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op
        )


def _shard(
    model: nn.Sequential, mesh, log: _Log, mp_policy=None, reshard_after_forward: bool = True
) -> None:
    """FSDP2 the usual way: each layer its own unit, then the root; every unit logged."""
    extra: dict = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        extra["mp_policy"] = mp_policy
    for i, layer in enumerate(model):
        fully_shard(layer, mesh=mesh, **extra)
        layer.set_custom_all_gather(_CountingAllGather(log, i))
        layer.set_custom_reduce_scatter(_CountingReduceScatter(log, i))
        # Registered after fully_shard, so it runs after FSDP has gathered the layer.
        layer.register_forward_pre_hook(lambda *_: log.whole_in_forward.append(log.whole()))
    fully_shard(model, mesh=mesh, **extra)


def _local_bytes(tensors) -> int:
    return sum(t.to_local().nbytes for t in tensors)


def worker(
    rank: int,
    world_size: int,
    width: int = 256,
    blocks: int = 4,
    head: int = 10,
    batch: int = 16,
    seed: int = 0,
    micro_batches: Sequence[int] = (1, 2, 4),
) -> dict:
    """One FSDP2 training step with Adam on this rank's slice of the batch; see the module.

    Every rank builds the same model from ``seed`` and takes its slice of the
    same batch (``batch`` must divide by ``world_size``, so FSDP's average of
    the slices' gradients is the full batch's gradient). ``"accumulation"`` holds
    :func:`accumulation_traffic` for ``micro_batches``, on the same model with the
    head rounded up to a multiple of ``world_size`` outputs (no padding).
    """
    size = _checks.count("batch", batch, minimum=1)
    if size % world_size:
        raise ValueError(f"batch must be divisible by world_size = {world_size}, got {batch}")
    _check_micro_batches(size, world_size, micro_batches)
    even_head = world_size * -(-_checks.count("head", head, minimum=1) // world_size)
    dev = device()
    mesh = init_device_mesh(dev.type, (world_size,))
    x, y = step_data(size, width, head, seed)
    mine = slice(rank * size // world_size, (rank + 1) * size // world_size)
    x, y = x[mine].to(dev), y[mine].to(dev)

    model = sharded_model(width, blocks, head, seed).to(dev)
    reference = copy.deepcopy(model)  # one device's copy, for the update check
    reference_copy = copy.deepcopy(model)  # the same weights, for the memory steps
    log = _Log(model)
    _shard(model, mesh, log)
    params = list(model.parameters())
    allocated = sum(p.to_local().untyped_storage().nbytes() for p in params)

    loss_fn(model(x), y).backward()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    optimizer.step()
    states = [optimizer.state[p] for p in params]
    result = {
        "bytes": {
            "weights": _local_bytes(params),
            "gradients": _local_bytes(p.grad for p in params),
            "Adam momentum": _local_bytes(s["exp_avg"] for s in states),
            "Adam variance": _local_bytes(s["exp_avg_sq"] for s in states),
        },
        "allocated weight bytes": allocated,
        "parameters held": sum(p.to_local().numel() for p in params),
        "collectives": log.collectives,
        "whole in forward": log.whole_in_forward,
    }

    # The full gradient, gathered from the shards (every rank takes part).
    names = [name for name, _ in model.named_parameters()]
    gradients = {n: p.grad.full_tensor().cpu() for n, p in zip(names, params, strict=True)}
    # One device updating everything with the same gradient and the same Adam...
    for p, name in zip(reference.parameters(), names, strict=True):
        p.grad = gradients[name].to(dev)
    torch.optim.Adam(reference.parameters(), lr=1e-3).step()
    # ...against the shards each rank updated on its own.
    updated = [p.full_tensor() for p in params]
    result["update difference"] = max(
        (a - b).abs().max().item() for a, b in zip(updated, reference.parameters(), strict=True)
    )
    if rank == 0:
        result["gradients"] = gradients

    result["mixed precision"] = _mixed_precision_step(mesh, x, y, width, blocks, head, seed)
    result["accumulation"] = accumulation_traffic(
        mesh, rank, world_size, micro_batches, width, blocks, even_head, size, seed
    )
    result["memory"] = {
        ahead: memory_step(mesh, x, y, copy.deepcopy(reference_copy), forward_prefetch=ahead)
        for ahead in (0, 1)
    }
    print(
        f"holds {result['parameters held']:,} parameters of "
        f"{sum(g.numel() for g in gradients.values()):,}"
    )
    return result


def _mixed_precision_step(mesh, x, y, width, blocks, head, seed) -> dict:
    """The same step with FSDP2's bf16 mixed precision: what is gathered, what is kept."""
    model = sharded_model(width, blocks, head, seed).to(x.device)
    log = _Log(model)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    _shard(model, mesh, log, policy)
    loss_fn(model(x).float(), y).backward()
    params = list(model.parameters())
    return {
        "collectives": log.collectives,
        "sharded weight dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
        "gradient dtypes": sorted({str(p.grad.dtype).removeprefix("torch.") for p in params}),
    }


# --- What a rank holds, moment by moment ------------------------------------------------


def _param_groups(model: nn.Sequential) -> list:
    """FSDP2's parameter group of each unit (its private state, read only)."""
    return [layer._get_fsdp_state()._fsdp_param_groups[0] for layer in model]


def _held_bytes(groups: list, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of every tensor FSDP2 and Adam hold now, by what they are.

    Each storage is counted once, at its allocated size (``untyped_storage().nbytes()``:
    padding included, 0 once FSDP has freed it): the sharded weights, the gradient
    shards, Adam's two moments; the unsharded weights of each parameter and the flat
    all-gather outputs FSDP still holds (a prefetched unit's, and the last forward
    one's); the unsharded gradients and the reduce-scatter inputs FSDP still holds.
    """
    seen: set[int] = set()

    def total(tensors) -> int:
        count = 0
        for t in tensors:
            if t is None:
                continue
            local = t.to_local() if isinstance(t, DTensor) else t
            storage = local.untyped_storage()
            if storage.nbytes() and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                count += storage.nbytes()
        return count

    params = [p for group in groups for p in group.fsdp_params]
    context = groups[0].comm_ctx
    pending = [g._all_gather_result for g in groups if g._all_gather_result is not None]
    if context.all_gather_state is not None:
        pending.append(context.all_gather_state.all_gather_result)
    unsharded = [getattr(p, "_unsharded_param", None) for p in params]
    with torch.no_grad():
        return {
            "sharded weights": total(p.sharded_param for p in params),
            "gradient shards": total(p.sharded_param.grad for p in params),
            "optimizer state": total(
                optimizer.state[p.sharded_param][key]
                for p in params
                if p.sharded_param in optimizer.state
                for key in ("exp_avg", "exp_avg_sq")
            ),
            "whole weights": total(
                [t for p in params for t in getattr(p, "all_gather_outputs", [])]
                + [result.all_gather_output for result in pending]
            ),
            "whole gradients": total(
                [u.grad for u in unsharded if u is not None]
                + [state.reduce_scatter_input for state in context.reduce_scatter_states]
            ),
        }


def _watch_post_backward(group, record) -> None:
    """Call ``record()`` when the unit's gradients are complete, before FSDP reduces them."""
    original = group.post_backward

    def post_backward(*args):
        record()
        return original(*args)

    group.post_backward = post_backward


def memory_step(
    mesh, x: torch.Tensor, y: torch.Tensor, model: nn.Sequential, forward_prefetch: int = 0
) -> dict:
    """The bytes this rank holds at every moment of an FSDP2 training step of ``model``.

    ``model`` (unsharded, e.g. a copy of :func:`sharded_model`) is sharded as the
    worker shards it. One step with Adam first (so that Adam's state exists),
    ``zero_grad()``, then the measured step: the bytes of :func:`_held_bytes` during
    each unit's forward (after FSDP's pre-forward), at the end of each unit's backward
    (its gradients complete, before FSDP's post-backward reduces them) and before the
    optimiser step. With ``forward_prefetch`` > 0 each unit prefetches the next ones
    explicitly (``set_modules_to_forward_prefetch``). Returns ``"moments"`` (one dict
    per moment, with ``"phase"`` and ``"unit"``) and the ``"collectives"`` of the
    measured step.
    """
    ahead = _checks.count("forward_prefetch", forward_prefetch)
    log = _Log(model)
    _shard(model, mesh, log)
    units = list(model)
    for i, unit in enumerate(units[:-1]):
        if ahead:
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + ahead])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    log.collectives.clear()

    groups = _param_groups(model)
    moments: list[dict] = []

    def record(phase: str, unit: int | None) -> None:
        moments.append({"phase": phase, "unit": unit, **_held_bytes(groups, optimizer)})

    for i, (unit, group) in enumerate(zip(units, groups, strict=True)):
        unit.register_forward_pre_hook(lambda *_, i=i: record("forward", i))
        _watch_post_backward(group, lambda i=i: record("backward", i))
    loss_fn(model(x), y).backward()
    record("optimiser", None)
    optimizer.step()
    return {"moments": moments, "collectives": log.collectives}


# --- Gradient accumulation: what each setup sends per step -----------------------------

ACCUMULATION_SETUPS = (
    "DDP, no_sync",
    "ZeRO-2",
    "ZeRO-3",
    "ZeRO-3, no gradient sync",
    "ZeRO-3, bf16, fp32 reduce",
    "ZeRO-3, bf16, bf16 reduce",
)
"""The setups :func:`accumulation_worker` runs, each one step of ``k`` micro-batches:

* ``DDP, no_sync``: ``DistributedDataParallel``, ``no_sync()`` on all but the last;
* ``ZeRO-2``: FSDP2 with ``reshard_after_forward=False`` and
  ``set_reshard_after_backward(False)`` on all but the last micro-batch: the weights
  stay whole through the step, the gradients are reduce-scattered every micro-batch;
* ``ZeRO-3``: FSDP2's defaults;
* ``ZeRO-3, no gradient sync``: ``set_requires_gradient_sync(False)`` on all but the
  last micro-batch: whole gradients accumulate, one reduce-scatter per step;
* ``ZeRO-3, bf16, ...``: ``MixedPrecisionPolicy(param_dtype=bfloat16)`` with
  ``reduce_dtype`` fp32 or left to bf16; run for the first count of micro-batches
  only (the reduce dtype's factor does not depend on it)."""


def _counting_all_reduce(log: list, bucket):
    """DDP's all-reduce of a gradient bucket, logged (a DDP communication hook)."""
    log.append({"kind": "all-reduce", "bytes": bucket.buffer().nbytes})
    return default_hooks.allreduce_hook(None, bucket)


def _accumulated_step(setup: str, mesh, x, y, micro_batches: int, model: nn.Sequential) -> list:
    """One step of ``micro_batches`` micro-batches under ``setup``; the collectives issued."""
    k = micro_batches
    if setup.startswith("DDP"):
        ddp = DistributedDataParallel(model)
        log: list = []
        ddp.register_comm_hook(log, _counting_all_reduce)
        for m, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k), strict=True)):
            with ddp.no_sync() if m < k - 1 else contextlib.nullcontext():
                (loss_fn(ddp(xm), ym) / k).backward()
        return log
    fsdp_log = _Log(model)
    policy = None
    if "bf16" in setup:
        reduce = torch.float32 if "fp32 reduce" in setup else None
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce)
    _shard(model, mesh, fsdp_log, policy, reshard_after_forward=setup != "ZeRO-2")
    for m, (xm, ym) in enumerate(zip(x.chunk(k), y.chunk(k), strict=True)):
        last = m == k - 1
        if setup == "ZeRO-2":
            model.set_reshard_after_backward(last)
        if setup == "ZeRO-3, no gradient sync":
            model.set_requires_gradient_sync(last)
        (loss_fn(model(xm).float(), ym) / k).backward()
    return [{"kind": c["kind"], "bytes": c["bytes"]} for c in fsdp_log.collectives]


def _check_micro_batches(
    batch: int, world_size: int, micro_batches: Sequence[int]
) -> tuple[int, list[int]]:
    """``batch`` and the ``micro_batches`` counts, checked: each rank's slice must split
    into every count of micro-batches."""
    size = _checks.count("batch", batch, minimum=1)
    if isinstance(micro_batches, str | bytes) or not isinstance(micro_batches, Sequence):
        raise ValueError(f"micro_batches must be a sequence of counts, got {micro_batches!r}")
    ks = [_checks.count("micro_batches", k, minimum=1) for k in micro_batches]
    for k in ks:
        if size % (world_size * k):
            raise ValueError(
                f"batch must be divisible by world_size x micro_batches = {world_size * k}, "
                f"got {batch}"
            )
    return size, ks


def accumulation_traffic(
    mesh,
    rank: int,
    world_size: int,
    micro_batches: Sequence[int] = (1, 2, 4),
    width: int = 256,
    blocks: int = 4,
    head: int = 12,
    batch: int = 16,
    seed: int = 0,
) -> dict[str, dict[int, dict[str, int]]]:
    """Bytes of the collectives of one step, per setup of :data:`ACCUMULATION_SETUPS`
    and per number of micro-batches ``k``: ``{setup: {k: {kind: bytes}}}`` (the bf16
    setups for the first ``k`` only).

    ``bytes`` is the size of the whole tensor each collective works on, summed per
    kind: an all-reduce's bucket, an all-gather's output, a reduce-scatter's input.
    Each rank splits its slice of ``batch`` examples into ``k`` micro-batches (it must
    divide by ``world_size * k``). A ``head`` that divides by ``world_size`` (12 on 4
    ranks) leaves no tensor padded.
    """
    size, ks = _check_micro_batches(batch, world_size, micro_batches)
    dev = device()
    x, y = step_data(size, width, head, seed)
    mine = slice(rank * size // world_size, (rank + 1) * size // world_size)
    x, y = x[mine].to(dev), y[mine].to(dev)
    base = sharded_model(width, blocks, head, seed).to(dev)
    traffic: dict[str, dict[int, dict[str, int]]] = {}
    for setup in ACCUMULATION_SETUPS:
        traffic[setup] = {}
        for k in ks[:1] if "bf16" in setup else ks:
            totals: dict[str, int] = {}
            for c in _accumulated_step(setup, mesh, x, y, k, copy.deepcopy(base)):
                totals[c["kind"]] = totals.get(c["kind"], 0) + c["bytes"]
            traffic[setup][k] = totals
    return traffic


def accumulation_worker(
    rank: int, world_size: int, micro_batches: Sequence[int] = (1, 2, 4), head: int = 12
) -> dict[str, dict[int, dict[str, int]]]:
    """:func:`accumulation_traffic` on its own, as a worker (the chapter's model, a head
    of ``head`` outputs, a batch of ``4 * world_size * max(micro_batches)``)."""
    batch = 4 * world_size * max(_check_micro_batches(1, 1, micro_batches)[1])
    mesh = init_device_mesh(device().type, (world_size,))
    return accumulation_traffic(mesh, rank, world_size, micro_batches, head=head, batch=batch)


# --- "Write it yourself": one ZeRO-1 step, checked on real ranks -------------------------

ZERO1_LENGTH = 1024
"""Weights in the ZeRO-1 exercise (a multiple of every world size up to 8 but 3, 5, 7)."""

ZERO1_STEPS = 3
"""Optimiser steps the exercise runs, so that Adam's moments carry over between steps."""

ZERO1_LR = 1e-2
"""Adam's learning rate in the exercise."""

ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8
"""``torch.optim.Adam``'s defaults, which :func:`adam_update` uses."""


def adam_update(weights: torch.Tensor, grad: torch.Tensor, state: dict) -> torch.Tensor:
    """One Adam step on ``weights`` with ``grad``, as ``torch.optim.Adam`` takes it
    (betas 0.9 and 0.999, eps 1e-8, learning rate :data:`ZERO1_LR`, no weight decay);
    returns the new weights and leaves ``weights`` as it was.

    ``state`` keeps Adam's step count and two moments for exactly these elements from
    one call to the next: call it with the same dict every step (empty at first). In
    the ZeRO-1 exercise each rank calls it on its own slice only, so its state holds
    ``2/N`` of the moments.
    """
    if weights.shape != grad.shape:
        raise ValueError(f"grad has shape {tuple(grad.shape)}, weights {tuple(weights.shape)}")
    if not state:
        zeros = torch.zeros_like(weights)
        state.update(step=0, exp_avg=zeros, exp_avg_sq=zeros.clone())
    if state["exp_avg"].shape != weights.shape:
        raise ValueError(
            f"state holds moments of shape {tuple(state['exp_avg'].shape)}, not"
            f" {tuple(weights.shape)}: use one state per slice, the same every step"
        )
    (beta1, beta2), step = ADAM_BETAS, state["step"] + 1
    state["step"] = step
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(ADAM_EPS)
    return weights.clone().addcdiv_(state["exp_avg"], denom, value=-ZERO1_LR / (1 - beta1**step))


def zero1_inputs(length: int, ranks: int, steps: int) -> tuple[torch.Tensor, list]:
    """The exercise's float64 starting weights (the same on every rank) and each step's
    gradient on each rank (``[step][rank]``), drawn from fixed seeds."""
    weights = torch.randn(length, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grads = [
        [
            torch.randn(
                length,
                dtype=torch.float64,
                generator=torch.Generator().manual_seed(1 + step * ranks + rank),
            )
            for rank in range(ranks)
        ]
        for step in range(steps)
    ]
    return weights, grads


def _state_values(state: object) -> int:
    """Tensor elements held in ``state``, however nested in dicts, lists and tuples."""
    if isinstance(state, torch.Tensor):
        return state.numel()
    if isinstance(state, dict):
        return sum(_state_values(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(_state_values(v) for v in state)
    return 0


def zero1_exercise_worker(
    rank: int, world_size: int, source: str, name: str, length: int, steps: int
) -> dict:
    """On one rank: build the reader's step from ``source`` and run ``steps`` steps of it
    from :func:`zero1_inputs`; return the weights after each, the tensor elements its
    state holds, and the bytes this rank put into each kind of collective."""
    weights, grads = zero1_inputs(length, world_size, steps)
    sent: dict[str, int] = {}
    watch_communication(sent)
    step = load_reader_function(source, name, {"torch": torch, "dist": dist, "adam": adam_update})
    state: dict = {}
    history = []
    for k in range(steps):
        weights = step(weights.clone(), grads[k][rank].clone(), state)
        if not isinstance(weights, torch.Tensor) or weights.shape != (length,):
            raise ExerciseError(f"your step must return all {length} weights as a tensor")
        history.append(weights.detach().clone())
    return {"weights": history, "state values": _state_values(state), "sent": sent}


def zero1_reference(length: int, ranks: int, steps: int, mean: bool = True) -> list:
    """One process's weights after each step: ``torch.optim.Adam`` on the full weights
    with the ranks' gradients averaged (or summed, ``mean=False``)."""
    weights, grads = zero1_inputs(length, ranks, steps)
    param = nn.Parameter(weights)
    optimizer = torch.optim.Adam([param], lr=ZERO1_LR, foreach=False)
    history = []
    for step_grads in grads:
        total = torch.stack(step_grads).sum(dim=0)
        param.grad = total / ranks if mean else total
        optimizer.step()
        history.append(param.detach().clone())
    return history


def _sent(sent: dict[str, int], prefix: str) -> int:
    return sum(v for k, v in sent.items() if k.startswith(prefix) and not k.endswith("calls"))


def check_zero1_exercise(
    function: Callable[..., torch.Tensor],
    ranks: int = 4,
    length: int = ZERO1_LENGTH,
    steps: int = ZERO1_STEPS,
    timeout: float = 60.0,
) -> ExerciseReport:
    """Run the reader's ZeRO-1 step on ``ranks`` real gloo processes and check it.

    ``function(weights, grad, state)`` is called on every rank, ``steps`` times, with
    the full float64 weights (the same on every rank), this rank's own gradient and a
    dict it may keep between steps; it must return the full new weights. Checked, as
    a course's tests would: after every step, every rank's weights equal one
    process's ``torch.optim.Adam`` on the mean gradient (to 1e-12); each rank's state
    holds the moments of its own ``1/N`` of the weights only; and each rank put its
    gradient into a reduce-scatter and its slice into an all-gather, once a step.
    The names the function may use: ``torch``, ``dist`` and ``adam``
    (:func:`adam_update`).
    """
    n = _checks.count("ranks", ranks, minimum=2)
    size = _checks.count("length", length, minimum=n)
    if size % n:
        raise ValueError(f"length must be a multiple of ranks ({n}), got {size}")
    count = _checks.count("steps", steps, minimum=1)
    source, name = reader_source(function)
    steps_text = f"{count} step{'s' * (count > 1)}"
    report = ExerciseReport(f"your ZeRO-1 step on {n} ranks, {size:,} weights, {steps_text}:")
    try:
        results = run_ranks(zero1_exercise_worker, n, source, name, size, count, timeout=timeout)
    except RankError as error:
        hint = "every rank must call the same collectives, in the same order"
        report.fail(rank_failure(error, timeout, hint))
        return report
    mean, summed = (zero1_reference(size, n, count, m) for m in (True, False))
    shard = size // n
    for k in range(count):
        wrong = [
            r for r, got in enumerate(results) if (got["weights"][k] - mean[k]).abs().max() > 1e-12
        ]
        if not wrong:
            report.ok(f"step {k + 1}: every rank's weights equal Adam's on the mean gradient")
            continue
        r = wrong[0]
        got, mine = results[r]["weights"][k], slice(r * shard, (r + 1) * shard)
        if (got - summed[k]).abs().max() <= 1e-12:
            report.fail(
                f"step {k + 1}: the weights follow Adam on the *sum* of the ranks' gradients:"
                " divide your reduced slice by the number of ranks (Adam hardly notices the"
                " scale, so this check compares to 1e-12, in float64)"
            )
        elif (got[mine] - mean[k][mine]).abs().max() <= 1e-12:
            report.fail(
                f"step {k + 1}: rank {r}'s own slice is right, the rest of its weights is"
                " not: all-gather every rank's updated slice, in rank order"
            )
        else:
            gap = (got[mine] - mean[k][mine]).abs().max().item()
            report.fail(
                f"step {k + 1}: rank {r}'s own slice [{mine.start}:{mine.stop}] is off by up"
                f" to {gap:.1e}: rank r updates slice r of the weights with slice r of the"
                " mean gradient, which the reduce-scatter gives it"
            )
        break
    held = [result["state values"] for result in results]
    if all(h <= 2 * shard for h in held):
        report.ok(f"each rank's optimiser state holds {max(held):,} values: 2 moments x 1/{n}")
    else:
        report.fail(
            f"the ranks' optimiser states hold {held} values; ZeRO-1 keeps the two moments"
            f" of its own 1/{n} only, {2 * shard:,}: call adam on your slice, not on all"
        )
    sent = [result["sent"] for result in results]
    if any(s.get("all_reduce calls") for s in sent):
        report.fail(
            "you all-reduced: every rank then receives the whole summed gradient and uses"
            f" 1/{n} of it; a reduce-scatter gives it just its slice"
        )
    full, part = count * size * 8, count * shard * 8  # float64 bytes
    if all(_sent(s, "reduce_scatter") == full and _sent(s, "all_gather") == part for s in sent):
        report.ok(
            f"each step, each rank put its gradient ({size * 8:,} bytes) into a"
            f" reduce-scatter and its slice ({shard * 8:,} bytes) into an all-gather"
        )
    else:
        report.fail(
            f"bytes each rank put into reduce-scatters {[_sent(s, 'reduce_scatter') for s in sent]}"
            f" and all-gathers {[_sent(s, 'all_gather') for s in sent]}: ZeRO-1 reduce-scatters"
            f" its whole gradient ({full:,} bytes in {count} step{'s' * (count > 1)}) and"
            f" all-gathers its slice ({part:,})"
        )
    return report


def main(rank: int, world_size: int) -> None:
    """``torchrun`` entry: run :func:`worker`; rank 0 checks the gradient and reports."""
    from trainscale.parallel import full_batch_gradient

    batch = 4 * world_size
    got = worker(rank, world_size, batch=batch)
    if rank != 0:
        return
    x, y = step_data(batch)
    expected = full_batch_gradient(sharded_model(), loss_fn, x, y)
    error = max((got["gradients"][k] - g).abs().max().item() for k, g in expected.items())
    print(f"{world_size} ranks: rank 0 holds {got['bytes']} bytes of model state")
    print(f"largest gradient difference from one process: {error:.1e}")
    print(f"sharded Adam update vs one device's: {got['update difference']:.1e}")


if __name__ == "__main__":
    torchrun_main(main)
