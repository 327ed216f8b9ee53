"""The capstone's command line (:mod:`trainscale.train`) for a layout of the planner.

:func:`train_flags` gives a layout's flags on its cluster; :func:`laptop_shape`,
:func:`laptop_flags` and :func:`laptop_command` scale it down to a tiny model on a few
CPU processes; :func:`refusal` says whether the capstone takes the flags, and
:func:`_shape_note` where its decoder differs from the planned model.

How a planner layout becomes the capstone's flags (:func:`train_flags`): ZeRO-0
is plain replication (``--dp-replicate``); ZeRO-1, 2 and 3 become FSDP2's
sharding (``--dp-shard``) with ``--zero N``: under ZeRO-1 and 2 FSDP2 keeps the
gathered weights from forward to backward, as the planner assumes (FSDP2 has no
ZeRO-1, so ``--zero 1`` shards gradients too: less memory than planned);
recomputation becomes ``--recompute selective`` (torch's selective activation
checkpointing) or ``--recompute full``; an interleaving depth above 1 becomes
``--pp-schedule interleaved --virtual-stages V``; a model's key-value heads, MLP
width and gated MLP become ``--kv-heads``, ``--ffn`` and Llama's switches.

Where the printed commands listen: on a cluster, ``torchrun`` on each node meets the
others through the c10d rendezvous on ``$HEAD_NODE:29500``, which the head node's
agent hosts on every network interface (a cluster needs the network; its firewall
keeps the ports in); the ranks' store and their NCCL connections open further ports
there. On a laptop the command is ``python -m trainscale.launch`` instead
(:mod:`trainscale.launch`), which runs the same ``torchrun`` agent with every
listening socket on 127.0.0.1: plain ``torchrun`` would open its stores on every
interface even when told 127.0.0.1.
"""

from __future__ import annotations

import math
import shlex

from trainscale import _checks, planner

RUNNER_SOFTWARE = "torchtitan-2024"
"""The planner's software preset that describes :mod:`trainscale.train`: it is built as
torchtitan is (FSDP2 with float32 gradient reduction, DTensor's sequence parallelism
keeping the gathered input, ``scaled_dot_product_attention``, no dropout) and, like
torchtitan without ``torch.compile``, runs its norms, rotary embeddings, SiLU and loss as
eager ops (:mod:`trainscale.software`). A layout planned for another stack is checked on
this one before its command is printed (``python -m trainscale.train --estimate-memory``
measures the same with torch's memory tracker)."""


def on_the_runner(layout: planner.Layout, model: planner.Model, cluster: planner.Cluster):
    """``layout`` evaluated again on :data:`RUNNER_SOFTWARE`, its settings unchanged."""
    return planner.evaluate(
        *(model, cluster, layout.global_batch, layout.tp, layout.pp, layout.dp),
        zero_stage=layout.zero_stage,
        recompute=layout.recompute,
        micro_batch=layout.micro_batch,
        virtual_stages=layout.virtual_stages,
        context_parallel=layout.cp,
        expert_parallel=layout.ep,
        software=RUNNER_SOFTWARE,
    )


def _data_parallel_flags(zero_stage: int, dp: int) -> list[str]:
    """ZeRO-0 replicates (DDP); any ZeRO stage shards with FSDP2 at that stage."""
    if zero_stage == 0:
        return ["--dp-replicate", str(dp)]
    return ["--dp-shard", str(dp), "--zero", str(zero_stage)]


def _recompute_flags(recompute: str) -> list[str]:
    return [] if recompute == "none" else ["--recompute", recompute]


def _shape_flags(model: planner.Model) -> list[str]:
    """A model's key-value heads and MLP, when not GPT-2's: a gated MLP is Llama's
    (SwiGLU, RMSNorm, rotary embeddings, no biases)."""
    flags = []
    if model.kv_heads not in (None, model.heads):
        flags += ["--kv-heads", str(model.kv_heads)]
    if model.ffn_hidden not in (None, 4 * model.hidden):
        flags += ["--ffn", str(model.ffn_hidden)]
    if model.gated_mlp:
        flags += ["--mlp", "swiglu", "--norm", "rmsnorm", "--position", "rope", "--no-bias"]
    return flags


