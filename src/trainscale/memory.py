"""Where the memory goes (chapters 02, 05 and 09).

Model state, the part that scales with the parameter count alone, is counted
with :data:`BYTES_PER_PARAM` and :func:`model_state_bytes`. Activations, the
part that scales with the batch, are measured rather than estimated:
:func:`saved_activation_bytes` records every tensor autograd keeps for the
backward pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainscale import _checks

BYTES_PER_PARAM: dict[str, int] = {
    "weights": 2,  # bf16 copy used by forward and backward
    "gradients": 2,  # bf16, one per weight
    "master weights": 4,  # fp32 copy the optimiser updates
    "Adam momentum": 4,  # fp32 first moment (running mean of gradients)
    "Adam variance": 4,  # fp32 second moment (running mean of squared gradients)
}
"""Bytes per parameter of each part of the model state, for bf16 mixed-precision
training with Adam: 16 in all."""

OPTIMIZER_STATE = ("master weights", "Adam momentum", "Adam variance")
"""The parts ZeRO stage 1 shards (12 bytes per parameter)."""

SHARDED_FROM_STAGE: dict[str, int] = {
    "weights": 3,
    "gradients": 2,
    **{part: 1 for part in OPTIMIZER_STATE},
}
"""The first ZeRO stage that shards each part across the GPUs."""

GIB = 2**30
"""Bytes in a GiB (binary); a GB is 10**9 bytes."""

USABLE_MEMORY = 0.9
"""Share of a GPU's memory an estimate may fill with what it counts (model state and
activations); the rest is left for what it does not count (CUDA context, NCCL buffers,
allocator fragmentation). The planner (chapter 13) uses it."""


def model_state_parts(params: float, gpus: int = 1, zero_stage: int = 0) -> dict[str, int]:
    """Bytes one GPU holds of each part of the model state.

    With ``zero_stage`` 0 (plain data parallelism) every GPU holds everything.
    Stage 1 shards the optimiser state over ``gpus``, stage 2 the gradients as
    well, stage 3 (FSDP) the weights too. A sharded part is split into ``gpus``
    shards of ``ceil(params / gpus)`` parameters, the largest shard being what a
    GPU must fit (FSDP pads to equal shards the same way).
    """
    n = _checks.count("params", params)
    n_gpus = _checks.count("gpus", gpus, minimum=1)
    stage = _checks.choice("zero_stage", zero_stage, (0, 1, 2, 3))
    shard = math.ceil(n / n_gpus)
    return {
        part: size * (shard if stage >= SHARDED_FROM_STAGE[part] else n)
        for part, size in BYTES_PER_PARAM.items()
    }


STATE_GROUPS = ("weights", "gradients", "optimiser state")
"""How the book's figures, tables and planner group the model state: the
optimiser state is :data:`OPTIMIZER_STATE` (fp32 master weights and Adam's moments)."""


def model_state_groups(params: float, gpus: int = 1, zero_stage: int = 0) -> dict[str, int]:
    """Bytes one GPU holds of weights, gradients and optimiser state (keys :data:`STATE_GROUPS`).

    :func:`model_state_parts`, with the parts of :data:`OPTIMIZER_STATE` added up:
    for one parameter on one GPU, 2, 2 and 12 bytes.
    """
    parts = model_state_parts(params, gpus, zero_stage)
    return {
        "weights": parts["weights"],
        "gradients": parts["gradients"],
        "optimiser state": sum(parts[part] for part in OPTIMIZER_STATE),
    }


def model_state_bytes(params: float, gpus: int = 1, zero_stage: int = 0) -> int:
    """Bytes of model state on one GPU (see :func:`model_state_parts`)."""
    return sum(model_state_parts(params, gpus, zero_stage).values())


def model_state_gib(params: int | float, gpus: int = 1, zero_stage: int = 0) -> float:
    """Model state on one GPU in GiB (2**30 bytes)."""
    return model_state_bytes(params, gpus, zero_stage) / GIB


def _uniform(shape: tuple[int, ...], bound: float) -> torch.Tensor:
    """fp32 draws from U(-bound, bound), the same on every CPU.

    PyTorch's ``uniform_`` computes ``u * 2b - b`` in fp32 from a 24-bit
    ``u`` in [0, 1); whether that multiply-add is rounded once (fused) or twice
    depends on the CPU's kernels, so the last bit of half the weights differs
    between CPUs. Here the product and the sum are exact in float64 (24-bit
    ``u`` times a 25-bit ``2b``, plus ``-b``), so the one rounding to fp32 is
    the fused multiply-add's: the numbers ``uniform_`` gives with fused
    kernels (AVX2, AVX-512), from the same random draws, on every CPU.
    """
    low = torch.tensor(-bound, dtype=torch.float32).double()
    span = -2.0 * low  # exact: 2 * fp32(bound)
    return (torch.rand(shape).double() * span + low).float()


def _linear(fan_in: int, fan_out: int) -> nn.Linear:
    """``nn.Linear(fan_in, fan_out)`` with PyTorch's default initialisation, drawn
    in the same order (weight, then bias) but with :func:`_uniform`."""
    layer = nn.utils.skip_init(nn.Linear, fan_in, fan_out)
    gain = nn.init.calculate_gain("leaky_relu", math.sqrt(5))  # kaiming_uniform_'s
    with torch.no_grad():
        layer.weight.copy_(
            _uniform(layer.weight.shape, math.sqrt(3.0) * (gain / math.sqrt(fan_in)))
        )
        layer.bias.copy_(_uniform(layer.bias.shape, 1 / math.sqrt(fan_in)))
    return layer


def mlp_stack(width: int = 256, blocks: int = 8, seed: int = 0) -> torch.nn.Sequential:
    """The book's reference model: ``blocks`` MLP blocks of ``width`` features.

    Each block is ``Linear(width, 4*width) -> GELU -> Linear(4*width, width) -> GELU``
    in fp32, initialised as ``nn.Linear`` is, with the same weights on every CPU
    (see :func:`_uniform`). The weights come from ``seed`` without touching the
    global random state, so building a model never changes what a later cell draws.
    """
    w = _checks.count("width", width, minimum=1)
    n_blocks = _checks.count("blocks", blocks, minimum=1)
    seed = _checks.count("seed", seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers = [
            nn.Sequential(_linear(w, 4 * w), nn.GELU(), _linear(4 * w, w), nn.GELU())
            for _ in range(n_blocks)
        ]
    return nn.Sequential(*layers)


def run_checkpointed(model: nn.Sequential, x: torch.Tensor, segment: int = 1) -> torch.Tensor:
    """Forward ``x`` through ``model`` with activation checkpointing.

    The top-level blocks are grouped into segments of ``segment`` blocks; each
    segment keeps only its input and recomputes the rest during backward.
    """
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"model must be an nn.Sequential of blocks, got {type(model).__name__}")
    size = _checks.count("segment", segment, minimum=1)
    blocks = list(model)
    for start in range(0, len(blocks), size):
        part = nn.Sequential(*blocks[start : start + size])
        x = checkpoint(part, x, use_reentrant=False)
    return x


@contextmanager
def _record_saved(exclude: set[int], seen: dict[int, int]) -> Iterator[None]:
    """Record the storage of every tensor autograd saves, skipping ``exclude``.

    Tensors are keyed by their storage, so a tensor saved twice (the output of
    one layer is often the saved input of the next) is counted once, and views
    of a weight (``weight.t()`` saved by a matmul) are recognised as the weight.
    """

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    def unpack(saved: torch.Tensor) -> torch.Tensor:
        return saved  # nothing was changed when packing, so nothing to undo

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def saved_activation_bytes(
    model: torch.nn.Module, x: torch.Tensor, checkpointed: bool = False, segment: int = 1
) -> int:
    """Bytes autograd keeps from one forward pass of ``model`` on ``x``.

    These are the activations: what backward will read. The model's own
    parameters are saved too (a matmul needs its weight to pass the gradient
    back) but they live on the GPU anyway, so they are excluded. With
    ``checkpointed=True`` the model (an ``nn.Sequential``) runs through
    :func:`run_checkpointed` in segments of ``segment`` blocks.
    """
    exclude = {weight.untyped_storage().data_ptr() for weight in model.parameters()}
    seen: dict[int, int] = {}
    with _record_saved(exclude, seen):
        if checkpointed:
            run_checkpointed(model, x, segment)  # type: ignore[arg-type]
        else:
            model(x)
    return sum(seen.values())
