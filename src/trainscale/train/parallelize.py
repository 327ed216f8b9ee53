"""The capstone's layout: one mesh, the model split into pipeline stages on the meta
device, then tensor and sequence parallelism (the vocabulary split too), context
parallelism, recomputation and FSDP2 applied to each stage, in torchtitan's order
(``models/llama3/parallelize.py``: TP, activation checkpointing, FSDP; the stages handed
to a pipeline schedule last); only then the weights get memory and are drawn, shard by
shard (:mod:`trainscale.train.stages`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn import functional as F
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trainscale.context import token_positions
from trainscale.train.config import DIMS, Layout, TrainConfig, model_config
from trainscale.train.stages import Stage, build_mesh, materialise, meta_stages, stage_ids
from trainscale.transformer import GPTConfig
from trainscale.workers.tensor_parallel import block_plan


def tensor_parallel_plan(config: GPTConfig) -> dict[str, ParallelStyle]:
    """Megatron-style tensor parallelism of one block, with sequence parallelism: chapter
    8's plan (:func:`trainscale.workers.tensor_parallel.block_plan`) on the names of the
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


def stage_plan(part: Stage) -> dict[str, ParallelStyle]:
    """The vocabulary split of a stage's ends (torchtitan's Llama plan): the token
    embedding row-wise (each rank holds ``vocab / tp`` rows, looks up the tokens it
    has, and the partial sums are reduce-scattered to the ranks' shares of the
    sequence; all-reduced instead when a learned position table is added before the
    split, :class:`~trainscale.train.stages.Stage`); the final norm
    sequence-parallel; the head column-wise, its logits left split by vocabulary
    (``Shard(-1)``) for ``loss_parallel``'s cross-entropy, so no rank holds
    ``batch x seq x vocab`` whole."""
    plan: dict[str, ParallelStyle] = {}
    if part.token_embedding is not None:  # a learned position table is added whole
        whole = part.position_embedding is not None
        plan["token_embedding"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate() if whole else Shard(1)
        )
    if part.head is not None:
        plan["final_norm"] = SequenceParallel()
        plan["head"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        )
    return plan


def apply_tensor_parallel(part: Stage, tp_mesh: DeviceMesh) -> None:
    """Split ``part`` over ``tp_mesh``: each block (:func:`tensor_parallel_plan`) and its
    ends (:func:`stage_plan`). What a stage receives and sends is this rank's share of
    the sequence, ``1 / tp`` of the activation, as Megatron-LM sends it."""
    for block in part.blocks.values():
        parallelize_module(block, tp_mesh, tensor_parallel_plan(part.config))
    ends = stage_plan(part)
    if ends:
        parallelize_module(part, tp_mesh, ends)
    part.tp_mesh = tp_mesh


def apply_context_parallel(part: Stage, mesh: DeviceMesh, seq_len: int) -> None:
    """Split each sequence of ``part`` over the mesh's ``cp`` ranks, zig-zag (chapter 10,
    :func:`trainscale.context.token_positions`: of ``2 cp`` chunks, rank ``c`` holds
    chunks ``c`` and ``2 cp - 1 - c``, so every rank does the same causal work), and
    make every block's attention ring attention over the ``cp`` group
    (:func:`trainscale.workers.context.ring_attention`): keys and values pass round
    the ring, each rank computing its queries' rows. The book's ring runs on any
    backend; on GPUs torch's ``context_parallel`` is used instead
    (:func:`torch_context_parallel`)."""
    from trainscale.workers.context import ring_attention  # only context parallelism needs it

    cp, rank = mesh["cp"].size(), mesh.get_local_rank("cp")
    ring = functools.partial(
        ring_attention, group=mesh.get_group("cp"), causal=True, layout="zigzag"
    )
    positions = torch.tensor(token_positions(seq_len, cp, rank, "zigzag"))
    part.positions = positions
    for block in part.blocks.values():
        block.attention.attend_fn = ring
        block.attention.positions = positions


def torch_context_parallel(
    mesh: DeviceMesh, buffers: list[torch.Tensor], seq_dims: list[int]
) -> contextlib.AbstractContextManager:
    """UNTESTED HERE (no GPU): torch's ``context_parallel`` over the ``cp`` ranks, with
    its load balancing (head-tail chunks, as the zig-zag split), for a GPU run: it
    shards ``buffers`` (inputs, targets, positions) along ``seq_dims`` in place and
    routes the GPU's fused attention kernels through its ring. On the CPU it cannot run
    (no sharding rule for the CPU's SDPA kernel; TECH_NOTES), so the CPU uses
    :func:`apply_context_parallel`'s ring."""
    from torch.distributed.tensor.experimental import context_parallel

    return context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=seq_dims)


