"""The capstone's model, built as torchtitan builds it: on the meta device, split into
pipeline stages, and only then given memory, each rank drawing its own shards.

:func:`meta_stages` makes a rank's stages of the decoder without allocating a weight
(``torch.device("meta")``); the parallelisms are applied to those
(:mod:`trainscale.train.parallelize`); :func:`materialise` then gives every stage real
storage (``to_empty``) and draws each parameter's local shard (:func:`init_stage`).
Each parameter is drawn whole from a generator of its own, seeded by the run's seed
and the parameter's name in the unsplit model, and each rank keeps the part its
placement gives it: any layout starts from the weights one process starts from, and
no rank ever holds more than one whole parameter besides its shards.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint

from trainscale import _checks
from trainscale.train.shapes import DIMS, Layout, layer_counts
from trainscale.transformer import GPT, GPTConfig, init_parameter, qkv_by_head_order


def build_mesh(layout: Layout, device: torch.device) -> DeviceMesh:
    """One ``DeviceMesh`` over every rank, shaped :attr:`Layout.sizes` and named
    :data:`~trainscale.train.shapes.DIMS` (size-1 dimensions are kept, so every layout
    has every name)."""
    return init_device_mesh(device.type, layout.sizes, mesh_dim_names=DIMS)


def stage_ids(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """The pipeline stages rank ``pp_rank`` runs: ``pp_rank``, ``pp_rank + pp``, ...
    (the looped order of ``ScheduleInterleaved1F1B``; one stage for 1F1B)."""
    return [pp_rank + chunk * pp for chunk in range(virtual_stages)]


def stage_layers(stage: int, stages: int, layers: int) -> range:
    """The blocks of stage ``stage`` of ``stages``: a contiguous run of ``layers``, as many
    as :func:`layer_counts` gives it."""
    counts = layer_counts(stages, layers)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


class Stage(torch.nn.Module):
    """A contiguous run of the decoder's blocks, the first stage with the embeddings and
    the last with the final norm and head; with one stage, the whole model.

    The blocks sit in a ``ModuleDict`` keyed by their index in the whole model, so
    every parameter keeps the unsplit model's name (``blocks.3.attention.qkv.weight``):
    a checkpoint written by one split loads into any other. ``forward`` computes
    what :class:`trainscale.transformer.GPT` computes over these blocks.

    ``positions`` are the positions of this rank's tokens in their sequences (all of
    them, or this context-parallel rank's share). Under tensor parallelism
    (``tp_mesh``, set by :func:`trainscale.train.parallelize.apply_tensor_parallel`)
    the activations between blocks and between stages are this rank's ``1 / tp`` of
    those tokens (sequence parallelism): the vocabulary-parallel embedding hands them
    over so (reduce-scattered; with a learned position table, all-reduced, the
    positions added, then split, so that every rank's table gets the whole
    gradient), and the head takes them so.
    """

    def __init__(self, model: GPT, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.token_embedding = model.token_embedding if first else None
        self.position_embedding = model.position_embedding if first else None
        self.blocks = torch.nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.final_norm = model.final_norm if last else None
        self.head = model.head if last else None
        self.positions: torch.Tensor | None = None  # None: 0 .. seq - 1
        self.tp_mesh: DeviceMesh | None = None
        self.recompute = "full" if model.config.recompute == "full" else "none"
        self.context_fn = None  # selective recomputation's policy (parallelize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.token_embedding is not None:  # token ids -> (batch, seq, d_model)
            positions = self.positions
            if positions is None:
                positions = torch.arange(x.shape[-1], device=x.device)
            x = self.token_embedding(x)  # under TP, rotary: this rank's share of the tokens
            if self.position_embedding is not None:  # rotary embeddings act in attention
                x = x + self.position_embedding(positions)
                if self.tp_mesh is not None:  # whole -> this rank's share (backward: gather)
                    x = _relayout(x, self.tp_mesh, Replicate(), Shard(1))
        recompute = self.recompute != "none" and torch.is_grad_enabled()
        options = {"context_fn": self.context_fn} if self.recompute == "selective" else {}
        for block in self.blocks.values():
            x = checkpoint(block, x, use_reentrant=False, **options) if recompute else block(x)
        if self.head is not None:  # -> logits (batch, seq, vocab); under TP, vocab split
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


def meta_stages(config: GPTConfig, stages: list[int], total: int) -> list[Stage]:
    """This rank's stages of ``GPT(config)``, built on the meta device: shapes and
    names, no storage (the other stages' modules are dropped with the meta model)."""
    with torch.device("meta"):
        model = GPT(config)
    return split_model(model, stages, total)


def parameter_seed(seed: int, name: str) -> int:
    """The seed of parameter ``name``'s generator: the first 8 bytes of SHA-256 of
    ``"<seed>:<name>"``, below 2**63 (Python's ``hash`` of a string differs between
    processes)."""
    digest = hashlib.sha256(f"{_checks.count('seed', seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


@torch.no_grad()
def full_parameter(config: GPTConfig, name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """Parameter ``name`` of ``GPT(config)``, whole, in float32 on the CPU: drawn by
    :func:`trainscale.transformer.init_parameter` from its own generator
    (:func:`parameter_seed`), the ``qkv`` rows then stored head by head if the config
    says so. The same on every rank and in every layout."""
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    whole = torch.empty(shape, dtype=torch.float32)
    init_parameter(config, name, whole, generator)
    if config.qkv_layout == "by_head" and ".qkv." in name:
        whole = whole[qkv_by_head_order(config.d_model, config.heads, config.kv_heads)]
    return whole


@torch.no_grad()
def init_stage(part: Stage, seed: int) -> None:
    """Draw every parameter of ``part`` (materialised, :func:`materialise`) in place:
    each rank copies its own piece of :func:`full_parameter` into its local shard
    (``distribute_tensor`` without communication, ``src_data_rank=None``, cuts the same
    piece the parameter's placements hold, whatever TP and FSDP did to it)."""
    for name, param in part.named_parameters():
        whole = full_parameter(part.config, name, param.shape, seed)
        if isinstance(param, DTensor):
            mine = distribute_tensor(
                whole.to(param.device), param.device_mesh, param.placements, src_data_rank=None
            )
            param.to_local().copy_(mine.to_local())
        else:
            param.copy_(whole)


def materialise(parts: list[Stage], device: torch.device, seed: int) -> None:
    """Give each meta stage storage on ``device`` and draw its weights (:func:`init_stage`):
    torchtitan's ``to_empty`` then ``init_weights``, after the parallelisms."""
    for part in parts:
        part.to_empty(device=device)
        init_stage(part, seed)
