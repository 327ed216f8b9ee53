"""FSDP2 on real processes (chapter 05).

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
* the same step with bf16 mixed precision: the dtypes FSDP gathers and keeps.

The same file runs on a GPU node, one process per GPU, with NCCL::

    torchrun --nproc-per-node=8 -m trainscale.workers.sharding
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from trainscale import _checks
from trainscale.distributed import device, torchrun_main
from trainscale.memory import mlp_stack

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


def _shard(model: nn.Sequential, mesh, log: _Log, mp_policy=None) -> None:
    """FSDP2 the usual way: each layer its own unit, then the root; every unit logged."""
    extra = {} if mp_policy is None else {"mp_policy": mp_policy}
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
) -> dict:
    """One FSDP2 training step with Adam on this rank's slice of the batch; see the module.

    Every rank builds the same model from ``seed`` and takes its slice of the
    same batch (``batch`` must divide by ``world_size``, so FSDP's average of
    the slices' gradients is the full batch's gradient).
    """
    size = _checks.count("batch", batch, minimum=1)
    if size % world_size:
        raise ValueError(f"batch must be divisible by world_size = {world_size}, got {batch}")
    dev = device()
    mesh = init_device_mesh(dev.type, (world_size,))
    x, y = step_data(size, width, head, seed)
    mine = slice(rank * size // world_size, (rank + 1) * size // world_size)
    x, y = x[mine].to(dev), y[mine].to(dev)

    model = sharded_model(width, blocks, head, seed).to(dev)
    reference = copy.deepcopy(model)  # one device's copy, for the update check
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
