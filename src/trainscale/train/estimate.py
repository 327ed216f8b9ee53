"""``python -m trainscale.train --estimate-memory``: the planned run's memory, measured by
torch on a fake world, beside the planner's estimate (as torchtitan's memory estimation
does).

One process plays one rank of the full world: a ``fake`` process group of the layout's
world size (``torch.testing._internal.distributed.fake_pg``; its collectives return at
once), the rank's stages built on the meta device and parallelised as
:func:`trainscale.train.parallelize.build` does, with the GPU's mixed precision
(bfloat16 weights, float32 reduction); then, under ``FakeTensorMode`` (tensors with
shapes and no storage), ``to_empty``, AdamW and one training step, tracked by torch's
``FSDPMemTracker``. The rank is the first of the first pipeline stage, the fullest under
1F1B (the planner's too): it runs ``--pp`` micro-batches' forwards before their
backwards, as 1F1B keeps them in flight there (with ``--virtual-stages``, only its
first chunk is tracked). TECH_NOTES ("Memory at full size without
GPUs") says what runs under fake tensors and what does not.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from trainscale import memory
from trainscale.train.config import TrainConfig, model_config
from trainscale.train.parallelize import (
    _loss,
    apply_context_parallel,
    apply_fsdp,
    apply_recomputation,
    apply_tensor_parallel,
    fsdp_mesh,
    reshard_after_forward,
)
from trainscale.train.shapes import DIMS, Layout
from trainscale.train.stages import build_mesh, meta_stages, stage_ids

TRACKED = (
    "Sharded Param",
    "Unsharded Param",
    "Sharded Grad",
    "Unsharded Grad",
    "Optstate",
    "Activation",
    "Temp",
    "All Gather",
    "Reduce Scatter",
    "Inputs",
    "Buffer",
)
"""FSDPMemTracker's categories, in the order the estimate prints them."""


