"""Where the memory goes (chapters 2, 7, 12 and 3).

Model state, the part that scales with the parameter count alone, is counted
with :data:`BYTES_PER_PARAM` and :func:`model_state_bytes`; :class:`StateDtypes`
sets the dtype of each part, so other recipes (fp32 gradients, chapter 12) are
counted by the same functions. Activations, the
part that scales with the batch, are measured rather than estimated:
:func:`saved_activation_bytes` records every tensor autograd keeps for the
backward pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainscale import _checks

if TYPE_CHECKING:  # torch runs only where tensors do: the model-state counts need none
    import torch
    from torch import nn

GRADIENT_COPY = "gradient copy"
"""The optimiser's own copy of the gradients, kept only by some recipes
(:data:`FP16_GRADIENTS_WITH_FP32_COPY`): optimiser state, sharded from ZeRO stage 1
like :data:`OPTIMIZER_STATE`."""


DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
"""Bytes per element of each floating-point dtype the model state may be kept in, by its
torch name (``torch.finfo(dtype).bits // 8``, which a test checks for every name here):
the state's sizes are counted without importing torch."""


@dataclass(frozen=True)
class StateDtypes:
    """The dtype each part of the model state is kept in (``None``: the part is not kept).

    ``weights``: the copy forward and backward read; ``gradients``: the gradients
    backward accumulates into and data parallelism reduces; ``master_weights``: the
    copy the optimiser updates (``None`` when it updates ``weights`` themselves);
    ``optimizer_moments``: each of Adam's two moments; ``gradient_copy``: a second
    copy of the gradients, in the master weights' dtype, that the optimiser steps
    with (``None`` when it reads ``gradients`` directly). The defaults are the
    book's 16 bytes per parameter. Each dtype is a name of :data:`DTYPE_BYTES`
    (``"bfloat16"``) or the ``torch.dtype`` of that name (``torch.bfloat16``).
    """

    weights: str | torch.dtype = "bfloat16"
    gradients: str | torch.dtype = "bfloat16"
    master_weights: str | torch.dtype | None = "float32"
    optimizer_moments: str | torch.dtype = "float32"
    gradient_copy: str | torch.dtype | None = None


def _dtype_bytes(name: str, dtype: object, optional: bool) -> int:
    """Bytes per element of a floating-point ``dtype``, a name of :data:`DTYPE_BYTES` or
    the ``torch.dtype`` of that name (0 for ``None`` where allowed)."""
    if dtype is None and optional:
        return 0
    kind = type(dtype)
    is_torch_dtype = (kind.__module__, kind.__name__) == ("torch", "dtype")
    key = str(dtype).removeprefix("torch.") if is_torch_dtype else dtype
    if not isinstance(key, str) or key not in DTYPE_BYTES:
        allowed = f"one of {', '.join(DTYPE_BYTES)} (or its torch.dtype)"
        raise ValueError(f"{name} must be {allowed}{' or None' * optional}, got {dtype!r}")
    return DTYPE_BYTES[key]


def state_bytes_per_param(dtypes: StateDtypes | None = None) -> dict[str, int]:
    """Bytes per parameter of each part of the model state kept in ``dtypes``.

    Keys, in order: ``"weights"``, ``"gradients"``, ``"gradient copy"`` (only if
    kept), ``"master weights"`` (only if kept), ``"Adam momentum"`` and ``"Adam
    variance"``. The sizes come from :data:`DTYPE_BYTES` (``torch.finfo(dtype).bits //
    8``). With the defaults (:class:`StateDtypes`): 2 + 2 + 4 + 4 + 4 = 16.
    """
    kept = StateDtypes() if dtypes is None else dtypes
    if not isinstance(kept, StateDtypes):
        raise ValueError(f"dtypes must be a StateDtypes, got {kept!r}")
    moment = _dtype_bytes("optimizer_moments", kept.optimizer_moments, optional=False)
    sizes = {
        "weights": _dtype_bytes("weights", kept.weights, optional=False),
        "gradients": _dtype_bytes("gradients", kept.gradients, optional=False),
        GRADIENT_COPY: _dtype_bytes("gradient_copy", kept.gradient_copy, optional=True),
        "master weights": _dtype_bytes("master_weights", kept.master_weights, optional=True),
        "Adam momentum": moment,
        "Adam variance": moment,
    }
    return {part: size for part, size in sizes.items() if size}


BYTES_PER_PARAM: dict[str, int] = state_bytes_per_param()
"""Bytes per parameter of each part of the model state, for bf16 mixed-precision
training with Adam (the defaults of :class:`StateDtypes`): bf16 weights and gradients
(2 + 2), fp32 master weights (4), fp32 Adam momentum and variance (4 + 4): 16 in all."""

MIXED_16BIT_GRADIENTS = StateDtypes()
"""16 bytes per parameter: 16-bit weights and gradients, fp32 master weights and Adam
moments. The count of the ZeRO paper (2 + 2 + 12, its ``K = 12``)."""

FP32_MAIN_GRADIENTS = StateDtypes(gradients="float32")
"""18 bytes per parameter: bf16 weights, gradients accumulated and reduced in fp32 (4),
fp32 master weights and moments. Megatron-Core with ``--bf16``, which turns on
``--accumulate-allreduce-grads-in-fp32`` (the "float16 param, fp32 grads" row of its
distributed optimizer's table)."""

FP16_GRADIENTS_WITH_FP32_COPY = StateDtypes(
    weights="float16", gradients="float16", gradient_copy="float32"
)
"""20 bytes per parameter: fp16 weights and gradients (2 + 2), and the optimiser's fp32
copy of the gradients (4) next to the fp32 master weights and moments. Megatron-Core with
``--fp16`` (the "float16 param, float16 grads" row of the same table)."""

FP32_WEIGHTS_AND_GRADIENTS = StateDtypes(
    weights="float32", gradients="float32", master_weights=None
)
"""16 bytes per parameter in another split: fp32 weights and gradients (4 + 4) and fp32
moments, no separate master copy. What FSDP2 with ``MixedPrecisionPolicy(param_dtype=
bfloat16, reduce_dtype=float32)`` (torchtitan's default) keeps between steps: the fp32
sharded parameters are the master weights; the bf16 copies exist only for the layers
being computed. Also plain fp32 training."""

OPTIMIZER_STATE = ("master weights", "Adam momentum", "Adam variance")
"""The parts ZeRO stage 1 shards (12 bytes per parameter with the defaults). A recipe
that keeps no master copy has 0 bytes of the first."""

SHARDED_FROM_STAGE: dict[str, int] = {
    "weights": 3,
    "gradients": 2,
    GRADIENT_COPY: 1,
    **{part: 1 for part in OPTIMIZER_STATE},
}
"""The first ZeRO stage that shards each part across the GPUs."""

GIB = 2**30
"""Bytes in a GiB (binary); a GB is 10**9 bytes."""

USABLE_MEMORY = 0.9
"""Share of a GPU's memory an estimate may fill with what it counts (model state and
activations); the rest is left for what it does not count (CUDA context, NCCL buffers,
allocator fragmentation). The planner (chapter 16) uses it."""


def model_state_parts(
    params: float, gpus: int = 1, zero_stage: int = 0, dtypes: StateDtypes | None = None
) -> dict[str, int]:
    """Bytes one GPU holds of each part of the model state (kept in ``dtypes``).

    With ``zero_stage`` 0 (plain data parallelism) every GPU holds everything.
    Stage 1 shards the optimiser state over ``gpus``, stage 2 the gradients as
    well, stage 3 (FSDP) the weights too. A sharded part is split into ``gpus``
    shards of ``ceil(params / gpus)`` parameters, the largest shard being what a
    GPU must fit (FSDP pads to equal shards the same way). ``dtypes`` (default: the
    book's 16 bytes, :data:`BYTES_PER_PARAM`) sets each part's size per parameter
    (:func:`state_bytes_per_param`).
    """
    n = _checks.count("params", params)
    n_gpus = _checks.count("gpus", gpus, minimum=1)
    stage = _checks.choice("zero_stage", zero_stage, (0, 1, 2, 3))
    shard = math.ceil(n / n_gpus)
    return {
        part: size * (shard if stage >= SHARDED_FROM_STAGE[part] else n)
        for part, size in state_bytes_per_param(dtypes).items()
    }


STATE_GROUPS = ("weights", "gradients", "optimiser state")
"""How the book's figures, tables and planner group the model state: the
optimiser state is :data:`OPTIMIZER_STATE` (fp32 master weights and Adam's moments)
and :data:`GRADIENT_COPY` where a recipe keeps one."""


def model_state_groups(
    params: float, gpus: int = 1, zero_stage: int = 0, dtypes: StateDtypes | None = None
) -> dict[str, int]:
    """Bytes one GPU holds of weights, gradients and optimiser state (keys :data:`STATE_GROUPS`).

    :func:`model_state_parts`, with :data:`GRADIENT_COPY` and the parts of
    :data:`OPTIMIZER_STATE` added up:
    for one parameter on one GPU with the default ``dtypes``, 2, 2 and 12 bytes.
    """
    parts = model_state_parts(params, gpus, zero_stage, dtypes)
    return {
        "weights": parts["weights"],
        "gradients": parts["gradients"],
        "optimiser state": sum(parts.get(part, 0) for part in (GRADIENT_COPY, *OPTIMIZER_STATE)),
    }


def model_state_bytes(
    params: float, gpus: int = 1, zero_stage: int = 0, dtypes: StateDtypes | None = None
) -> int:
    """Bytes of model state on one GPU (see :func:`model_state_parts`)."""
    return sum(model_state_parts(params, gpus, zero_stage, dtypes).values())


def model_state_gib(
    params: int | float, gpus: int = 1, zero_stage: int = 0, dtypes: StateDtypes | None = None
) -> float:
    """Model state on one GPU in GiB (2**30 bytes)."""
    return model_state_bytes(params, gpus, zero_stage, dtypes) / GIB


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
    import torch

    low = torch.tensor(-bound, dtype=torch.float32).double()
    span = -2.0 * low  # exact: 2 * fp32(bound)
    return (torch.rand(shape).double() * span + low).float()


def _linear(fan_in: int, fan_out: int) -> nn.Linear:
    """``nn.Linear(fan_in, fan_out)`` with PyTorch's default initialisation, drawn
    in the same order (weight, then bias) but with :func:`_uniform`."""
    import torch
    from torch import nn

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
    import torch
    from torch import nn

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
    from torch import nn
    from torch.utils.checkpoint import checkpoint

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
    import torch

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
