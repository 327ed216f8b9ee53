"""The command line's arguments: model presets, flags, and the :class:`Request` they make.

:func:`presets` names every model the command line knows (the book's 70B example and each
published run, :data:`trainscale.published.published_runs`); :func:`parser` is the
``argparse`` parser of ``python -m trainscale.planner``; :func:`parse` turns a command line
into a :class:`Request` (the model, the cluster, the global batch and the software stack),
raising ``ValueError`` that names the flag at fault.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass

from trainscale import _checks, planner
from trainscale.planner import inputs
from trainscale.published import GPUS, PublishedRun, published_runs
from trainscale.software import (
    DEFAULT_SOFTWARE,
    GRADIENT_REDUCE_DTYPES,
    LINEAR_DTYPES,
    SOFTWARE,
    Software,
)

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


MODEL_PRESETS = {
    "llama-3-8b": ("Llama 3 8B (arXiv 2407.21783, Table 3)", planner.LLAMA3["8B"], 1),
    "llama-3-70b": ("Llama 3 70B (arXiv 2407.21783, Table 3)", planner.LLAMA3["70B"], 8),
    "llama-3-405b": ("Llama 3 405B (arXiv 2407.21783, Table 3)", planner.LLAMA3["405B"], 128),
    "mixtral-8x7b": ("Mixtral 8x7B (arXiv 2401.04088)", planner.MOE_MODEL, 8),
    "gpt-3-175b": ("GPT-3 175B (arXiv 2005.14165, Table 2.1)", planner.GPT3_175B, 64),
}
"""Model shapes by name: ``(title, model, nodes of 8 H100)``; the nodes (and the global
batch, :data:`trainscale.planner.EXAMPLE_GLOBAL_BATCH` sequences) are an assumption of the
command line, not the source's: change them with ``--nodes`` and ``--global-batch``."""


def presets() -> dict[str, Preset]:
    """Every preset by name: the book's 70B worked example, the model shapes of
    :data:`MODEL_PRESETS` (Llama 3 on Meta's stack), then each published run."""
    example = planner.EXAMPLE_CLUSTER
    found = {
        "70b": Preset(
            "the book's 70B worked example (chapter 16)",
            planner.EXAMPLE_MODEL,
            DEFAULT_GPU,
            example.nodes,
            example.inter_node_bandwidth,
            planner.EXAMPLE_GLOBAL_BATCH,
        )
    }
    for name, (title, model, nodes) in MODEL_PRESETS.items():
        stack = SOFTWARE["meta-llama3"] if name.startswith("llama") else DEFAULT_SOFTWARE
        found[name] = Preset(
            f"{title}, on {nodes} node(s) of 8 H100 (assumed)",
            *(model, DEFAULT_GPU, nodes, example.inter_node_bandwidth),
            planner.EXAMPLE_GLOBAL_BATCH,
            software=stack,
        )
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
    "params": "parameters in total, embeddings included (default: counted from the shape)",
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
            "Rank the TP x PP x DP layouts of a model on a cluster (chapter 16's planner)"
            " and print the torchrun command that trains the best one."
        ),
        epilog=(
            "It prints the fastest shapes with their MFU range, step and memory; how many"
            " layouts each rule rejected; when every shape shown splits the sequence, the"
            " fastest that does not (for a stack without ring attention); for a published"
            " run's preset, the planner's estimate of its layout beside the published MFU;"
            " then the command for the first layout trainscale.train can run, with notes"
            " on what it changes."
        ),
    )
    add = p.add_argument
    add("--model", default=None, help="a preset (see --list-models); sizes below override it")
    for field, meaning in MODEL_FLAGS.items():
        add(_flag(field), type=float, default=None, help=meaning)
    for field, (flag, meaning) in SHAPE_FLAGS.items():
        add(flag, dest=field, type=float, default=None, metavar="N", help=meaning)
    add(
        "--gated-mlp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a gated (SwiGLU) MLP, three matrices instead of two",
    )
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
    add(
        "--linear-dtype",
        choices=LINEAR_DTYPES,
        default=None,
        help="dtype the linear layers multiply in: fp8 on a GPU with FP8 tensor cores"
        " (less validated than bf16; default: the software's)",
    )
    depths = ",".join(map(str, planner.INTERLEAVING))
    add(
        "--virtual-stages",
        default=None,
        metavar="V[,V...]",
        help=f"interleaving depths (model chunks per GPU) to search (default: {depths})",
    )
    add(
        "--context-parallel",
        default=None,
        metavar="C[,C...]",
        help="context-parallel degrees to search (default: 1 and every power of two that"
        f" leaves a GPU at least {planner.CP_MIN_LOCAL_TOKENS:,} tokens of a sequence, with a"
        " fused attention kernel)",
    )
    add(
        "--explain",
        default=None,
        metavar="TP,PP,DP[,CP,EP,V]",
        help="why this layout ranks where it does, or why it is rejected, with the term"
        " that limits it (CP, EP default 1; V: every depth)",
    )
    add(
        "--max-tp",
        type=float,
        default=None,
        metavar="N",
        help="try only layouts with at most N tensor-parallel GPUs (default: any)",
    )
    add(
        "--zero-stages",
        default=None,
        metavar="Z[,Z...]",
        help="the ZeRO stages to try, e.g. 1,3 (default: every stage the software offers)",
    )
    add("--top", type=int, default=5, metavar="K", help="list K layouts (default: 5)")
    add(
        "--laptop",
        type=int,
        default=None,
        metavar="N",
        help="also print the best layout scaled down to a tiny model on N CPU processes",
    )
    add(
        "--check-memory",
        action="store_true",
        help="run the printed command's step on a fake world of its full size under torch's"
        " memory tracker (python -m trainscale.train --estimate-memory; seconds to minutes)"
        " and refuse the command if its fullest GPU does not hold it",
    )
    add("--list-models", action="store_true", help="list the presets and stop")
    add(
        "--json",
        action="store_true",
        help="print the plan (or the presets, with --list-models) as JSON",
    )
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
    virtual_stages: tuple[int, ...] = planner.INTERLEAVING
    """The interleaving depths searched."""
    explain: str | None = None
    """``--explain``'s value, checked by :func:`trainscale.planner.explain.explain_spec`."""
    context_parallel: tuple[int, ...] | None = None
    """The CP degrees searched (``None``: :func:`trainscale.planner.context_parallel_degrees`)."""
    max_tp: int | None = None
    """``--max-tp``: layouts with more tensor-parallel GPUs are not tried (``None``: any)."""
    zero_stages: tuple[int, ...] | None = None
    """``--zero-stages``: the ZeRO stages tried (``None``: every stage the software offers)."""
    check_memory: bool = False
    """``--check-memory``: the printed command's step measured under torch's tracker."""


