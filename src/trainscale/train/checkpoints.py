"""The capstone's checkpoints: model, optimiser and progress under the unsplit model's
names, written by every rank in parallel with ``torch.distributed.checkpoint``, so
that a checkpoint of one layout loads into any other.

A checkpoint folder is renamed to its final name by rank 0 once every rank has
written its shards: a multi-node run needs ``--ckpt-dir`` on a filesystem every
node sees (a shared filesystem or an object store that DCP writes to).
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from trainscale import _checks
from trainscale.transformer import GPT

if TYPE_CHECKING:
    from trainscale.train.parallelize import Built

CHECKPOINT_PREFIX = "step_"
"""A complete checkpoint is the folder ``step_<8-digit step>``; one being written
carries the suffix ``.partial`` until every rank has finished writing it."""


def checkpoint_path(folder: str | os.PathLike, step: int) -> Path:
    """Where the complete checkpoint taken after ``step`` optimiser steps lives."""
    return Path(folder) / f"{CHECKPOINT_PREFIX}{_checks.count('step', step):08d}"


def complete_checkpoints(folder: str | os.PathLike | None) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint in ``folder``, oldest first.

    Folders still called ``step_<N>.partial`` were not finished (a rank died
    while writing) and are ignored, as is anything else in the folder.
    """
    if folder is None or not Path(folder).is_dir():
        return []
    found = []
    for entry in Path(folder).iterdir():
        digits = entry.name.removeprefix(CHECKPOINT_PREFIX)
        if entry.is_dir() and entry.name.startswith(CHECKPOINT_PREFIX) and digits.isdigit():
            found.append((int(digits), entry))
    return sorted(found)


def latest_checkpoint(folder: str | os.PathLike | None) -> tuple[int, Path] | None:
    """``(step, path)`` of the newest complete checkpoint in ``folder``, or ``None``."""
    found = complete_checkpoints(folder)
    return found[-1] if found else None


class TrainState(Stateful):
    """What a checkpoint holds: model, optimiser and progress (step, data position).

    ``parts`` are the model chunks this rank holds (one, or one per pipeline
    stage it runs) and ``optimizers`` their optimisers. ``get_state_dict`` names
    every tensor by its place in the *unsplit* model (``blocks.3.mlp.0.weight``;
    the optimiser's state flattened to ``state.<name>.exp_avg`` and
    ``param_groups.<name>.lr``), whatever the layout: under DDP each rank holds
    everything and one copy is written; under FSDP and tensor parallelism each
    rank writes and reads its own shards (DTensors); under pipelining each rank
    holds its stages' names only. So a checkpoint written at one layout loads
    into any other: ``torch.distributed.checkpoint`` reads each rank's pieces.
    """

    OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
    LOAD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)

    def __init__(
        self,
        parts: list[torch.nn.Module],
        optimizers: list[torch.optim.Optimizer],
        progress: dict,
    ):
        self.parts, self.optimizers, self.progress = parts, optimizers, progress

    def state_dict(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        optimizer: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            weights, moments = get_state_dict(part, opt, options=self.OPTIONS)
            model.update(weights)
            optimizer.update(moments)
        return {"model": model, "optimizer": optimizer, "progress": dict(self.progress)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Each part takes its own names from what this rank asked for (strict=False:
        # the other parts' names are there too).
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            set_state_dict(
                part,
                opt,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=self.LOAD_OPTIONS,
            )
        self.progress.update(state["progress"])


def save_checkpoint(state: TrainState, folder: str | os.PathLike, keep: int) -> Path:
    """Write ``state`` to ``folder/step_<N>`` (every rank calls this), then delete all
    but the ``keep`` newest complete checkpoints."""
    rank = dist.get_rank()
    final = checkpoint_path(folder, state.progress["step"])
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left over from a crash
        partial.mkdir(parents=True)
    dist.barrier()
    dcp.save({"train": state}, checkpoint_id=partial)
    dist.barrier()  # every rank has written its shards: now the checkpoint is complete
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        partial.rename(final)
        for _, old in complete_checkpoints(folder)[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return final


def load_latest(state: TrainState, folder: str | os.PathLike | None) -> int | None:
    """Load the newest complete checkpoint into ``state`` (every rank calls this);
    return its step, or ``None`` if there is none. Rank 0 picks the checkpoint,
    so all ranks load the same one."""
    found = [latest_checkpoint(folder) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        return None
    step, path = found[0]
    expected = dict(state.progress)
    dcp.load({"train": state}, checkpoint_id=path)
    for key in ("seed", "global_batch", "total_steps"):
        if state.progress[key] != expected[key]:
            raise ValueError(
                f"checkpoint {path} was written with {key}={state.progress[key]}, "
                f"but this run has {key}={expected[key]}: use another --ckpt-dir"
            )
    return step


FINAL_MOMENTS = ("exp_avg", "exp_avg_sq")
"""The optimiser state :func:`save_final_weights` writes beside the weights: Adam's two
moments of every parameter."""


def save_final_weights(built: Built, path: str | os.PathLike) -> None:
    """Gather the full final state (every rank calls this) and let rank 0 save it with
    ``torch.save``: every weight under the unsplit model's parameter name, in its
    order, then Adam's moments of each, ``state.<name>.exp_avg`` and
    ``state.<name>.exp_avg_sq`` (:data:`FINAL_MOMENTS`), in the same order."""
    options = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    weights: dict[str, torch.Tensor] = {}
    # Gathering a tensor sharded by both FSDP and TP takes two all-gathers, and
    # torch logs a warning that says so: expected here, and no concern for a save.
    redistribute_log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute_log.level
    redistribute_log.setLevel(logging.ERROR)
    try:
        for part, optimizer in zip(built.parts, built.optimizers, strict=True):
            model, moments = get_state_dict(part, optimizer, options=options)
            weights.update({name: t.detach().cpu() for name, t in model.items()})
            weights.update(
                {
                    name: t.detach().cpu()
                    for name, t in moments.items()
                    if name.startswith("state.") and name.endswith(FINAL_MOMENTS)
                }
            )
    finally:
        redistribute_log.setLevel(level)
    c = built.coordinate
    mine = weights if c["dp_replicate"] == c["dp_shard"] == c["tp"] == c["cp"] == 0 else {}
    pieces = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, pieces, dst=0)
    if dist.get_rank() == 0:
        merged = {name: t for piece in pieces for name, t in piece.items()}
        with torch.device("meta"):
            names = [name for name, _ in GPT(built.parts[0].config).named_parameters()]
        order = [*names, *(f"state.{n}.{m}" for m in FINAL_MOMENTS for n in names)]
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        scratch = target.with_name(target.name + ".partial")
        torch.save({name: merged[name] for name in order}, scratch)
        scratch.replace(target)
    dist.barrier()
