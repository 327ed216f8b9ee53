"""``python -m trainscale.planner``: chapter 16's layout planner on the command line.

Give it a model, a cluster and a global batch; it prints the planner's best
TP x PP x DP layouts (:func:`trainscale.planner.plan`, one line per shape, with
the estimated MFU, step time and memory per GPU) and a ready ``torchrun``
command that runs the best one with the book's capstone, :mod:`trainscale.train`::

    python -m trainscale.planner --model 70b
    python -m trainscale.planner --model gpt-175b-on-64-a100s-selective-recompute
    python -m trainscale.planner --params 7e9 --layers 32 --hidden 4096 --heads 32 \\
        --seq-len 4096 --vocab 32000 --gpu H100-80GB --nodes 2 --global-batch 512
    python -m trainscale.planner --model 70b --laptop 8
    python -m trainscale.planner --model 70b --software torchtitan-fsdp2 --no-dropout
    python -m trainscale.planner --layers 32 --hidden 4096 --heads 32 --kv-heads 8 \
        --ffn 14336 --gated-mlp --experts 8 --experts-per-token 2 --vocab 32000 \
        --seq-len 4096

A model is a preset (``--list-models`` names them: the book's worked example
``70b``, Llama 3 8B, 70B and 405B and Mixtral 8x7B's shapes, and every published run of
:func:`trainscale.published.published_runs`, each with its own cluster and global batch)
or a full shape (``--layers``, ``--hidden``, ``--heads``, ``--kv-heads``, ``--ffn``,
``--gated-mlp``, ``--vocab``, ``--seq-len``, ``--experts``, ``--experts-per-token``;
``--params`` counted from it unless given); explicit flags also override a preset's.
Every interleaving depth of :data:`trainscale.planner.INTERLEAVING` is searched unless
``--virtual-stages`` says otherwise, and the report counts the layouts each rule
rejected; ``--explain TP,PP,DP[,CP,EP,V]`` says why one layout ranks where it does, or
why it is rejected, with the term that limits it (:mod:`trainscale.planner.explain`).
For a published run left as published, it also prints the planner's estimate of the
published layout, with its range
(:func:`trainscale.planner.estimate_run`), next to the published MFU. ``--laptop N``
scales the best layout down to a tiny model that runs on N gloo processes on a
CPU, with the same kinds of parallelism (:func:`laptop_shape`), and prints that
command too.

The software stack is an input (:class:`trainscale.software.Software`): ``--software
NAME`` picks a preset of :data:`trainscale.software.SOFTWARE` (a published run's preset
brings its own; otherwise :data:`trainscale.software.DEFAULT_SOFTWARE`, the planner's
assumptions before the software was an input), and ``--fused-attention`` /
``--no-fused-attention``, ``--dropout`` / ``--no-dropout``, ``--gradient-reduce-dtype``
change one field of it. ``--max-tp N`` and ``--zero-stages Z[,Z...]`` narrow the search.

``--json`` prints the same plan as data (:func:`plan_json`): the ranked layouts with their
MFU range, memory and time parts, the verdict counts, the fastest rejected layouts with
their reasons, the ``torchrun`` command, and the text report's lines; with
``--list-models``, the presets, GPUs and software stacks (:func:`choices`). Chapter 16's
web page runs the same function under Pyodide.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import math
import re
import sys
from collections import Counter
from collections.abc import Sequence

from trainscale import planner
from trainscale.memory import GIB, USABLE_MEMORY
from trainscale.planner.arguments import (
    DEFAULT_GPU,
    MODEL_FLAGS,
    MODEL_PRESETS,
    SHAPE_FLAGS,
    SOFTWARE_FLAGS,
    Preset,
    Request,
    parse,
    parser,
    preset_name,
    presets,
    shape_params,
)
from trainscale.planner.commands import (
    LAPTOP_MODEL,
    RUNNER_SOFTWARE,
    _laptop_lines,
    _lines,
    _shape_note,
    laptop_command,
    laptop_degrees,
    laptop_drops,
    laptop_flags,
    laptop_shape,
    on_the_runner,
    refusal,
    train_flags,
)
from trainscale.planner.explain import explain, explain_spec
from trainscale.published import GPUS, PublishedRun
from trainscale.software import SOFTWARE, Software

__all__ = [  # the command line's names, and those it re-exports from arguments and commands
    "DEFAULT_GPU",
    "LAPTOP_MODEL",
    "MODEL_FLAGS",
    "MODEL_PRESETS",
    "REMEDIES",
    "SHAPE_FLAGS",
    "SOFTWARE_FLAGS",
    "Preset",
    "Request",
    "choices",
    "cluster_command",
    "describe",
    "laptop_command",
    "laptop_degrees",
    "laptop_drops",
    "laptop_flags",
    "laptop_shape",
    "layout_table",
    "main",
    "nothing_fits",
    "parse",
    "parser",
    "plan_json",
    "preset_name",
    "presets",
    "refusal",
    "rejections",
    "report",
    "shape_params",
    "too_many_gpus",
    "train_flags",
]


# --------------------------------------------------------------------------- commands


def cluster_command(layout: planner.Layout, request: Request) -> str:
    """The ``torchrun`` command each node of the cluster runs for ``layout``."""
    cluster = request.cluster
    launcher = [
        "torchrun",
        f"--nnodes={cluster.nodes}",
        f"--nproc-per-node={cluster.gpus_per_node}",
        *("--rdzv-backend=c10d", "--rdzv-endpoint=$HEAD_NODE:29500"),
    ]
    flags = train_flags(layout, request.model, cluster.peak_flops)
    return _lines(launcher, flags)


# --------------------------------------------------------------------------- report


def _mfu(layout: planner.Layout, mfu_range: tuple[float, float] | None) -> str:
    """MFU, with the planner's range (:func:`trainscale.planner.mfu_range`) when given."""
    text = f"{layout.mfu:.1%}"
    if mfu_range is not None:
        text += f" ({mfu_range[0]:.1%}-{mfu_range[1]:.1%})"
    return text