SAVED_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}
"""What selective recomputation keeps (torchtitan's ``_op_sac_save_list``, less its
every-other-matmul rule): the outputs of matrix products, of fused attention and of
tensor parallelism's reduce-scatters. Norms, activations, the rotary turns, dropout
masks and the like are computed again in backward: cheap operations whose outputs
are as large as the matrix products'."""


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """The ``context_fn`` of ``torch.utils.checkpoint`` for selective recomputation:
    torch's selective activation checkpointing with the :data:`SAVED_OPS` policy."""
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_recomputation(part: Stage, mode: str) -> None:
    """What each block of ``part`` keeps for backward: ``"none"``, ``"selective"``
    (:func:`selective_context`) or ``"full"`` (only the block's input)."""
    part.recompute = mode
    part.context_fn = selective_context if mode == "selective" else None


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


def mixed_precision(config: TrainConfig, device: torch.device) -> MixedPrecisionPolicy:
    """FSDP2's precision: with ``--bf16`` on a GPU, parameters gathered and computed in
    bfloat16, gradients reduced in float32, the sharded weights and Adam's moments
    kept in float32 (torchtitan's default); otherwise float32 throughout (on the CPU
    ``--bf16`` is autocast instead, and parity runs are float32)."""
    if config.bf16 and device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def reshard_after_forward(config: TrainConfig, layout: Layout) -> bool:
    """Whether FSDP2 frees the gathered weights after forward (and gathers them again in
    backward): under ZeRO-3 without pipelining (torchtitan's default policy), never
    under ``--zero 1`` or ``2``, which keep them gathered from forward to backward, as
    the planner assumes; gradients are reduce-scattered either way (FSDP2 has no
    ZeRO-1, whose gradients stay whole, so ``--zero 1`` holds ZeRO-2's)."""
    return config.zero == 3 and layout.pp == 1


def apply_fsdp(
    part: Stage, dp_mesh: DeviceMesh, reshard: bool, policy: MixedPrecisionPolicy | None = None
) -> None:
    """Shard ``part`` over ``dp_mesh`` with FSDP2 (HSDP if the mesh is two-dimensional):
    one all-gather per block, and one for the rest (embeddings, final norm, head)."""
    options = {"mesh": dp_mesh, "reshard_after_forward": reshard}
    if policy is not None:
        options["mp_policy"] = policy
    for block in part.blocks.values():
        fully_shard(block, **options)
    fully_shard(part, **options)


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
    def positions(self) -> torch.Tensor | None:
        """This rank's token positions in each sequence (``None``: all of them)."""
        return self.parts[0].positions

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Where forward and backward run: ``loss_parallel`` under tensor parallelism,
        whose cross-entropy takes logits split by vocabulary."""
        return loss_parallel() if self.layout.tp > 1 else contextlib.nullcontext()

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def parameters_held(self) -> int:
        """How many parameter values this rank stores: its shards' local elements."""
        return sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel() for p in self.parameters()
        )


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of a micro-batch, computed in float32 (under
    tensor parallelism, ``loss_parallel``'s: the logits stay split by vocabulary)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build(config: TrainConfig, layout: Layout, device: torch.device) -> Built:
    """Build this rank's part of the model, in torchtitan's order.

    The rank's pipeline stages of the decoder are made on the meta device
    (:func:`trainscale.train.stages.meta_stages`); each is split by tensor
    parallelism (blocks and vocabulary), its attention made ring attention under
    context parallelism, its blocks set to recompute in backward, and it is sharded
    over the data-parallel ranks with FSDP2 (HSDP when ``dp_replicate > 1``); then
    every stage gets memory and its weights are drawn, each rank its own shards
    (:func:`trainscale.train.stages.materialise`); with ``pp > 1`` the stages go to a
    pipeline schedule. Each chunk gets its AdamW (weight decay on every parameter,
    for simplicity).
    """
    mesh = build_mesh(layout, device)
    pp_rank = mesh.get_local_rank("pp")
    total = layout.pp * config.virtual_stages
    ids = stage_ids(pp_rank, layout.pp, config.virtual_stages)
    parts = meta_stages(model_config(config), ids, total)
    dp_mesh = fsdp_mesh(mesh, layout)
    policy = mixed_precision(config, device)
    for part in parts:
        if layout.tp > 1:
            apply_tensor_parallel(part, mesh["tp"])
        if layout.cp > 1 and device.type != "cuda":
            apply_context_parallel(part, mesh, config.seq_len)
        apply_recomputation(part, config.recompute)
        apply_fsdp(part, dp_mesh, reshard_after_forward(config, layout), policy)
    materialise(parts, device, config.seed)
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
