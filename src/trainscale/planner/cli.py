"""``python -m trainscale.planner``: chapter 13's layout planner on the command line.

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

A model is a preset (``--list-models`` names them: the book's worked example
``70b``, and every published run of :func:`trainscale.published.published_runs`,
each with its own cluster and global batch) or explicit sizes; explicit flags
also override a preset's. For a published run left as published, it also prints
the planner's estimate of the published layout, with its range
(:func:`trainscale.planner.estimate_run`), next to the published MFU. ``--laptop N``
scales the best layout down to a tiny model that runs on N gloo processes on a
CPU, with the same kinds of parallelism (:func:`laptop_shape`), and prints that
command too.

The software stack is an input (:class:`trainscale.software.Software`): ``--software
NAME`` picks a preset of :data:`trainscale.software.SOFTWARE` (a published run's preset
brings its own; otherwise :data:`trainscale.software.DEFAULT_SOFTWARE`, the planner's
assumptions before the software was an input), and ``--fused-attention`` /
``--no-fused-attention``, ``--dropout`` / ``--no-dropout``, ``--gradient-reduce-dtype``
change one field of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from trainscale import _checks, planner
from trainscale.memory import GIB
from trainscale.planner.commands import (
    LAPTOP_MODEL,
    _laptop_lines,
    _lines,
    _shape_note,
    laptop_command,
    laptop_flags,
    laptop_shape,
    refusal,
    train_flags,
)
from trainscale.published import GPUS, PublishedRun, published_runs
from trainscale.software import DEFAULT_SOFTWARE, GRADIENT_REDUCE_DTYPES, SOFTWARE, Software

__all__ = [  # the command line's names, and those it re-exports from planner.commands
    "DEFAULT_GPU",
    "LAPTOP_MODEL",
    "MODEL_FLAGS",
    "SOFTWARE_FLAGS",
    "Preset",
    "Request",
    "cluster_command",
    "describe",
    "laptop_command",
    "laptop_flags",
    "laptop_shape",
    "layout_table",
    "main",
    "parse",
    "parser",
    "preset_name",
    "presets",
    "refusal",
    "report",
    "train_flags",
]


DEFAULT_GPU = "H100-80GB"
"""The GPU of the book's worked example (:data:`trainscale.planner.EXAMPLE_CLUSTER`),
and of a model given by its sizes unless ``--gpu`` says otherwise."""


@dataclass(frozen=True)
class Preset:
    """A model with the cluster and global batch (sequences) it is planned for by default."""

    title: str
    model: planner.Model
    gpu: str
    nodes: int
    inter_node_bandwidth: float
    global_batch: int
    run: PublishedRun | None = None
    """The published run the preset comes from, if any."""
    software: Software = DEFAULT_SOFTWARE
    """The stack it is planned on by default: a published run's own."""


def preset_name(title: str) -> str:
    """A preset's name on the command line: ``"GPT 1.7B on 32 A100s"`` becomes
    ``"gpt-1.7b-on-32-a100s"``."""
    return re.sub(r"[^a-z0-9.]+", "-", title.lower().replace(",", "")).strip("-")


def presets() -> dict[str, Preset]:
    """Every preset by name: the book's 70B worked example, then each published run."""
    example = planner.EXAMPLE_CLUSTER
    found = {
        "70b": Preset(
            "the book's 70B worked example (chapter 13)",
            planner.EXAMPLE_MODEL,
            DEFAULT_GPU,
            example.nodes,
            example.inter_node_bandwidth,
            planner.EXAMPLE_GLOBAL_BATCH,
        )
    }
    for run in published_runs():
        cluster = planner.published_cluster(run)
        found[preset_name(run.name)] = Preset(
            run.name,
            planner.published_model(run),
            run.gpu,
            cluster.nodes,
            cluster.inter_node_bandwidth,
            run.global_batch,
            run,
            run.software,
        )
    return found


# --------------------------------------------------------------------------- arguments