def describe(request: Request) -> list[str]:
    """The lines that say what is planned."""
    m, c = request.model, request.cluster
    tokens = request.global_batch * m.seq_len
    shape = []
    if m.kv_heads and m.kv_heads != m.heads:
        shape.append(f"{m.kv_heads} key-value heads")
    if m.ffn_hidden or m.gated_mlp:
        shape.append(f"{'gated ' if m.gated_mlp else ''}MLP of {m.ffn_hidden or 4 * m.hidden:,}")
    if m.experts:
        shape.append(
            f"{m.experts} experts, {m.top_k} per token ({m.active_params / 1e9:.1f}B active)"
        )
    return [
        f"model: {m.params / 1e9:,.1f}B parameters, {m.layers} layers, hidden {m.hidden:,},"
        f" {m.heads} heads, {m.seq_len:,} tokens per sequence, vocabulary {m.vocab:,}",
        *([f"  shape: {', '.join(shape)}"] if shape else []),
        f"cluster: {c.nodes} node{'s' * (c.nodes != 1)} x {c.gpus_per_node} {request.gpu}"
        f" = {c.gpus:,} GPUs"
        f" of {c.memory_bytes / GIB:.1f} GiB, {c.inter_node_bandwidth / 1e9:g} GB/s per GPU"
        " between nodes",
        f"global batch: {request.global_batch:,} sequences = {tokens:,} tokens",
    ]


def layout_table(
    layouts: Sequence[planner.Layout],
    ranges: Sequence[tuple[float, float]] | None = None,
) -> list[str]:
    """One line per layout: shape, settings, MFU (with its range, one ``(low, high)`` per
    layout when ``ranges`` is given), step time, memory per GPU."""
    if ranges is not None and len(ranges) != len(layouts):
        raise ValueError(f"ranges must give one (low, high) per layout, got {len(ranges)}")
    lines = [
        f"  #  {'layout':<28} {'settings':<46} {'MFU (range)':<22} {'step':>9} {'memory/GPU':>11}"
    ]
    for rank, lay in enumerate(layouts, start=1):
        shape = lay.name.replace("\u00d7", "x")
        v = f", V {lay.virtual_stages}" if lay.virtual_stages > 1 else ""
        span = None if ranges is None else ranges[rank - 1]
        lines.append(
            f"{rank:>3}  {shape:<28} {lay.settings + v:<46} {_mfu(lay, span):<22}"
            f" {lay.step_seconds:>7.2f} s {lay.memory_bytes / GIB:>7.1f} GiB"
        )
    return lines


