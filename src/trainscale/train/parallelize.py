"""The capstone's layout: one mesh, the model split into pipeline stages, then tensor
and sequence parallelism, context parallelism and FSDP2 applied to each stage, in
torchtitan's order (``models/llama3/parallelize.py``: TP, activation checkpointing,
FSDP; the stages handed to a pipeline schedule last).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from trainscale.train.config import DIMS, Layout, TrainConfig, model_config
from trainscale.transformer import GPT, GPTConfig, gpt
from trainscale.workers.tensor_parallel import block_plan


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
            x = self.token_embedding(x)
            if self.position_embedding is not None:  # rotary embeddings act in attention
                x = x + self.position_embedding(positions)
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


def tensor_parallel_plan(config: GPTConfig) -> dict[str, ParallelStyle]:
    """Megatron-style tensor parallelism of one block, with sequence parallelism: chapter
    06's plan (:func:`trainscale.workers.tensor_parallel.block_plan`) on the names of the
    book's decoder block.

    Between the matrix products the block's activations are split by sequence
    position (``Shard(1)``): the layer norms run on each rank's positions. Before
    attention and the MLP they are all-gathered; ``qkv`` and the MLP's first
    matrix (SwiGLU's ``gate`` and ``up``) are split by output columns (whole heads,
    or whole groups of query heads with their key and value: the ``qkv`` rows are
    stored head by head), ``proj`` and the MLP's last matrix by input rows, and
    their partial sums are reduce-scattered back to positions.
    """
    gated = config.mlp == "swiglu"
    return block_plan(
        sequence_parallel=True,
        attention=("attention", ("qkv",), "proj"),
        mlp=("mlp", ("gate", "up"), "down") if gated else ("mlp", ("0",), "2"),
        norms=("norm1", "norm2"),
    )


def apply_tensor_parallel(part: Stage, tp_mesh: DeviceMesh) -> None:
    """Split each block of ``part`` over ``tp_mesh`` (:func:`tensor_parallel_plan`).

    The stage's input and output stay whole on every tensor-parallel rank
    (:class:`Stage`). Embeddings, final norm and head are not split: each
    tensor-parallel rank computes them whole, on the same data.
    """
    for block in part.blocks.values():
        parallelize_module(block, tp_mesh, tensor_parallel_plan(part.config))
    part.tp_mesh = tp_mesh


def apply_context_parallel(part: Stage, mesh: DeviceMesh, tokens_per_rank: int) -> None:
    """Split each sequence of ``part`` over the mesh's ``cp`` ranks: rank ``c`` takes
    tokens ``c L .. (c + 1) L - 1`` (``L = tokens_per_rank``), and every block's
    attention becomes ring attention over the ``cp`` group (chapter 14): keys and
    values pass round the ring, each rank computing its queries' rows."""
    from trainscale.workers.context import ring_attention  # only context parallelism needs it

    ring = functools.partial(ring_attention, group=mesh.get_group("cp"), causal=True)
    first = mesh.get_local_rank("cp") * tokens_per_rank
    for block in part.blocks.values():
        block.attention.attend_fn = ring
        block.attention.positions = torch.arange(first, first + tokens_per_rank)
    part.first_position = first


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