def estimate_memory(config: TrainConfig) -> dict[str, Any]:
    """Run one step of the first stage's first rank on a fake world of the layout's
    size; return its ``rank``, ``layout``, FSDPMemTracker's ``peak`` bytes by category
    (:data:`TRACKED`) and the ``planner``'s memory parts for the same layout (``None``
    where the planner cannot evaluate it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = 1
    for name in DIMS:
        world *= getattr(config, name) or 1
    config = config.for_world(world)
    layout = config.layout(world)
    shape = model_config(config)
    total = layout.pp * config.virtual_stages
    stage = pp_rank = 0  # 1F1B's first stage holds --pp micro-batches' activations

    rank = pp_rank * (world // layout.pp)  # every other coordinate 0
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        cpu = torch.device("cpu")
        mesh = build_mesh(layout, cpu)
        parts = meta_stages(shape, stage_ids(pp_rank, layout.pp, config.virtual_stages), total)
        dp_mesh = fsdp_mesh(mesh, layout)
        policy = torch.distributed.fsdp.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
        for part in parts:
            if layout.tp > 1:
                apply_tensor_parallel(part, mesh["tp"])
            if layout.cp > 1:
                apply_context_parallel(part, mesh, config.seq_len)
            apply_recomputation(part, config.recompute)
            apply_fsdp(part, dp_mesh, reshard_after_forward(config, layout), policy)
        ids = stage_ids(pp_rank, layout.pp, config.virtual_stages)
        part = next(p for p, s in zip(parts, ids, strict=True) if s == stage)
        with FakeTensorMode(allow_non_fake_inputs=True):
            part.to_empty(device=cpu)
            optimizer = torch.optim.AdamW(part.parameters(), lr=config.lr, foreach=False)
            tokens = config.seq_len // layout.cp
            local = tokens // layout.tp
            in_flight = layout.pp - pp_rank if layout.pp > 1 else 1

            def step() -> None:
                outputs = []
                for _ in range(in_flight):
                    tracker.reset_mod_stats()  # it counts one forward per module otherwise
                    if part.token_embedding is not None:
                        x = torch.randint(0, config.vocab, (config.micro_batch, tokens))
                    else:
                        x = torch.randn(config.micro_batch, local, config.width, requires_grad=True)
                    outputs.append(part(x))
                for out in outputs:
                    if part.head is not None:
                        target = torch.randint(0, config.vocab, (config.micro_batch, tokens))
                        with _loss_context(layout):
                            _loss(out, target).backward()
                    else:
                        out.backward(torch.randn_like(out))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            tracker = FSDPMemTracker(part, optimizer)
            with tracker:  # the first step creates Adam's moments; the second holds them
                step()
                step()
            peak = tracker.get_tracker_snapshot("peak")
            adam = sum(
                (v.to_local() if isinstance(v, DTensor) else v).numel() * v.element_size()
                for state in optimizer.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            )
    finally:
        dist.destroy_process_group()
    (by_kind,) = [v for k, v in peak.items() if isinstance(k, torch.device)] or [{}]
    return {
        "rank": rank,
        "stage": stage,
        "layout": layout,
        "peak": dict(by_kind),
        "in_flight": in_flight,
        "adam": adam,
        "planner": planned_memory(config, layout),
    }


def planned_memory(config: TrainConfig, layout: Layout) -> dict[str, float] | None:
    """The planner's memory parts (:data:`trainscale.planner.MEMORY_PARTS`, bytes on one
    GPU of the fullest stage) for this layout of this model on H100 nodes of 8 GPUs, or
    ``None`` where it cannot evaluate the layout (HSDP, which it does not model)."""
    from trainscale import planner
    from trainscale.transformer import parameter_counts

    if layout.dp_replicate > 1 and layout.dp_shard > 1:
        return None
    shape = model_config(config)
    model = planner.Model(
        params=sum(parameter_counts(shape).values()),
        layers=config.layers,
        hidden=config.width,
        heads=config.heads,
        seq_len=config.seq_len,
        vocab=config.vocab,
        kv_heads=config.kv_heads,
        ffn_hidden=config.ffn,
        gated_mlp=config.mlp == "swiglu",
        dropout=False,
    )
    nodes = max(1, layout.world // 8)
    cluster = planner.Cluster(nodes=nodes, **planner.H100_NODE)
    zero = 0 if layout.dp_shard == 1 and layout.dp_replicate > 1 else config.zero
    planned = planner.evaluate(
        model,
        cluster,
        layout.dp * config.grad_accum * config.micro_batch,
        layout.tp,
        layout.pp,
        layout.dp,
        zero_stage=zero,
        recompute=config.recompute,
        micro_batch=config.micro_batch,
        virtual_stages=config.virtual_stages,
        context_parallel=layout.cp,
    )
    return dict(planned.memory_parts)


def _loss_context(layout: Layout):
    from contextlib import nullcontext

    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if layout.tp > 1 else nullcontext()


def report(config: TrainConfig) -> list[str]:
    """The lines ``--estimate-memory`` prints: torch's tracked peak by category and the
    planner's parts, GiB. The two group differently: the planner's weights are the
    gathered bf16 copies and its optimiser state holds the fp32 master weights, where
    FSDP2's sharded fp32 parameters are the master weights themselves."""
    found = estimate_memory(config)
    peak = found["peak"]
    lines = [
        f"one training step of rank {found['rank']} (stage {found['stage']}, the fullest"
        " under 1F1B) of "
        f"{found['layout'].describe()}, {found['in_flight']} micro-batch(es) in flight, "
        "on a fake world (FSDPMemTracker, bf16 weights, fp32 reduction):",
    ]
    for kind in TRACKED:
        if peak.get(kind):
            lines.append(
                f"  {kind:<16} {peak[kind] / memory.GIB:10.4f} GiB {peak[kind]:>16,} bytes"
            )
    total = peak.get("Total", sum(peak.values()))
    lines.append(f"  {'Total':<16} {total / memory.GIB:10.4f} GiB {int(total):>16,} bytes")
    if not peak.get("Optstate"):
        adam = found["adam"]
        lines.append(
            f"  + Adam's moments {adam / memory.GIB:10.4f} GiB {adam:>16,} bytes (counted from"
            " the optimiser: the tracker's snapshot misses its DTensor states here)"
        )
    planned = found["planner"]
    if planned is None:
        lines.append("the planner does not model this layout (HSDP)")
        return lines
    lines.append("the planner's estimate for one GPU of the fullest stage:")
    for part, size in planned.items():
        lines.append(f"  {part:<16} {size / memory.GIB:10.4f} GiB")
    lines.append(f"  {'Total':<16} {sum(planned.values()) / memory.GIB:10.4f} GiB")
    return lines