UNCHECKED = (
    "trainscale.train's own checks need torch, which is not installed here: the command"
    " is layout {place}'s, unchecked (python -m trainscale.planner with torch checks it)"
)
"""The note where :func:`trainscale.planner.commands.refusal` cannot run (no torch: the
planner's web page)."""


def _runnable(
    best: Sequence[planner.Layout], request: Request
) -> tuple[int | None, list[str], bool]:
    """The place in ``best`` of the first layout the capstone can run, a note for each
    faster one it cannot, and whether the capstone's checks ran (they need torch).

    A layout it cannot run fits no GPU on the capstone's own stack
    (:data:`~trainscale.planner.commands.RUNNER_SOFTWARE`, eager element-wise ops and
    loss), or is refused by its argument checks."""
    notes = []
    for place, layout in enumerate(best):
        runner = on_the_runner(layout, request.model, request.cluster)
        if runner.verdict != "fits":
            why = (
                "; ".join(runner.notes)  # its engine refuses the settings: no memory counted
                if runner.verdict == "invalid"
                else f"it needs {runner.memory_bytes / GIB:.1f} GiB per GPU ({runner.verdict})"
            )
            notes.append(
                f"trainscale.train cannot run layout {place + 1} as planned: on its stack"
                f" (software {RUNNER_SOFTWARE}: eager norms, activations and loss) {why}"
            )
            continue
        flags = train_flags(layout, request.model, request.cluster.peak_flops)
        try:
            reason = refusal(flags, request.cluster.gpus)
        except ImportError:  # no torch (chapter 16's web page): the command goes unchecked
            return place, [*notes, UNCHECKED.format(place=place + 1)], False
        if reason is None:
            return place, notes, True
        notes.append(f"trainscale.train cannot run layout {place + 1} as planned: {reason}")
    return None, notes, True


RUNNER_SCAN = 200
"""How many of its own stack's fastest layouts the command line tries, in order, for one
the capstone runs, when none of those it shows does."""


def _first_runnable(request: Request) -> tuple[int, planner.Layout, bool] | None:
    """The place (from 1) among the capstone's own stack's fastest :data:`RUNNER_SCAN`
    layouts of the first one it runs, that layout, and whether its checks ran; ``None``
    when none of them runs (:func:`_runnable`)."""
    for rank, layout in enumerate(_runner_ranked(request), start=1):
        place, _, checked = _runnable([layout], request)
        if place is not None:
            return rank, layout, checked
    return None


def _summary(layout: planner.Layout) -> str:
    """One layout in a line: its shape, settings and estimated MFU."""
    depth = f", V {layout.virtual_stages}" if layout.pp > 1 else ""
    return f"{layout.name.replace(chr(215), 'x')}, {layout.settings}{depth}, MFU {layout.mfu:.1%}"


def _tracked_lines(layout: planner.Layout, request: Request) -> tuple[list[str], bool]:
    """``--check-memory``: the command's step for ``layout`` under torch's memory tracker
    on a fake world of its full size (:func:`trainscale.train.estimate.estimate_memory`),
    beside the planner, and whether the fullest GPU holds it."""
    try:
        from trainscale import train
        from trainscale.train import full_size
    except ImportError:  # no torch (the web page)
        return ["--check-memory needs torch, which is not installed here"], True
    flags = train_flags(layout, request.model, request.cluster.peak_flops)
    found = train.estimate.estimate_memory(train.parse_args(flags))
    gpu = request.cluster.memory_bytes
    lines = full_size.table("the command's step under torch's tracker", found, gpu)
    if found["peak"].get("Total", 0) <= gpu:
        return lines, True
    return [*lines, "refused: the command would run out of memory"], False


def _search(request: Request, software: Software | str) -> list[planner.Layout]:
    """Every layout :func:`trainscale.planner.plan` tries for ``request`` on ``software``,
    less those over ``--max-tp``."""
    layouts = planner.plan(
        *(request.model, request.cluster, request.global_batch),
        software=software,
        virtual_stages=request.virtual_stages,
        context_parallel=request.context_parallel,
        zero_stages=request.zero_stages,
    )
    if request.max_tp is not None:
        layouts = [lay for lay in layouts if lay.tp <= request.max_tp]
    return layouts


