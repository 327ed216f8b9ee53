"""Chapter 17's exercise: check a reader's mesh groups, by themselves and on real ranks.

The reader writes ``mesh_groups(sizes, rank) -> dict[str, list[int]]``: for a device
mesh of shape ``sizes``, in the order of :data:`DIMS` (torchtitan's, outermost first),
the global ranks of each group ``rank`` belongs to, one per dimension name, and
``"dp"``, its data-parallel group over ``dp_replicate x dp_shard`` together (the ranks
FSDP's HSDP averages gradients over). :func:`check_mesh_groups` checks it as a course's
test suite would, and says what is wrong (which layout, which rank, which dimension,
expected against got):

1. **by itself**, against the mesh written as an array, ``torch.arange(world).view(sizes)``,
   whose groups along a dimension are its rows along it, for every rank of
   :data:`LAYOUTS`;
2. **on real ranks**: :func:`worker` builds each layout with
   ``torch.distributed.device_mesh.init_device_mesh`` on 8 gloo ranks, and each rank
   compares the reader's answer for itself with ``mesh[dim].mesh`` and with the ranks
   of the process group ``mesh.get_group(dim)`` (``mesh["dp_replicate",
   "dp_shard"].mesh`` for ``"dp"``).

The function travels to the ranks as source text (:mod:`trainscale.workers.exercise`),
so it must be self-contained. The same file runs under torchrun::

    torchrun --nproc-per-node=8 -m trainscale.workers.mesh_exercise
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from trainscale import _checks
from trainscale.distributed import RankError, run_ranks, torchrun_main
from trainscale.workers.exercise import (
    ExerciseReport,
    load_reader_function,
    rank_failure,
    reader_source,
)

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's dimension names, outermost first: torchtitan's order, and the capstone's
(``trainscale.train.DIMS``, one layer up; the tests check they agree)."""

GROUPS = (*DIMS, "dp")
"""The groups the reader returns: one per dimension, and ``dp`` over both data dims."""

LAYOUTS: tuple[tuple[int, ...], ...] = ((2, 1, 2, 1, 2), (1, 2, 2, 2, 1), (2, 1, 1, 2, 2))
"""Mesh shapes checked, in the order of :data:`DIMS`, 8 ranks each: TP 2 x PP 2 x DP 2
(the chapter's); HSDP 2 x 2 with CP 2 (a data-parallel group that is not contiguous);
PP 2 x CP 2 x TP 2."""

Groups = Callable[[Sequence[int], int], dict]
"""``mesh_groups(sizes, rank)``: each group's global ranks, by name."""


def describe(sizes: Sequence[int]) -> str:
    """``"pp 2 x dp_shard 2 x tp 2"``: the dimensions of size above 1."""
    parts = [f"{name} {size}" for name, size in zip(DIMS, sizes, strict=True) if size > 1]
    return " x ".join(parts) or "one rank"


def _check_sizes(sizes: Sequence[int]) -> tuple[int, ...]:
    """``sizes`` as a tuple of whole numbers >= 1, one per name of :data:`DIMS`."""
    if len(sizes) != len(DIMS):
        raise ValueError(f"sizes must hold {len(DIMS)} sizes, one per {DIMS}, got {sizes!r}")
    return tuple(
        _checks.count(f"sizes[{name!r}]", s, minimum=1) for name, s in zip(DIMS, sizes, strict=True)
    )


def array_groups(sizes: Sequence[int], rank: int) -> dict[str, list[int]]:
    """The groups of ``rank`` read off the mesh as an array, ``arange(world).view(sizes)``:
    along a dimension, the row through ``rank``'s coordinates (the check's reference)."""
    shape = _check_sizes(sizes)
    mesh = torch.arange(math.prod(shape)).view(shape)
    r = _checks.count("rank", rank, minimum=0)
    if r >= mesh.numel():
        raise ValueError(f"rank must be in 0 .. {mesh.numel() - 1}, got {rank}")
    where = [int(i) for i in (mesh == r).nonzero()[0]]
    groups = {}
    for dim, name in enumerate(DIMS):
        index = [*where[:dim], slice(None), *where[dim + 1 :]]
        groups[name] = mesh[tuple(index)].tolist()
    groups["dp"] = mesh[where[0], :, :, where[3], where[4]].flatten().tolist()
    return groups


def _problem(sizes: Sequence[int], rank: int, got: object, want: dict) -> str | None:
    """What is wrong with one rank's answer, or ``None``: the first group that differs."""
    where = f"{describe(sizes)} (sizes {list(sizes)}), rank {rank}"
    if not isinstance(got, dict):
        return f"{where}: returned {type(got).__name__}, not a dict of group name -> ranks"
    missing = [name for name in GROUPS if name not in got]
    if missing:
        return f"{where}: no group for {missing}; return one for each of {list(GROUPS)}"
    for name in GROUPS:
        try:
            ranks = [int(r) for r in got[name]]
        except (TypeError, ValueError):
            return f"{where}, {name!r}: {got[name]!r} is not a list of ranks"
        if ranks != want[name]:
            if sorted(ranks) == sorted(want[name]):
                why = "the right ranks in another order: list them by mesh coordinate"
            elif ranks == _column_major(sizes, rank)[name]:
                why = "the first dimension varies fastest here; in the mesh the last, tp, does"
            else:
                why = "a group holds the ranks whose coordinates differ only along it"
            return f"{where}, {name!r}: expected {want[name]}, got {ranks} ({why})"
    return None


