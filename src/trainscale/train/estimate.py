"""``python -m trainscale.train --estimate-memory``: the planned run's memory, measured by
torch on a fake world, beside the planner's estimate (as torchtitan's memory estimation
does).

One process plays one rank of the full world: a ``fake`` process group of the layout's
world size (``torch.testing._internal.distributed.fake_pg``; its collectives return at
once), the rank's pipeline stages built on the meta device and parallelised as
:func:`trainscale.train.parallelize.build` does, with the GPU's mixed precision
(bfloat16 weights, float32 reduction); then, under ``FakeTensorMode`` (tensors with
shapes and no storage), ``to_empty``, AdamW with its moments made, and one training
step, tracked by torch's ``FSDPMemTracker``: the forwards and backwards this rank runs
in the pipeline schedule's order (:func:`schedule_order`), then the optimiser step.

The fullest rank is found, not assumed: the first pipeline rank (the most micro-batches
in flight), the second (as many, less one, and with uneven stages one block more) and
the last (the logits) are each measured, and the one with the highest peak is reported.

A shortcut keeps this within seconds (:func:`estimate_memory`): a stage's memory grows
by the same bytes for every block it holds and, under 1F1B, for every micro-batch in
flight, so each rank is measured at full width with one and two blocks per model
chunk (two and three where a chunk is one block short) and, under 1F1B, one and two
micro-batches in flight, and every part is extrapolated to the stage's blocks and
micro-batches (linearly in each, :func:`extrapolate`). The tests check the shortcut
against a run of every block on a small case; ``--estimate-all-layers`` runs every
block instead. TECH_NOTES ("Memory at full size without GPUs") says what runs under
fake tensors and what does not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from trainscale import memory
from trainscale.context import token_positions
from trainscale.train.config import TrainConfig, model_config
from trainscale.train.parallelize import (
    _loss,
    apply_fsdp,
    apply_recomputation,
    apply_tensor_parallel,
    fsdp_mesh,
    reshard_after_forward,
)
from trainscale.train.shapes import DIMS, Layout, layer_counts
from trainscale.train.stages import build_mesh, meta_stages, stage_ids

PARTS: dict[str, tuple[str, ...]] = {
    "weights": ("Unsharded Param", "All Gather"),
    "gradients": ("Sharded Grad", "Unsharded Grad", "Reduce Scatter"),
    "optimiser state": ("Sharded Param", "OptState"),
    "activations": ("Activation", "Temp", "Inputs"),
    "buffers": ("Buffer",),
}
"""The planner's memory parts (:data:`trainscale.planner.MEMORY_PARTS`, and buffers, which
it leaves out) as sums of ``FSDPMemTracker``'s categories: the weights the layers
compute with are the gathered bfloat16 copies (and the all-gather's buffers); the
optimiser state holds the float32 master weights, which under FSDP2 are the sharded
parameters themselves, and Adam's two moments; activations are what forward keeps for
backward and backward's temporaries (the gradients of activations, the logits')."""


class _Tracker:
    """``FSDPMemTracker`` over several pipeline chunks, recording the highest value of each
    category and of each part (:data:`PARTS`, its categories summed at one moment) as
    well as the categories at the highest total."""

    def __init__(self, parts: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        highest: dict[str, int] = {}

        class Recording(FSDPMemTracker):
            def _update_snap(self, *args: Any, **kwargs: Any) -> None:
                super()._update_snap(*args, **kwargs)
                for snap in self._curr_mem_snap.values():
                    now = {getattr(k, "value", k): size for k, size in snap.items()}
                    for part, kinds in PARTS.items():  # each part's sum, at this moment
                        now[part] = sum(now.get(k, 0) for k in kinds)
                    for name, size in now.items():
                        if size > highest.get(name, 0):
                            highest[name] = size

        self.tracker = Recording(parts[0], optimizer)
        # A rank's chunks are separate FSDP roots; the tracker instruments every FSDP
        # module under its root (`_root_mod.modules()`), so it is given all of them.
        self.tracker._root_mod = torch.nn.ModuleList(parts)
        self.highest = highest

    def forget(self, part: torch.nn.Module) -> None:
        """Let ``part`` run forward again: the tracker refuses a root's second forward in
        one iteration unless its statistics are dropped (its inner modules' stay)."""
        self.tracker.memory_tracking.pop(part, None)

    def peak(self) -> dict[str, int]:
        """The categories at the moment of the highest total (key ``"Total"`` too)."""
        snapshot = self.tracker.get_tracker_snapshot("peak")
        (by_kind,) = [v for k, v in snapshot.items() if isinstance(k, torch.device)] or [{}]
        return {getattr(k, "value", k): v for k, v in by_kind.items()}


def schedule_order(layout: Layout, pp_rank: int, virtual_stages: int, micro_batches: int):
    """The forwards (``"F"``) and backwards (``"B"``) pipeline rank ``pp_rank`` runs in
    one step, as ``(kind, chunk, micro_batch)``, ``chunk`` indexing the rank's chunks
    (:func:`~trainscale.train.stages.stage_ids`). Without a pipeline: a forward and a
    backward per micro-batch. 1F1B: ``min(micro_batches, pp - pp_rank)`` forwards before
    the first backward (torch's ``Schedule1F1B._step_microbatches``, its warm-up), then a
    backward and a forward in turn, then the last backwards. Interleaved: the order torch's
    ``ScheduleInterleaved1F1B`` computes (its ``pipeline_order``; built on the fake
    world) for ``min(micro_batches, 2 pp)`` micro-batches, enough for its warm-up's
    ``(v - 1) pp + 2 (pp - 1 - rank) + 1`` forwards in flight."""
    if layout.pp == 1 or virtual_stages == 1:
        n = 1 if layout.pp == 1 else min(micro_batches, layout.pp - pp_rank)
        order = [("F", 0, i) for i in range(n)]
        for i in range(micro_batches - n):  # the steady state: a backward, a forward
            order += [("B", 0, i), ("F", 0, n + i)]
        return order + [("B", 0, i) for i in range(micro_batches - n, micro_batches)]
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    ids = stage_ids(pp_rank, layout.pp, virtual_stages)
    cpu = torch.device("cpu")
    group = build_mesh(layout, cpu).get_group("pp")  # on the fake world of track_step
    total = layout.pp * virtual_stages
    stages = [PipelineStage(torch.nn.Identity(), s, total, cpu, group=group) for s in ids]
    schedule = ScheduleInterleaved1F1B(stages, min(micro_batches, 2 * layout.pp))
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    return [
        (kinds[a.computation_type.name], ids.index(a.stage_index), a.microbatch_index)
        for a in schedule.pipeline_order[pp_rank]
        if a is not None
    ]


@dataclass(frozen=True)
class Tracked:
    """One tracked step: each category's ``highest`` bytes during it, the categories at
    the ``peak`` (the highest total, key ``"Total"``), ``adam``, the bytes of Adam's
    moments counted from the optimiser, and the most forwards ``in_flight`` at once."""

    highest: dict[str, int]
    peak: dict[str, int]
    adam: int
    in_flight: int


@contextlib.contextmanager
def fake_world(layout: Layout, pp_rank: int) -> Iterator[DeviceMesh]:
    """A fake process group of ``layout.world`` ranks, this process the first rank of
    pipeline rank ``pp_rank`` (every other coordinate 0); yields its mesh."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = pp_rank * (layout.world // layout.pp)
    dist.init_process_group("fake", rank=rank, world_size=layout.world, store=FakeStore())
    try:
        yield build_mesh(layout, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
        # DTensor caches its sharding and redistribution plans by mesh, and a mesh of
        # the next fake world compares equal to this one's (torch 2.13): drop them, or
        # they bring back this world's process groups.
        from torch.distributed.tensor import _redistribute, debug

        debug._clear_sharding_prop_cache()  # the Python cache and the fast path's
        DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
        _redistribute._gen_transform_infos.cache_clear()
        _redistribute.clear_redistribute_planner_cache()


def _context_parallel_as_on_gpus(part: torch.nn.Module, mesh: DeviceMesh, seq_len: int) -> None:
    """This rank's zig-zag share of each sequence (chapter 10), its positions given to the
    rotary embedding, and attention left to the fused kernel on the local tokens: what
    torch's ``context_parallel`` keeps on a GPU, where each step of its ring runs the
    flash kernel on the local queries and one rank's keys and values, and backward needs
    the local ``q``, ``k``, ``v``, output and log-sum-exp. The ring's two in-flight
    key-value blocks (GQA's few heads: a few MiB a layer) are left out. The book's CPU
    ring cannot run here: it picks the visible rows of each block with ``nonzero``,
    whose output shape depends on values, which fake tensors do not have
    (``DynamicOutputShapeException``)."""
    cp, rank = mesh["cp"].size(), mesh.get_local_rank("cp")
    positions = torch.tensor(token_positions(seq_len, cp, rank, "zigzag"))
    part.positions = positions
    for block in part.blocks.values():
        block.attention.positions = positions


def track_step(
    config: TrainConfig,
    layout: Layout,
    mesh: DeviceMesh,
    micro_batches: int,
    tracked: bool = True,
) -> Tracked | None:
    """One training step of this rank of the fake world (:func:`fake_world`), running
    the schedule's order for ``micro_batches`` (:func:`schedule_order`) under
    ``FSDPMemTracker`` (untracked, returning ``None``, unless ``tracked``).

    The first time DTensor meets an operation on given shapes it works out the output's
    sharding by running the operation on fake tensors, in this same fake mode, where the
    tracker counts them (transient tensors, at the peak too); a step of the same shapes
    run untracked first in the same world (:func:`measure_rank`) leaves only the step's
    own tensors to count."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor.parallel import loss_parallel

    cpu = torch.device("cpu")
    pp_rank = mesh.get_local_rank("pp")
    ids = stage_ids(pp_rank, layout.pp, config.virtual_stages)
    parts = meta_stages(model_config(config), ids, layout.pp * config.virtual_stages)
    dp_mesh = fsdp_mesh(mesh, layout)
    order = schedule_order(layout, pp_rank, config.virtual_stages, micro_batches)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for part in parts:
        if layout.tp > 1:
            apply_tensor_parallel(part, mesh["tp"])
        if layout.cp > 1:
            _context_parallel_as_on_gpus(part, mesh, config.seq_len)
        apply_recomputation(part, config.recompute)
        apply_fsdp(part, dp_mesh, reshard_after_forward(config, layout), policy)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for part in parts:
            part.to_empty(device=cpu)
        params = [p for part in parts for p in part.parameters()]
        optimizer = torch.optim.AdamW(params, lr=config.lr, foreach=False)
        for p in params:  # Adam's moments exist from the first step on: make them
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker = _Tracker(parts, optimizer)
        tokens = config.seq_len // layout.cp
        shape = (config.micro_batch, tokens // layout.tp, config.width)
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        watch = tracker.tracker if tracked else contextlib.nullcontext()
        split = loss_parallel() if layout.tp > 1 else contextlib.nullcontext()
        with watch, split:
            for kind, chunk, micro in order:
                part = parts[chunk]
                if kind == "F":
                    tracker.forget(part)
                    if part.token_embedding is not None:
                        x = torch.randint(0, config.vocab, (config.micro_batch, tokens))
                    else:  # what the previous stage sends: bf16, this rank's share
                        x = torch.randn(shape, dtype=torch.bfloat16, requires_grad=True)
                    out = part(x)
                    if part.head is not None:
                        target = torch.randint(0, config.vocab, (config.micro_batch, tokens))
                        out = _loss(out, target)
                    outputs[chunk, micro] = out
                else:
                    out = outputs.pop((chunk, micro))
                    out.backward(None if out.dim() == 0 else torch.randn_like(out))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return _tracked(tracker, optimizer, order) if tracked else None


def _tracked(tracker: _Tracker, optimizer: torch.optim.Optimizer, order: list) -> Tracked:
    """What :func:`track_step` returns: the tracker's highest and peak, Adam's moments'
    bytes on this rank and the most micro-batches ``order`` holds in flight."""
    adam = sum(
        (v.to_local() if isinstance(v, DTensor) else v).numel() * v.element_size()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    flight = most = 0
    for kind, _, _ in order:
        flight += 1 if kind == "F" else -1
        most = max(most, flight)
    return Tracked(dict(tracker.highest), tracker.peak(), adam, most)


def extrapolate(values: dict[tuple[int, int], dict[str, int]], k: int, n: int) -> dict[str, int]:
    """Each category at ``k`` blocks per chunk and ``n`` micro-batches in flight, from
    measurements at ``(k0, n0)``, ``(k0 + 1, n0)`` and, if there, ``(k0, n0 + 1)`` and
    ``(k0 + 1, n0 + 1)`` (the keys of ``values``): linear in each, with the product term
    (the activations: blocks times micro-batches)."""
    (k0, n0) = min(values)
    f = {key: values[key] for key in values}
    kinds = set().union(*f.values())
    out = {}
    for kind in kinds:
        at = {key: f[key].get(kind, 0) for key in f}
        base = at[k0, n0]
        per_block = at[k0 + 1, n0] - base
        value = base + (k - k0) * per_block
        if (k0, n0 + 1) in at:
            per_micro = at[k0, n0 + 1] - base
            both = at[k0 + 1, n0 + 1] - at[k0 + 1, n0] - per_micro
            value += (n - n0) * per_micro + (k - k0) * (n - n0) * both
        out[kind] = value
    return out


START = 2
"""The shortcut's smallest measurement: blocks per chunk and micro-batches in flight."""


def measure_rank(config: TrainConfig, layout: Layout, pp_rank: int, all_layers: bool) -> dict:
    """Pipeline rank ``pp_rank``'s tracked step: measured with every block
    (``all_layers``) or by the shortcut of the module docstring, after an untracked
    step of a small shape (:func:`track_step`). Returns the categories at the ``peak``,
    ``adam``, the ``gradients``' highest (at the end of backward), ``in_flight`` and
    ``measured_at``, the ``(blocks per chunk, micro-batches in flight)`` points run.

    Only quantities at one phase of the step extrapolate: the peak (the start of the
    backward, every micro-batch's activations held) and the gradients' highest (the end
    of the backward, every shard's gradient held). A part's own highest over the step
    may not: the gathered weights peak at the largest all-gather on a short stage and
    at the last block's on a long one, a maximum of two lines, not a line."""
    chunks = layout.pp * config.virtual_stages
    counts = layer_counts(chunks, config.layers)
    per, short = max(counts), max(counts) * chunks - config.layers
    in_flight = min(config.grad_accum, layout.pp - pp_rank) if layout.pp > 1 else 1
    interleaved = config.virtual_stages > 1
    # From two blocks per chunk on (three where a chunk is one short), FSDP's
    # prefetch of the next block's weights is in every measurement, and from two
    # micro-batches in flight on, whatever overlaps one with the next.
    k0 = START + (short > 0)
    if all_layers or per <= k0 + 1:
        points = [(per, in_flight)]
    else:
        blocks = (k0, k0 + 1)
        many = not interleaved and in_flight > START + 1
        flights = (START, START + 1) if many else (in_flight,)
        points = [(k, n) for n in flights for k in blocks]
    found: dict[tuple[int, int], Tracked] = {}
    with fake_world(layout, pp_rank) as mesh:
        # untracked first: one block per chunk (two where one is short), the fewest
        # micro-batches the schedule takes
        warm = dataclasses.replace(config, layers=(1 + (short > 0)) * chunks - short)
        track_step(warm, layout, mesh, layout.pp if interleaved else 1, tracked=False)
        for k, n in points:
            smaller = dataclasses.replace(config, layers=k * chunks - short)
            # 1F1B: n in flight, and one micro-batch more where the step has one, so
            # that the peak comes with the first micro-batch's gradients held, as in
            # every later one of an accumulating step
            extra = 1 if config.grad_accum > in_flight else 0
            micro = config.grad_accum if interleaved else n + extra
            found[k, n] = track_step(smaller, layout, mesh, micro)
    flights = max(f.in_flight for f in found.values()) if interleaved else in_flight
    each = {
        point: {**f.peak, "adam": f.adam, "gradients": f.highest.get("gradients", 0)}
        for point, f in found.items()
    }
    scaled = each[points[0]] if len(points) == 1 else extrapolate(each, per, in_flight)
    return {
        "peak": {k: v for k, v in scaled.items() if k not in ("adam", "gradients")},
        "adam": scaled["adam"],
        "gradients": scaled["gradients"],
        "in_flight": flights,
        "measured_at": points,
    }


def candidate_ranks(layout: Layout, virtual_stages: int, layers: int) -> list[int]:
    """The pipeline ranks that may hold the most: the first (the most micro-batches in
    flight, and the embedding), the last (the logits), and, where the first stage is a
    block short (:func:`~trainscale.train.shapes.layer_counts`), the second (one
    micro-batch fewer in flight, one block more); with even stages it holds less than
    the first."""
    chunks = layout.pp * virtual_stages
    short = -(-layers // chunks) * chunks - layers
    return sorted({0, layout.pp - 1} | ({1} if short and layout.pp > 2 else set()))


def estimate_memory(config: TrainConfig, all_layers: bool = False) -> dict[str, Any]:
    """The fullest rank's tracked step on a fake world of the layout's size (every
    :func:`candidate_ranks`, by the shortcut unless ``all_layers``): its ``rank``,
    ``pp_rank``, ``layout``, ``in_flight``, the ``peak`` bytes by category and by the
    planner's ``parts`` (:data:`PARTS`, at the peak), the ``gradients``' own highest,
    ``adam``, ``measured_at``, ``totals`` (each candidate's peak) and the ``planner``'s
    memory parts for the same layout (``None`` where it cannot evaluate it)."""
    world = 1
    for name in DIMS:
        world *= getattr(config, name) or 1
    config = config.for_world(world)
    layout = config.layout(world)
    with warnings.catch_warnings():  # torch's notes on APIs it will change, not on the run
        warnings.simplefilter("ignore", UserWarning)
        found = {
            r: measure_rank(config, layout, r, all_layers)
            for r in candidate_ranks(layout, config.virtual_stages, config.layers)
        }
    pp_rank = max(found, key=lambda r: found[r]["peak"].get("Total", 0))
    best = found[pp_rank]
    peak = best["peak"]
    return {
        "rank": pp_rank * (world // layout.pp),
        "pp_rank": pp_rank,
        "layout": layout,
        "in_flight": best["in_flight"],
        "peak": peak,
        "parts": {part: sum(peak.get(k, 0) for k in kinds) for part, kinds in PARTS.items()},
        "gradients": best["gradients"],
        "adam": best["adam"],
        "measured_at": best["measured_at"],
        "totals": {r: f["peak"].get("Total", 0) for r, f in found.items()},
        "planner": planned_memory(config, layout),
    }


def planned_memory(config: TrainConfig, layout: Layout) -> dict[str, float] | None:
    """The planner's memory parts (:data:`trainscale.planner.MEMORY_PARTS`, bytes on one
    GPU of the fullest stage) for this layout of this model (its parameters counted from
    the runner's shape) on H100 nodes of 8 GPUs, on the stack of the measured step
    (:func:`measured_stack`), or ``None`` where it cannot evaluate the layout (HSDP,
    which it does not model)."""
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
        software=measured_stack(layout),
    )
    if planned.verdict == "invalid":
        return None
    return dict(planned.memory_parts)


def measured_stack(layout: Layout):
    """The planner's description of the step this module measures: the runner's stack
    (:data:`~trainscale.planner.commands.RUNNER_SOFTWARE`), with every ZeRO stage under
    pipelines, since the measured step reduces each micro-batch's gradients at its
    backward as FSDP2 does without pipelines. The runner's pipeline stages do not
    (:data:`PIPELINED_NOTE`)."""
    from trainscale.planner.commands import RUNNER_SOFTWARE
    from trainscale.software import software

    stack = software(RUNNER_SOFTWARE)
    return stack if layout.pp == 1 else stack.replace(pipeline_zero_stages=stack.zero_stages)


PIPELINED_NOTE = (
    "with pipelines the runner's torch stages keep FSDP2's weights gathered and its fp32"
    " gradients whole until the step's last backward (ZeRO-1's memory; PipelineStage."
    "backward_maybe_with_nosync); this step reduces each micro-batch's gradients and"
    " reshards its weights after its backward instead, so the line below adds what the"
    " stages hold more, counted from this rank's parameters"
)
"""What ``--estimate-memory`` says of a pipelined layout: the step it measures is not the
runner's (torch's pipeline stages turn gradient sync off; ``FSDPMemTracker`` counts the
gradients FSDP2 accumulates then as temporaries, so they are not reproduced here), and
:func:`held_by_pipeline_stages` counts the difference."""


def held_by_pipeline_stages(found: dict[str, Any]) -> dict[str, int]:
    """What torch's pipeline stages hold through a step of ``found``'s rank
    (:func:`estimate_memory`'s result, a pipelined layout), counted from its parameters:
    every ``weights`` in bfloat16 gathered over FSDP2's ranks (``dp_shard x cp``, as
    :func:`~trainscale.train.parallelize.fsdp_mesh` shards) and every ``gradients`` whole
    in float32, that is the measured sharded float32 parameters times that group's size,
    halved and as they are; and the ``total``: the measured peak with its gathered
    weights and sharded gradients replaced by those (the unsharded bfloat16 gradients of
    the block in backward stay, as measured). Bytes."""
    layout, peak = found["layout"], found["peak"]
    whole = peak.get("Sharded Param", 0) * layout.dp_shard * layout.cp
    weights, gradients = whole // 2, whole
    total = peak.get("Total", 0) - found["parts"]["weights"] - peak.get("Sharded Grad", 0)
    return {"weights": weights, "gradients": gradients, "total": total + weights + gradients}


def comparison_lines(found: dict[str, Any], gpu_bytes: float, gpu_name: str) -> list[str]:
    """``found`` (:func:`estimate_memory`'s result) beside the planner, part by part, in
    GiB, with the tracker's excess in per cent where the planner has the part; for a
    pipelined layout what the pipeline stages hold more (:func:`held_by_pipeline_stages`);
    and whether the total fits ``gpu_name``'s ``gpu_bytes``."""
    gib = memory.GIB
    planned = found["planner"] or {}
    lines = [f"  {'GiB':<16} {'tracker':>8} {'planner':>8} {'tracker/planner':>16}"]
    for part, size in found["parts"].items():
        plan = planned.get(part)
        if plan is None or plan == 0:
            ratio = "-"
            shown = "-" if plan is None else "0.00"
        else:
            ratio, shown = f"{size / plan - 1:+.0%}", f"{plan / gib:.2f}"
        lines.append(f"  {part:<16} {size / gib:8.2f} {shown:>8} {ratio:>16}")
    total = found["peak"].get("Total", 0)
    plan_total = sum(planned.values()) if planned else None
    ratio = "-" if not plan_total else f"{total / plan_total - 1:+.0%}"
    shown = "-" if plan_total is None else f"{plan_total / gib:.2f}"
    lines.append(f"  {'total':<16} {total / gib:8.2f} {shown:>8} {ratio:>16}")
    if found["planner"] is None:
        lines.append("  the planner does not model this layout (HSDP, or a ZeRO stage refused)")
    what = "the tracker's total"
    if found["layout"].pp > 1:
        held = held_by_pipeline_stages(found)
        lines.append(f"  note: {PIPELINED_NOTE}:")
        lines.append(
            f"  {'with the stages':<16} {held['total'] / gib:8.2f}   (weights"
            f" {held['weights'] / gib:.2f}, gradients {held['gradients'] / gib:.2f} counted)"
        )
        total, what = held["total"], "with the stages, the total"
    fits = "fits" if total <= gpu_bytes else "does not fit"
    lines.append(f"  {what} {fits} {gpu_name} {gpu_bytes / gib:.1f} GiB")
    return lines


def h100_bytes() -> float:
    """An H100-80GB's memory as the planner counts it (bytes, ``Cluster.memory_bytes``)."""
    from trainscale import planner

    return planner.Cluster(nodes=1, **planner.H100_NODE).memory_bytes


def report(config: TrainConfig, all_layers: bool = False) -> list[str]:
    """The lines ``--estimate-memory`` prints: the fullest rank's memory at its peak by
    the planner's parts, beside the planner's parts (:func:`comparison_lines`, against an
    H100-80GB), in GiB."""
    found = estimate_memory(config, all_layers)
    if all_layers:
        how = "every block"
    else:
        how = f"scaled from (blocks per chunk, in flight) {found['measured_at']}"
    return [
        f"rank {found['rank']} (pipeline rank {found['pp_rank']}, the fullest of"
        f" {len(found['totals'])} measured) of {found['layout'].describe()},"
        f" {found['in_flight']} forward(s) in flight; one step on a fake world"
        f" (FSDPMemTracker, bf16 weights, fp32 reduction; {how}):",
        *comparison_lines(found, h100_bytes(), "an H100's"),
        f"  the gradients' own highest, at the end of backward:"
        f" {found['gradients'] / memory.GIB:.2f}",
    ]