@functools.lru_cache(maxsize=8)
def _runner_ranked(request: Request) -> tuple[planner.Layout, ...]:
    """The fastest :data:`RUNNER_SCAN` (or ``--top``) layouts on the capstone's own
    stack, searched once per request for :func:`_runner_best` and :func:`_first_runnable`."""
    count = max(RUNNER_SCAN, request.top)
    return tuple(planner.top_layouts(_search(request, RUNNER_SOFTWARE), count=count))


def _runner_best(request: Request) -> list[planner.Layout]:
    """The fastest layouts on the capstone's own stack, where none planned for
    ``request.software`` runs there."""
    return list(_runner_ranked(request)[: request.top])


def _published_lines(run: PublishedRun, ranked: Sequence[planner.Layout]) -> list[str]:
    """The planner's estimate of the published layout, with its range, next to the
    published MFU (:func:`trainscale.planner.estimate_run`), and where its shape ranks
    among the fitting shapes of this search, ``ranked`` fastest first
    (:func:`trainscale.planner.top_layouts`; the settings a user gets, where the
    estimate's rank is at the run's own)."""
    try:
        estimate = planner.estimate_run(run)
    except ValueError as error:  # a layout the planner cannot estimate (e.g. CP > 1)
        return [f"the published layout: {error}", ""]
    fits = "fits" if estimate.fits else "does not fit"
    place = (
        f"its shape ranks {estimate.rank} at the run's own settings"
        if estimate.rank
        else "its shape is not among the planner's fitting ones at the run's own settings"
    )
    shapes = [lay.shape for lay in ranked]
    shape = (run.tp, run.pp, run.dp)
    here = shapes.index(shape) + 1 if shape in shapes else "none"
    return [
        f"the published layout, TP {run.tp} x PP {run.pp} x DP {run.dp}: estimated MFU"
        f" {estimate.mfu:.1%} (range {estimate.mfu_low:.1%}-{estimate.mfu_high:.1%}),",
        f"  published {planner.reported_mfu(run):.1%} (6N); it {fits} in"
        f" {estimate.memory_bytes / GIB:.1f} GiB per GPU;",
        f"  {place}; in this search, {here} of {len(shapes):,} fitting shapes",
        "",
    ]


def without_context_parallel(ranked: Sequence[planner.Layout], shown: int) -> list[str]:
    """When each of the ``shown`` fastest of the fitting shapes ``ranked`` (fastest first,
    :func:`trainscale.planner.top_layouts`) splits the sequence (CP > 1), the fastest that
    does not and its place: all a stack without ring attention can run (Llama 3's
    8K-token stage, for one, used none)."""
    if not ranked or any(lay.cp == 1 for lay in ranked[:shown]):
        return []
    place = next((i for i, lay in enumerate(ranked, start=1) if lay.cp == 1), None)
    if place is None:
        return ["every fitting shape splits the sequence (context parallelism)", ""]
    return [
        f"without context parallelism, the fastest is number {place}:"
        f" {_summary(ranked[place - 1])}",
        "",
    ]


def rejections(counts: dict[str, int]) -> str:
    """How many layouts each rule rejected (:func:`trainscale.planner.verdict_counts`)."""
    rules = ", ".join(f"{counts[v]:,} {v}" for v in planner.VERDICTS if v != "fits")
    return f"rejected: {rules}"


REMEDIES = {
    "out of memory": "more GPUs (--nodes), GPUs with more memory (--gpu) or shorter"
    " sequences (--seq-len)",
    "bubble too large": "more micro-batches per pipeline: a larger --global-batch, or"
    " interleaving (--virtual-stages), or fewer pipeline stages (fewer GPUs per replica)",
    "TP across nodes": "nodes with more GPUs (--gpus-per-node), or a model with heads that"
    " split into a node's GPUs (--heads)",
}
"""What lifts each verdict that rejects a layout, named by the flags that change it."""