def _column_major(sizes: Sequence[int], rank: int) -> dict[str, list[int]]:
    """The groups if the first dimension varied fastest: the mesh transposed, a typical
    slip (a hint only; the check's reference is :func:`array_groups`)."""
    strides = [math.prod(sizes[:d]) for d in range(len(sizes))]
    coords = [rank // stride % size for stride, size in zip(strides, sizes, strict=True)]
    groups = {}
    for d, name in enumerate(DIMS):
        first = rank - coords[d] * strides[d]
        groups[name] = [first + i * strides[d] for i in range(sizes[d])]
    first = rank - coords[1] * strides[1] - coords[2] * strides[2]
    groups["dp"] = [
        first + i * strides[1] + j * strides[2] for i in range(sizes[1]) for j in range(sizes[2])
    ]
    return groups


def _answer(function: Groups, sizes: Sequence[int], rank: int) -> tuple[object, str | None]:
    """The reader's answer for one rank, or the error it raised, said in one line."""
    try:
        return function(list(sizes), rank), None
    except Exception as error:  # the reader's code: report whatever it raised
        call = f"mesh_groups({list(sizes)}, {rank})"
        return None, f"{call} raised {type(error).__name__}: {error}"


def check_alone(function: Groups, layouts: Sequence[Sequence[int]] = LAYOUTS) -> list[str]:
    """What is wrong with ``function`` on every rank of each layout: empty if nothing
    (at most one line per layout: its first wrong rank)."""
    problems = []
    for sizes in layouts:
        shape = _check_sizes(sizes)
        for rank in range(math.prod(shape)):
            got, error = _answer(function, shape, rank)
            found = error or _problem(shape, rank, got, array_groups(shape, rank))
            if found:
                problems.append(found)
                break
    return problems


def worker(
    rank: int, world_size: int, source: str, name: str, layouts: Sequence[Sequence[int]]
) -> list[str | None]:
    """On each layout: build the mesh with ``init_device_mesh``, compare the reader's
    groups for this rank with the mesh's; return one problem (or ``None``) per layout.

    Every rank builds every mesh whatever the reader's code does (building one is
    collective), and catches what it raises."""
    from torch.distributed.device_mesh import init_device_mesh

    function = load_reader_function(source, name, {})
    found: list[str | None] = []
    for sizes in layouts:
        mesh = init_device_mesh("cpu", tuple(sizes), mesh_dim_names=DIMS)
        want = {}
        for dim in DIMS:
            rows = mesh[dim].mesh.tolist()
            group = dist.get_process_group_ranks(mesh.get_group(dim))
            if rows != group:  # torch's two views of one group disagree: not the reader
                raise RuntimeError(f"{dim}: mesh {rows} but process group {group}")
            want[dim] = rows
        want["dp"] = mesh["dp_replicate", "dp_shard"].mesh.flatten().tolist()
        got, error = _answer(function, sizes, rank)
        found.append(error or _problem(sizes, rank, got, want))
    return found


def check_mesh_groups(
    function: Groups, layouts: Sequence[Sequence[int]] = LAYOUTS, timeout: float = 120
) -> ExerciseReport:
    """Check the reader's ``mesh_groups`` by itself, then on real gloo ranks against
    ``init_device_mesh``; the report says what is wrong. All ``layouts`` must have the
    same number of ranks (one job builds them all)."""
    shapes = [_check_sizes(sizes) for sizes in layouts]
    worlds = {math.prod(s) for s in shapes}
    if len(worlds) != 1:
        raise ValueError(f"layouts must all have the same number of ranks, got {sorted(worlds)}")
    (world,) = worlds
    report = ExerciseReport(f"mesh_groups on {len(shapes)} layouts of {world} ranks:")
    alone = check_alone(function, shapes)
    for problem in alone:
        report.fail(f"by itself: {problem}")
    if not alone:
        report.ok("by itself: every rank's groups are the rows of arange(world).view(sizes)")
    source, name = reader_source(function)
    try:
        found = run_ranks(worker, world, source, name, shapes, timeout=timeout)
    except RankError as error:
        report.fail(rank_failure(error, timeout, "building a mesh waits for every rank"))
        return report
    for index, sizes in enumerate(shapes):
        wrong = [f[index] for f in found if f[index]]
        if wrong:
            report.fail(f"on {world} gloo ranks: {wrong[0]}")
            if len(wrong) > 1:
                report.lines.append(f"    (and {len(wrong) - 1} more ranks of this layout)")
        else:
            report.ok(
                f"on {world} gloo ranks, {describe(sizes)}: every rank's groups equal"
                " init_device_mesh's (mesh[dim].mesh and get_group(dim))"
            )
    return report


def reference_groups(sizes: Sequence[int], rank: int) -> dict[str, list[int]]:
    """The reference solution: row-major coordinates, the last dimension fastest."""
    import math

    names = ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    strides = [math.prod(sizes[d + 1 :]) for d in range(len(sizes))]
    coords = [rank // stride % size for stride, size in zip(strides, sizes, strict=True)]
    groups = {}
    for d, name in enumerate(names):
        first = rank - coords[d] * strides[d]  # this rank's group, coordinate 0 along d
        groups[name] = [first + i * strides[d] for i in range(sizes[d])]
    first = rank - coords[1] * strides[1] - coords[2] * strides[2]
    groups["dp"] = [
        first + i * strides[1] + j * strides[2] for i in range(sizes[1]) for j in range(sizes[2])
    ]
    return groups


def main(rank: int, world_size: int) -> None:
    """``torchrun`` entry: the reference solution on the chapter's layouts (8 ranks)."""
    source, name = reader_source(reference_groups)
    found = worker(rank, world_size, source, name, LAYOUTS)
    print(f"rank {rank}: {sum(f is None for f in found)} of {len(found)} layouts match")


if __name__ == "__main__":
    torchrun_main(main)