MODEL_FLAGS = {
    "params": "parameters in total, embeddings included",
    "layers": "transformer layers",
    "hidden": "hidden size (model width)",
    "heads": "attention heads",
    "seq_len": "tokens per sequence",
    "vocab": "vocabulary size",
}
"""The model's sizes as flags (``--seq-len`` for ``seq_len``), each a field of
:class:`trainscale.planner.Model`."""


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m trainscale.planner``."""
    p = argparse.ArgumentParser(
        prog="python -m trainscale.planner",
        description=(
            "Rank the TP x PP x DP layouts of a model on a cluster (chapter 13's planner)"
            " and print the torchrun command that trains the best one."
        ),
    )
    add = p.add_argument
    add("--model", default=None, help="a preset (see --list-models); sizes below override it")
    for field, meaning in MODEL_FLAGS.items():
        add(_flag(field), type=float, default=None, help=meaning)
    add("--gpu", default=None, help=f"one of {', '.join(GPUS)} (default: {DEFAULT_GPU})")
    example = planner.EXAMPLE_CLUSTER
    add(
        "--nodes",
        type=float,
        default=None,
        help=f"machines (default: the preset's, or {example.nodes})",
    )
    add("--gpus-per-node", type=float, default=None, help="GPUs per machine (default: the GPU's)")
    add(
        "--inter-node-bandwidth",
        type=float,
        default=None,
        help=f"bytes/s each GPU sends to other nodes (default: the preset's, or"
        f" {example.inter_node_bandwidth:g})",
    )
    add(
        "--global-batch",
        type=float,
        default=None,
        help=f"sequences per optimiser step (default: the preset's, or"
        f" {planner.EXAMPLE_GLOBAL_BATCH})",
    )
    add(
        "--software",
        choices=tuple(SOFTWARE),
        default=None,
        metavar="NAME",
        help=f"the training stack, one of {', '.join(SOFTWARE)} (default: the preset's,"
        f" or {DEFAULT_SOFTWARE.name}: the planner's assumptions)",
    )
    switch = argparse.BooleanOptionalAction
    add(
        "--fused-attention",
        action=switch,
        default=None,
        help="the stack's attention kernel is fused (FlashAttention-style), or not",
    )
    add("--dropout", action=switch, default=None, help="the layers keep dropout masks, or not")
    add(
        "--gradient-reduce-dtype",
        choices=GRADIENT_REDUCE_DTYPES,
        default=None,
        help="dtype the gradients are accumulated and reduced in (default: the software's)",
    )
    add("--top", type=int, default=5, metavar="K", help="list K layouts (default: 5)")
    add(
        "--laptop",
        type=int,
        default=None,
        metavar="N",
        help="also print the best layout scaled down to a tiny model on N CPU processes",
    )
    add("--list-models", action="store_true", help="list the presets and stop")
    return p


@dataclass(frozen=True)
class Request:
    """What to plan: a model, a cluster of ``gpu``, a global batch in sequences."""

    model: planner.Model
    cluster: planner.Cluster
    gpu: str
    global_batch: int
    top: int
    laptop: int | None
    published: PublishedRun | None = None
    """The published run asked for, unchanged by any flag (its own model, cluster, batch)."""
    software: Software = DEFAULT_SOFTWARE
    """The stack to plan on (a preset of :data:`trainscale.software.SOFTWARE`, maybe changed)."""


SOFTWARE_FLAGS = ("fused_attention", "dropout", "gradient_reduce_dtype")
"""The fields of :class:`trainscale.software.Software` a flag changes (``--no-dropout``)."""


def _software(args: argparse.Namespace, preset: Preset | None) -> Software:
    """The preset's software (or ``--software``'s), with the fields the flags change."""
    base = SOFTWARE[args.software] if args.software else (preset.software if preset else None)
    changes = {f: getattr(args, f) for f in SOFTWARE_FLAGS if getattr(args, f) is not None}
    return (base or DEFAULT_SOFTWARE).replace(**changes)


def _model(args: argparse.Namespace, preset: Preset | None) -> planner.Model:
    """The preset's model with the sizes given as flags, checked under the flags' names."""
    given = {f: getattr(args, f) for f in MODEL_FLAGS if getattr(args, f) is not None}
    if preset is None and len(given) < len(MODEL_FLAGS):
        missing = [_flag(f) for f in MODEL_FLAGS if f not in given]
        raise ValueError(f"without --model, give every size: {', '.join(missing)} missing")
    sizes = {f: _checks.count(_flag(f), value, minimum=1) for f, value in given.items()}
    merged = {f: getattr(preset.model, f) for f in MODEL_FLAGS} if preset else {}
    merged.update(sizes)
    if merged["hidden"] % merged["heads"]:
        raise ValueError(
            f"--hidden must be a multiple of --heads={merged['heads']}, got {merged['hidden']}"
        )
    tied = preset.model.tied_embeddings if preset else False
    embedding = merged["vocab"] * merged["hidden"] * (1 if tied else 2)
    if merged["params"] <= embedding:
        raise ValueError(
            f"--params must exceed the {embedding:,} parameters of the embedding and output"
            f" layers (--vocab x --hidden, twice unless tied), got {merged['params']:,}"
        )
    return dataclasses.replace(preset.model, **sizes) if preset else planner.Model(**sizes)


def _cluster(args: argparse.Namespace, preset: Preset | None) -> tuple[planner.Cluster, str]:
    """The cluster: the preset's (or the worked example's), with the flags given."""
    gpu = args.gpu or (preset.gpu if preset else DEFAULT_GPU)
    _checks.choice("--gpu", gpu, tuple(GPUS))
    bandwidth = args.inter_node_bandwidth
    if bandwidth is None:
        bandwidth = (
            preset.inter_node_bandwidth if preset else planner.EXAMPLE_CLUSTER.inter_node_bandwidth
        )
    settings = planner.node_settings(gpu, _checks.positive("--inter-node-bandwidth", bandwidth))
    if args.gpus_per_node is not None:
        settings["gpus_per_node"] = _checks.count("--gpus-per-node", args.gpus_per_node, minimum=1)
    default = preset.nodes if preset else planner.EXAMPLE_CLUSTER.nodes
    nodes = args.nodes if args.nodes is not None else default
    return planner.Cluster(nodes=_checks.count("--nodes", nodes, minimum=1), **settings), gpu


def parse(argv: Sequence[str] | None = None) -> Request | None:
    """The :class:`Request` the command line asks for (``None`` for ``--list-models``).

    A bad value raises ``ValueError`` naming its flag; an unknown flag ends the
    program as ``argparse`` does (exit status 2)."""
    args = parser().parse_args(argv)
    known = presets()
    if args.list_models:
        return None
    if args.model is not None and args.model not in known:
        raise ValueError(f"--model must be one of --list-models' names, got {args.model!r}")
    preset = known[args.model] if args.model else None
    model = _model(args, preset)
    cluster, gpu = _cluster(args, preset)
    batch = (
        args.global_batch
        if args.global_batch is not None
        else (preset.global_batch if preset else planner.EXAMPLE_GLOBAL_BATCH)
    )
    batch = _checks.count("--global-batch", batch, minimum=1)
    top = _checks.count("--top", args.top, minimum=1)
    laptop = None if args.laptop is None else _checks.count("--laptop", args.laptop, minimum=1)
    stack = _software(args, preset)
    run = preset.run if preset else None
    if run and (model, cluster, batch, stack) != (
        preset.model,
        planner.published_cluster(run),
        run.global_batch,
        run.software,
    ):
        run = None  # a flag changed the run: the published figures no longer apply
    return Request(model, cluster, gpu, batch, top, laptop, run, stack)


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
    return [
        f"model: {m.params / 1e9:,.1f}B parameters, {m.layers} layers, hidden {m.hidden:,},"
        f" {m.heads} heads, {m.seq_len:,} tokens per sequence, vocabulary {m.vocab:,}",
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
        f"  #  {'layout':<22} {'settings':<48} {'MFU (range)':<22} {'step':>9} {'memory/GPU':>11}"
    ]
    for rank, lay in enumerate(layouts, start=1):
        shape = lay.name.replace("\u00d7", "x")
        v = f", V {lay.virtual_stages}" if lay.virtual_stages > 1 else ""
        span = None if ranges is None else ranges[rank - 1]
        lines.append(
            f"{rank:>3}  {shape:<22} {lay.settings + v:<48} {_mfu(lay, span):<22}"
            f" {lay.step_seconds:>7.2f} s {lay.memory_bytes / GIB:>7.1f} GiB"
        )
    return lines


def _runnable(best: Sequence[planner.Layout], request: Request) -> tuple[int | None, list[str]]:
    """The place in ``best`` of the first layout the capstone can run, and a note for
    each faster one it cannot."""
    notes = []
    for place, layout in enumerate(best):
        flags = train_flags(layout, request.model, request.cluster.peak_flops)
        reason = refusal(flags, request.cluster.gpus)
        if reason is None:
            return place, notes
        notes.append(f"trainscale.train cannot run layout {place + 1} as planned: {reason}")
    return None, notes


def _published_lines(run: PublishedRun) -> list[str]:
    """The planner's estimate of the published layout, with its range, next to the
    published MFU (:func:`trainscale.planner.estimate_run`)."""
    try:
        estimate = planner.estimate_run(run)
    except ValueError as error:  # a layout the planner cannot estimate (e.g. CP > 1)
        return [f"the published layout: {error}", ""]
    fits = "fits" if estimate.fits else "does not fit"
    place = (
        f"the planner ranks its shape {estimate.rank} at the run's own settings"
        if estimate.rank
        else "its shape is not among the planner's fitting ones"
    )
    return [
        f"the published layout, TP {run.tp} x PP {run.pp} x DP {run.dp}: estimated MFU"
        f" {estimate.mfu:.1%} (range {estimate.mfu_low:.1%}-{estimate.mfu_high:.1%}),",
        f"  published {planner.reported_mfu(run):.1%} (6N); it {fits} in"
        f" {estimate.memory_bytes / GIB:.1f} GiB per GPU; {place}",
        "",
    ]


def report(request: Request) -> tuple[list[str], bool]:
    """Everything ``main`` prints for ``request``, and whether it found a layout to run."""
    stack = request.software
    layouts = planner.plan(request.model, request.cluster, request.global_batch, software=stack)
    best = planner.top_layouts(layouts, count=request.top)
    counts = planner.verdict_counts(layouts)
    lines = [*describe(request), f"{len(layouts):,} layouts tried, {counts['fits']:,} fit", ""]
    if not best:
        return [*lines, "no layout fits: add GPUs, or shorten the sequences"], False
    ranges = [
        planner.mfu_range(request.model, request.cluster, lay, software=stack) for lay in best
    ]
    lines += [
        f"the fastest shapes (planner estimates, software {stack.name}):",
        *layout_table(best, ranges),
        "",
    ]
    if request.published is not None:
        lines += _published_lines(request.published)
    place, notes = _runnable(best, request)
    lines += [*(f"note: {note}" for note in notes), *([""] if notes else [])]
    if place is None:
        return [*lines, "none of these layouts runs with trainscale.train as it is"], False
    chosen = best[place]
    where = "on each node run" if request.cluster.nodes > 1 else "run"
    lines += [f"to train layout {place + 1}, {chosen.name.replace(chr(215), 'x')}, {where}", ""]
    lines += [cluster_command(chosen, request), "", *_shape_note(request.model)]
    if request.laptop is not None:
        lines += _laptop_lines(chosen, request.laptop)
    return lines, True


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 done, 1 nothing fits, 2 bad input)."""
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