def nothing_fits(request: Request, layouts: Sequence[planner.Layout]) -> list[str]:
    """Why no layout fits, and what would help: the nearest layout (the fewest problems,
    then the fastest) with each rule it breaks, its note and the flags that lift it; when
    every layout breaks a rule of its own shape, the most common of them."""
    usable = [lay for lay in layouts if lay.verdict != "invalid"]
    if not usable:
        notes = Counter(re.sub(r"[0-9][0-9,.]*", "N", lay.notes[0]) for lay in layouts)
        rule, count = notes.most_common(1)[0]
        example = next(
            lay.notes[0] for lay in layouts if re.sub(r"[0-9][0-9,.]*", "N", lay.notes[0]) == rule
        )
        model = request.model
        return [
            f"no layout fits: no split of the {request.cluster.gpus:,} GPUs into TP x CP x PP"
            f" x DP keeps every rule of the shape (TP divides the {model.heads} heads, DP the"
            f" {request.global_batch:,} sequences, PP at most {model.layers + 2} stages);"
            f" the rule most often broken ({count:,} of {len(layouts):,}): {example}",
            "(--nodes or --global-batch: a GPU count that such degrees multiply to)",
        ]
    nearest = min(usable, key=lambda lay: (len(lay.problems), lay.step_seconds))
    lines = [
        f"no layout fits. The nearest, {nearest.name.replace(chr(215), 'x')}"
        f" ({nearest.settings}, V {nearest.virtual_stages}), breaks:"
    ]
    notes = nearest.notes[-len(nearest.problems) :]  # one per problem, in the same order
    for problem, note in zip(nearest.problems, notes, strict=True):
        lines.append(f"  {problem}: {note}; would help: {REMEDIES.get(problem, 'see above')}")
    return lines


def too_many_gpus(request: Request) -> str | None:
    """Why the cluster has more GPUs than any layout can use, if it has: DP at most the
    global batch (one sequence per replica), TP at most the heads, PP at most the layers + 2
    (:func:`trainscale.planner.memory._chunks_fit`), CP at most the degrees tried."""
    model, cluster = request.model, request.cluster
    cp = max(
        request.context_parallel
        or planner.context_parallel_degrees(model, cluster, request.software)
    )
    most = request.global_batch * model.heads * (model.layers + 2) * cp
    if cluster.gpus <= most:
        return None
    return (
        f"--nodes: {cluster.gpus:,} GPUs are more than any layout can use, at most"
        f" {most:,} = --global-batch {request.global_batch:,} (DP) x --heads {model.heads}"
        f" (TP) x (--layers {model.layers} + 2) (PP) x CP {cp}: use fewer nodes or a larger"
        " global batch"
    )


def report(request: Request) -> tuple[list[str], bool]:
    """Everything ``main`` prints for ``request``, and whether it found a layout to run."""
    return _report(request, {})