SOFTWARE_FLAGS = ("fused_attention", "dropout", "gradient_reduce_dtype", "linear_dtype")
"""The fields of :class:`trainscale.software.Software` a flag changes (``--no-dropout``)."""


def _software(args: argparse.Namespace, preset: Preset | None) -> Software:
    """The preset's software (or ``--software``'s), with the fields the flags change."""
    base = SOFTWARE[args.software] if args.software else (preset.software if preset else None)
    changes = {f: getattr(args, f) for f in SOFTWARE_FLAGS if getattr(args, f) is not None}
    return (base or DEFAULT_SOFTWARE).replace(**changes)


SHAPE_FLAGS = {
    "kv_heads": ("--kv-heads", "key/value heads, grouped-query attention (default: --heads)"),
    "ffn_hidden": ("--ffn", "width of the MLP's hidden layer (default: 4 x --hidden)"),
    "experts": ("--experts", "experts per layer, a mixture of experts (default: dense)"),
    "top_k": ("--experts-per-token", "experts each token goes through (default: 1)"),
}
"""The rest of a model's shape, as flags (optional): field of
:class:`trainscale.planner.Model` -> (flag, meaning); ``--gated-mlp`` / ``--no-gated-mlp``
(SwiGLU's three matrices) besides."""

_FLAG_OF = {
    **{f: _flag(f) for f in MODEL_FLAGS},
    **{f: flag for f, (flag, _) in SHAPE_FLAGS.items()},
}


def shape_params(shape: dict) -> int:
    """Parameters of a model of ``shape`` (the :class:`trainscale.planner.Model` fields),
    as :func:`trainscale.planner.inputs.shape_params` counts them (norms and biases left
    out)."""
    optional = ("kv_heads", "ffn_hidden", "gated_mlp", "experts", "tied_embeddings")
    return inputs.shape_params(
        shape["layers"],
        shape["hidden"],
        shape["heads"],
        shape["vocab"],
        **{name: shape[name] for name in optional if shape.get(name) is not None},
    )