VOCAB_MULTIPLE = 128
"""Megatron-LM pads the vocabulary to a multiple of this times TP
(``--make-vocab-size-divisible-by``, default 128; ``_vocab_size_with_padding`` in its
tokenizer module), so that each TP rank holds an equal, GPU-friendly slice."""


def command_vocab(model: planner.Model, tp: int) -> int:
    """The vocabulary the command trains: the model's, or, where TP does not divide it (the
    capstone splits the embedding by vocabulary), padded up as Megatron-LM pads it."""
    if model.vocab % tp == 0:
        return model.vocab
    step = VOCAB_MULTIPLE * tp
    return -(-model.vocab // step) * step


def _ties(model: planner.Model, layout: planner.Layout) -> bool:
    """Whether the command ties the head to the embedding: where the model does and the
    capstone can, without TP or PP (its --tied refuses both)."""
    return model.tied_embeddings and layout.tp == 1 and layout.pp == 1


def _schedule_flags(pp: int, virtual_stages: int) -> list[str]:
    if pp == 1:
        return []
    if virtual_stages > 1:
        return ["--pp-schedule", "interleaved", "--virtual-stages", str(virtual_stages)]
    return ["--pp-schedule", "1f1b"]


def train_flags(layout: planner.Layout, model: planner.Model, peak_flops: float) -> list[str]:
    """``python -m trainscale.train``'s flags for ``layout`` of ``model`` on GPUs of
    ``peak_flops`` (FLOP/s, for the MFU in the training log), in bf16."""
    if layout.accumulation is None:
        raise ValueError(f"layout must be a valid one, got verdict {layout.verdict!r}")
    flags = [
        *("--tp", str(layout.tp), "--pp", str(layout.pp)),
        *_data_parallel_flags(layout.zero_stage, layout.dp),
        *(["--cp", str(layout.cp)] if layout.cp > 1 else []),  # ring attention, chapter 10
        *_schedule_flags(layout.pp, layout.virtual_stages),
        *("--micro-batch", str(layout.micro_batch), "--grad-accum", str(layout.accumulation)),
        *_recompute_flags(layout.recompute),
        "--bf16",
        *("--layers", str(model.layers), "--width", str(model.hidden)),
        *("--heads", str(model.heads), "--seq-len", str(model.seq_len)),
        *_shape_flags(model),
        *(["--tied"] if _ties(model, layout) else []),
        *("--vocab", str(command_vocab(model, layout.tp)), "--peak-flops", f"{peak_flops:g}"),
    ]
    return flags


def laptop_shape(layout: planner.Layout, ranks: int) -> tuple[int, int, int]:
    """``(TP, PP, DP)`` on ``ranks`` CPU processes, keeping the layout's kinds of
    parallelism (:func:`laptop_degrees`, which also gives CP)."""
    degrees = laptop_degrees(layout, ranks)
    return degrees["tp"], degrees["pp"], degrees["dp"]


def laptop_degrees(layout: planner.Layout, ranks: int) -> dict[str, int]:
    """TP, CP, PP and DP on ``ranks`` CPU processes, keeping the layout's kinds of
    parallelism.

    The prime factors of ``ranks``, largest first, go first to each of the
    layout's dimensions above 1 (TP, then CP, then PP, then DP), as long as it does
    not grow beyond the layout's own size, then to the dimension furthest below its
    size; what is left goes to DP. ``TP 8 x PP 4 x DP 2`` on 8 ranks becomes
    ``TP 2 x PP 2 x DP 2``; on 4 ranks, ``TP 2 x PP 2 x DP 1``; ``TP 4 x CP 2 x PP 8``
    on 8 ranks, ``TP 2 x CP 2 x PP 2``. A kind the ranks have no factor left for is
    dropped (:func:`laptop_drops`).
    """
    n = _checks.count("ranks", ranks, minimum=1)
    names = ("tp", "cp", "pp", "dp")
    target = [getattr(layout, name, 1) for name in names]
    shape = [1, 1, 1, 1]
    for factor in _prime_factors(n):
        room = [i for i in range(4) if shape[i] * factor <= target[i]]
        fresh = [i for i in room if shape[i] == 1]
        if fresh:
            pick = fresh[0]
        elif room:
            pick = max(room, key=lambda i: target[i] / shape[i])
        else:
            pick = 3
        shape[pick] *= factor
    return dict(zip(names, shape, strict=True))


def laptop_drops(layout: planner.Layout, ranks: int) -> list[str]:
    """The kinds of parallelism ``layout`` uses that :func:`laptop_degrees` has no
    process left for on ``ranks`` (``"CP"``...), and expert parallelism, which the
    capstone's dense decoder does not have."""
    degrees = laptop_degrees(layout, ranks)
    dropped = [
        name.upper()
        for name in ("tp", "cp", "pp", "dp")
        if getattr(layout, name, 1) > 1 and degrees[name] == 1
    ]
    return dropped + (["EP"] if getattr(layout, "ep", 1) > 1 else [])


def _prime_factors(n: int) -> list[int]:
    """Prime factors of ``n``, with repeats, largest first."""
    factors, rest, p = [], n, 2
    while p * p <= rest:
        while rest % p == 0:
            factors.append(p)
            rest //= p
        p += 1
    if rest > 1:
        factors.append(rest)
    return sorted(factors, reverse=True)


LAPTOP_MODEL = {"head_dim": 16, "seq_len": 32, "vocab": 64, "micro_batch": 2, "steps": 10}
"""The tiny model of ``--laptop``: 16 numbers per head (at least 4 heads, a multiple
of TP), sequences of (at least) 32 tokens, a multiple of TP, from 64 token ids,
2 sequences per micro-batch, 10 optimiser steps. One layer per pipeline stage and
chunk (at least 2), and twice as many micro-batches per step as stages."""


def laptop_flags(layout: planner.Layout, ranks: int, peak_flops: float | None = None) -> list[str]:
    """``python -m trainscale.train``'s flags for ``layout`` scaled down to ``ranks`` CPU
    processes (:func:`laptop_shape`): a tiny model of the same kind, fp32, few steps;
    with ``peak_flops`` (one process's peak FLOP/s, e.g. measured as in chapter 15) the
    training log reports MFU."""
    degrees = laptop_degrees(layout, ranks)
    tp, cp, pp, dp = (degrees[name] for name in ("tp", "cp", "pp", "dp"))
    virtual = layout.virtual_stages if pp > 1 else 1
    heads = tp * math.ceil(4 / tp)
    # sequences split into 2 CP chunks per rank (zig-zag) and over TP (sequence parallel)
    step = math.lcm(tp, 2 * cp) if cp > 1 else tp
    layers = max(2, pp * virtual)
    tiny = LAPTOP_MODEL
    if peak_flops is None:
        mfu = []
    else:
        mfu = ["--peak-flops", f"{_checks.positive('peak_flops', peak_flops):g}"]
    return [
        *("--tp", str(tp), "--pp", str(pp)),
        *_data_parallel_flags(layout.zero_stage, dp),
        *(["--cp", str(cp)] if cp > 1 else []),
        *_schedule_flags(pp, virtual),
        *("--micro-batch", str(tiny["micro_batch"]), "--grad-accum", str(2 * pp)),
        *_recompute_flags(layout.recompute),
        *("--layers", str(layers), "--width", str(tiny["head_dim"] * heads)),
        *("--heads", str(heads), "--seq-len", str(step * math.ceil(tiny["seq_len"] / step))),
        *("--vocab", str(tiny["vocab"])),
        *("--steps", str(tiny["steps"]), "--warmup", "2", "--log-every", "1"),
        *mfu,
    ]


LAPTOP_LAUNCHER = ("python", "-m", "trainscale.launch")
"""What starts the ``--laptop`` command: the package's own launcher, which keeps every
listening socket of the job on 127.0.0.1 (:mod:`trainscale.launch`)."""


def laptop_command(layout: planner.Layout, ranks: int) -> str:
    """The command that runs :func:`laptop_flags` on ``ranks`` processes of this machine:
    ``torchrun``'s job, started by :data:`LAPTOP_LAUNCHER` so that nothing of it listens
    beyond 127.0.0.1."""
    n = _checks.count("ranks", ranks, minimum=1)
    return _lines([*LAPTOP_LAUNCHER, f"--nproc-per-node={n}"], laptop_flags(layout, n))


def _lines(launcher: list[str], flags: list[str]) -> str:
    """``launcher -m trainscale.train flags``, broken into lines of shell continuation,
    each flag next to its value."""
    words = [a if "$" in a else shlex.quote(a) for a in launcher]
    words.append("-m trainscale.train")
    for arg in flags:
        if arg.startswith("--"):
            words.append(arg)
        else:
            words[-1] += " " + shlex.quote(arg)
    lines, line = [], ""
    for word in words:
        if line and len(line) + len(word) > 76:
            lines.append(line)
            line = ""
        line = f"{line} {word}".strip()
    lines.append(line)
    return " \\\n    ".join(lines)


def refusal(flags: list[str], ranks: int) -> str | None:
    """Why :mod:`trainscale.train` would refuse ``flags`` on ``ranks`` processes (its own
    checks: layers per stage, heads per TP rank, micro-batches in the pipeline...),
    or ``None`` if it takes them."""
    from trainscale import train  # imports torch: only when a command is to be printed

    try:
        train.parse_args(flags).layout(ranks)
    except ValueError as error:
        return str(error)
    return None


def _shape_note(model: planner.Model, layout: planner.Layout | None = None) -> list[str]:
    """Notes where the command's decoder differs from the planned model (grouped-query
    attention, the MLP's width and a gated MLP it takes): experts it does not build; for
    ``layout``, a head it cannot tie to the embedding and a vocabulary it pads."""
    notes = []
    if model.experts:
        notes.append(
            f"note: trainscale.train builds a dense decoder, not this model's {model.experts}"
            " experts (chapter 11; the capstone has none)"
        )
    if layout is not None and model.tied_embeddings and not _ties(model, layout):
        extra = model.vocab * model.hidden / model.params
        notes.append(
            "note: trainscale.train ties the head to the embedding only without TP and PP;"
            f" this command trains them untied ({extra:.1%} more parameters)"
        )
    if layout is not None and command_vocab(model, layout.tp) != model.vocab:
        notes.append(
            f"note: the vocabulary of {model.vocab:,} is padded to"
            f" {command_vocab(model, layout.tp):,}, a multiple of {VOCAB_MULTIPLE} x TP,"
            " as Megatron-LM pads it"
        )
    return [*notes, ""] if notes else []


def _laptop_lines(layout: planner.Layout, ranks: int) -> list[str]:
    degrees = laptop_degrees(layout, ranks)
    cp = f" x CP {degrees['cp']}" if degrees["cp"] > 1 else ""
    shape = f"TP {degrees['tp']}{cp} x PP {degrees['pp']} x DP {degrees['dp']}"
    dropped = laptop_drops(layout, ranks)
    if dropped:
        kinds = f"the plan's kinds of parallelism but {', '.join(dropped)}"
    else:
        kinds = "the same kinds of parallelism"
    return [
        f"{kinds} on this computer: {shape}, a tiny model on {ranks} CPU processes",
        "(python -m trainscale.launch keeps every listener on 127.0.0.1, where plain"
        " torchrun would listen on every interface)",
        "",
        laptop_command(layout, ranks),
        "",
    ]