def _report(request: Request, data: dict) -> tuple[list[str], bool]:
    """:func:`report`, writing the same plan as data into ``data`` (:func:`plan_json`)."""
    data.update(request=_request_json(request), summary=describe(request))
    crowded = too_many_gpus(request)
    if crowded is not None:
        data["error"] = crowded
        return [*describe(request), "", crowded], False
    spec = None if request.explain is None else explain_spec(request.explain, request.cluster.gpus)
    stack = request.software
    layouts = _search(request, stack)
    ranked = planner.top_layouts(layouts, count=max(1, len(layouts)))  # fitting shapes
    best = ranked[: request.top]
    counts = planner.verdict_counts(layouts)
    rejected = _rejected(layouts)
    data.update(
        layouts_tried=len(layouts),
        verdicts=counts,
        rejected=[_layout_json(lay) for lay in rejected],
    )
    lines = [*describe(request), f"{len(layouts):,} layouts tried, {counts['fits']:,} fit", ""]
    if spec is not None:
        lines += [*explain(request, spec, layouts), ""]
    if not best:
        data["nothing_fits"] = nothing_fits(request, layouts)
        return [*lines, rejections(counts), "", *nothing_fits(request, layouts)], False
    ranges = [
        planner.mfu_range(request.model, request.cluster, lay, software=stack) for lay in best
    ]
    data["best"] = [_layout_json(lay, span) for lay, span in zip(best, ranges, strict=True)]
    lines += [
        f"the fastest shapes (planner estimates, software {stack.name}):",
        *layout_table(best, ranges),
        "",
        rejections(counts),
        "",
    ]
    plain = without_context_parallel(ranked, request.top)
    data["without_context_parallel"] = plain[:1]
    lines += plain
    if request.published is not None:
        published = _published_lines(request.published, ranked)
        lines += published
        data["published"] = published[:-1]
    place, notes, checked = _runnable(best, request)
    if place is None and stack.name != RUNNER_SOFTWARE:
        best = _runner_best(request)
        ranges = [
            planner.mfu_range(request.model, request.cluster, lay, software=RUNNER_SOFTWARE)
            for lay in best
        ]
        notes.append(
            f"none of these runs on trainscale.train's stack; its fastest (software"
            f" {RUNNER_SOFTWARE}):"
        )
        place, more, checked = _runnable(best, request)
        notes += more
        data["runner_best"] = [
            _layout_json(lay, span) for lay, span in zip(best, ranges, strict=True)
        ]
        table = layout_table(best, ranges)
    else:
        table = []
    label = None if place is None else place + 1
    if place is None:
        found = _first_runnable(request)
        if found is not None:
            label, layout, checked = found
            notes.append(
                f"the fastest layout trainscale.train runs is number {label} on its stack"
                f" (software {RUNNER_SOFTWARE}): {_summary(layout)}"
            )
            best, place = [*best, layout], len(best)
    data["notes"] = notes
    lines += [*(f"note: {note}" for note in notes), *table, *([""] if notes else [])]
    if place is None:
        return [*lines, "none of these layouts runs with trainscale.train as it is"], False
    chosen = best[place]
    where = "on each node run" if request.cluster.nodes > 1 else "run"
    lines += [f"to train layout {label}, {chosen.name.replace(chr(215), 'x')}, {where}", ""]
    shape_notes = _shape_note(request.model, chosen)
    lines += [cluster_command(chosen, request), "", *shape_notes]
    if request.check_memory:
        tracked, holds = _tracked_lines(chosen, request)
        lines += [*tracked, ""]
        data["tracked"] = tracked
        if not holds:
            return lines, False
    data["command"] = {
        "layout": label,
        "where": where,
        "text": cluster_command(chosen, request),
        "checked": checked,
        "notes": [note for note in shape_notes if note],
    }
    if request.laptop is not None:
        lines += _laptop_lines(chosen, request.laptop)
    return lines, True


# --------------------------------------------------------------------------- JSON