def _model(args: argparse.Namespace, preset: Preset | None) -> planner.Model:
    """The preset's model with the sizes given as flags, checked under the flags' names;
    without a preset and without ``--params``, the parameters are :func:`shape_params`."""
    fields = (*MODEL_FLAGS, *SHAPE_FLAGS)
    given = {f: getattr(args, f) for f in fields if getattr(args, f) is not None}
    sizes = {f: _checks.count(_FLAG_OF[f], value, minimum=1) for f, value in given.items()}
    if args.gated_mlp is not None:
        sizes["gated_mlp"] = args.gated_mlp
    required = [f for f in MODEL_FLAGS if f != "params"]
    if preset is None and any(f not in sizes for f in required):
        missing = [_flag(f) for f in required if f not in sizes]
        raise ValueError(f"without --model, give every size: {', '.join(missing)} missing")
    merged = {f: getattr(preset.model, f) for f in (*fields, "gated_mlp")} if preset else {}
    merged.update(sizes)
    if merged["hidden"] % merged["heads"]:
        raise ValueError(
            f"--hidden must be a multiple of --heads={merged['heads']}, got {merged['hidden']}"
        )
    if merged.get("kv_heads") and merged["heads"] % merged["kv_heads"]:
        raise ValueError(
            f"--kv-heads must divide --heads={merged['heads']}, got {merged['kv_heads']}"
        )
    if merged.get("experts") is None and merged.get("top_k", 1) != 1:
        raise ValueError("--experts-per-token needs --experts (a mixture of experts)")
    if preset is None and "params" not in sizes:
        sizes["params"] = merged["params"] = shape_params(merged)
    tied = preset.model.tied_embeddings if preset else False
    embedding = merged["vocab"] * merged["hidden"] * (1 if tied else 2)
    if merged["params"] <= embedding:
        raise ValueError(
            f"--params must exceed the {embedding:,} parameters of the embedding and output"
            f" layers (--vocab x --hidden, twice unless tied), got {merged['params']:,}"
        )
    try:
        return dataclasses.replace(preset.model, **sizes) if preset else planner.Model(**sizes)
    except ValueError as error:  # a rule between fields: say it in the flags' names
        text = str(error)
        for field, flag in sorted(_FLAG_OF.items(), key=lambda pair: -len(pair[0])):
            text = re.sub(rf"\b{field}\b", flag, text)
        raise ValueError(text) from None


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


def _numbers(flag: str, text: str, what: str) -> list[float]:
    """A flag's comma-separated numbers; ``ValueError`` naming ``flag`` and ``what`` they
    must be otherwise."""
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} must be {what} separated by commas, got {text!r}") from None


def _degrees(flag: str, text: str | None) -> tuple[int, ...] | None:
    """A flag's comma-separated whole numbers >= 1, each once (``None`` when not given)."""
    if text is None:
        return None
    values = _numbers(flag, text, "whole numbers >= 1")
    return tuple(dict.fromkeys(_checks.count(flag, v, minimum=1) for v in values))


def _depths(text: str | None) -> tuple[int, ...]:
    """``--virtual-stages``: comma-separated whole numbers >= 1 (``None``: every depth of
    :data:`trainscale.planner.INTERLEAVING`)."""
    return _degrees("--virtual-stages", text) or planner.INTERLEAVING


def _zero_stages(text: str | None) -> tuple[int, ...] | None:
    """``--zero-stages``: ZeRO stages 0-3 separated by commas (``None``: the software's)."""
    if text is None:
        return None
    values = _numbers("--zero-stages", text, "ZeRO stages 0-3")
    return tuple(
        dict.fromkeys(int(_checks.choice("--zero-stages", v, (0, 1, 2, 3))) for v in values)
    )


SPEC_FIELDS = ("TP", "PP", "DP", "CP", "EP", "V")
"""The degrees ``--explain`` takes, in order (CP, EP and V optional: 1, 1, every depth)."""


def explain_spec(text: str, gpus: int) -> tuple[int, ...]:
    """``--explain``'s value: 3 to 6 whole numbers >= 1, comma-separated, whose
    ``TP x CP x PP x DP`` is the cluster's ``gpus``; missing CP and EP are 1, a missing V 0
    (every depth searched)."""
    parts = text.split(",")
    if not 3 <= len(parts) <= 6:
        raise ValueError(f"--explain must be TP,PP,DP[,CP,EP,V], got {text!r}")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise ValueError(
            f"--explain must be whole numbers TP,PP,DP[,CP,EP,V], got {text!r}"
        ) from None
    degrees = [
        _checks.count(f"--explain's {name}", value, minimum=1)
        for name, value in zip(SPEC_FIELDS, values, strict=False)
    ]
    tp, pp, dp, cp, ep, v = [*degrees, *(1, 1, 0)[len(degrees) - 3 :]]
    if tp * cp * pp * dp != gpus:
        raise ValueError(
            f"--explain: TP x CP x PP x DP must be the cluster's {gpus:,} GPUs,"
            f" got {tp} x {cp} x {pp} x {dp} = {tp * cp * pp * dp:,}"
        )
    return tp, pp, dp, cp, ep, v


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
    depths = _depths(args.virtual_stages)
    max_tp = None if args.max_tp is None else _checks.count("--max-tp", args.max_tp, minimum=1)
    zero_stages = _zero_stages(args.zero_stages)
    if args.explain is not None:
        explain_spec(args.explain, cluster.gpus)  # refused here, naming --explain
    run = preset.run if preset else None
    if run and (model, cluster, batch, stack) != (
        preset.model,
        planner.published_cluster(run),
        run.global_batch,
        run.software,
    ):
        run = None  # a flag changed the run: the published figures no longer apply
    cps = _degrees("--context-parallel", args.context_parallel)
    return Request(
        *(model, cluster, gpu, batch, top, laptop, run, stack, depths, args.explain, cps),
        *(max_tp, zero_stages, bool(args.check_memory)),
    )