def _plain(value: object) -> object:
    """``value`` with ``nan`` as ``None`` and tuples as lists, all the way down (strict JSON)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def _layout_json(layout: planner.Layout, span: tuple[float, float] | None = None) -> dict:
    """One layout as data: its degrees and settings, MFU (and range), step time and its
    parts (:data:`trainscale.planner.TIME_PARTS`), memory per GPU and its parts
    (:data:`trainscale.planner.MEMORY_PARTS`), verdict, problems and notes."""
    fields = dataclasses.asdict(layout)
    return {
        "name": layout.name.replace("\u00d7", "x"),
        "settings": layout.settings,
        **{key: fields[key] for key in ("tp", "cp", "pp", "dp", "ep", "virtual_stages")},
        **{key: fields[key] for key in ("zero_stage", "recompute", "micro_batch")},
        "accumulation": layout.accumulation,
        "mfu": layout.mfu,
        "mfu_range": None if span is None else list(span),
        "step_seconds": layout.step_seconds,
        "times": dict(layout.times),
        "bubble": layout.bubble,
        "memory_bytes": layout.memory_bytes,
        "memory_parts": dict(layout.memory_parts),
        "verdict": layout.verdict,
        "problems": list(layout.problems),
        "notes": list(layout.notes),
    }


def _request_json(request: Request) -> dict:
    """What is planned: the model, the cluster (with the share of its memory the planner
    fills, :data:`trainscale.memory.USABLE_MEMORY`), the batch, the software, the search."""
    software = dataclasses.asdict(request.software)
    software.pop("sources")
    return {
        "model": dataclasses.asdict(request.model),
        "gpu": request.gpu,
        "cluster": {
            **dataclasses.asdict(request.cluster),
            "gpus": request.cluster.gpus,
            "usable_memory": USABLE_MEMORY,
        },
        "global_batch": request.global_batch,
        "software": software,
        "virtual_stages": request.virtual_stages,
        "context_parallel": request.context_parallel,
        "max_tp": request.max_tp,
        "zero_stages": request.zero_stages,
        "top": request.top,
        "published": None if request.published is None else request.published.name,
    }


def _rejected(layouts: Sequence[planner.Layout]) -> list[planner.Layout]:
    """For each verdict that rejects a layout, the fastest layout it rejects (the planner's
    ranking), in the order of the ranking."""
    first: dict[str, planner.Layout] = {}
    for layout in layouts:
        if layout.verdict != "fits":
            first.setdefault(layout.verdict, layout)
    place = {id(layout): rank for rank, layout in enumerate(layouts)}
    return sorted(first.values(), key=lambda layout: place[id(layout)])


def _flag_at_fault(message: str) -> str | None:
    """The flag an error message is about: the one it starts with (``--nodes must be``),
    else the first it names after ``--model`` (``without --model, give every size: --layers
    ... missing``; argparse's ``argument --nodes: invalid float value``)."""
    named = re.findall(r"--[a-z][a-z-]*", message)
    if message.startswith("--") and named:
        return named[0]
    others = [flag for flag in named if flag != "--model"]
    return others[0] if others else (named[0] if named else None)


def choices() -> dict:
    """What a form for the command line offers: every preset (``--list-models``) with its
    model, GPU, nodes, global batch and software; the GPUs; the software stacks."""
    return _plain(
        {
            "models": {
                name: {
                    "title": preset.title,
                    "model": dataclasses.asdict(preset.model),
                    "gpu": preset.gpu,
                    "nodes": preset.nodes,
                    "global_batch": preset.global_batch,
                    "software": preset.software.name,
                    "published": preset.run is not None,
                }
                for name, preset in presets().items()
            },
            "gpus": {name: dataclasses.asdict(gpu) for name, gpu in GPUS.items()},
            "software": {name: stack.title for name, stack in SOFTWARE.items()},
            "default_gpu": DEFAULT_GPU,
        }
    )  # type: ignore[return-value]


def plan_json(argv: Sequence[str]) -> dict:
    """What ``python -m trainscale.planner ARGV --json`` prints, as a dict.

    A plan: ``request`` (what is planned), ``summary`` (the text's first lines),
    ``layouts_tried``, ``verdicts`` (layouts per verdict), ``best`` (the ranked layouts,
    each with ``mfu_range``, ``memory_parts`` and ``times``), ``rejected`` (for each
    verdict that rejects, the fastest layout it rejects, with its ``problems`` and
    ``notes``), ``published``,
    ``notes``, ``command`` (the ``torchrun`` command of the first layout the capstone
    runs, and whether its checks ran), ``nothing_fits`` or ``error`` where they apply,
    ``text`` (the lines ``python -m trainscale.planner`` prints) and ``fits``. Bad input
    gives ``{"error": message, "flag": the flag at fault}``, with the message the
    command line prints; ``--list-models`` gives :func:`choices`. Numbers that do not
    exist (an invalid layout's) are ``None``.
    """
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            request = parse(argv)
    except ValueError as error:
        return {"error": str(error), "flag": _flag_at_fault(str(error))}
    except SystemExit:  # argparse's own refusal: a word where a number goes, an unknown flag
        message = said.getvalue().strip().splitlines()[-1]
        message = message.removeprefix(f"{parser().prog}: error: ")
        return {"error": message, "flag": _flag_at_fault(message)}
    if request is None:
        return choices()
    data: dict = {}
    lines, fits = _report(request, data)
    return _plain({**data, "text": lines, "fits": fits})  # type: ignore[return-value]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 done, 1 nothing fits, 2 bad input)."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    if parser().parse_args(arguments).json:
        data = plan_json(arguments)
        print(json.dumps(data, indent=1, allow_nan=False))
        return 2 if "flag" in data else (0 if data.get("fits", True) else 1)
    try:
        request = parse(argv)
    except ValueError as error:
        print(f"python -m trainscale.planner: error: {error}", file=sys.stderr)
        return 2
    if request is None:
        for name, preset in presets().items():
            print(f"{name:<48} {preset.title}")
        return 0
    lines, fits = report(request)
    print("\n".join(lines))
    return 0 if fits else 1
