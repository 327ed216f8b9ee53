"""The capstone's command line: one declaration per flag, in :class:`TrainConfig`.

Each field of :class:`TrainConfig` is one flag of ``python -m trainscale.train``
(``micro_batch`` is ``--micro-batch``): its default is the flag's default and its
metadata carry the flag's help. :func:`parser` builds the argument parser from the
fields, so the two cannot disagree. :class:`Layout` is what the layout's flags
become on a number of ranks, over a mesh of :data:`DIMS`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, NoReturn

from trainscale import _checks
from trainscale.train.shapes import (
    DIMS,
    GPT_SHAPE,
    MODEL_PRESETS,
    PP_SCHEDULES,
    RECOMPUTE,
    Layout,
    layer_counts,
)
from trainscale.transformer import MLPS, NORMS, POSITIONS, GPTConfig

PROG = "python -m trainscale.train"

WARMUP_CAP = 10
"""``--warmup``'s default never exceeds this many steps (:func:`default_warmup`)."""


def default_warmup(steps: int) -> int:
    """``--warmup``'s default for a run of ``steps`` optimiser steps: a tenth of the run,
    at most :data:`WARMUP_CAP` steps, ``min(10, steps // 10)``. The default run of 100
    steps warms up for 10, one of 20 for 2, one of fewer than 10 steps (a first try,
    ``--steps 4``) not at all; it is always below ``steps``, as the schedule requires."""
    n = _checks.count("steps", steps, minimum=1)
    return min(WARMUP_CAP, n // 10)


def default_grad_accum(pp: int | None) -> int:
    """``--grad-accum``'s default: 1 micro-batch per step without a pipeline; with
    ``--pp P`` > 1, ``P``, the fewest either schedule takes (1F1B needs at least one
    micro-batch per stage, the interleaved schedule a multiple of the stages). More
    micro-batches shrink the pipeline's bubble (chapter 9) at the price of a larger
    global batch."""
    stages = 1 if pp is None else _checks.count("pp", pp, minimum=1)
    return stages


def flag(default: Any, help: str) -> Any:
    """A field of :class:`TrainConfig` that is also a flag: ``default``, and ``help`` for
    ``--help`` (kept in the field's metadata, where :func:`parser` reads it)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TrainConfig:
    """Everything one run needs, checked: built from the command line by :func:`parse_args`.

    Every field is a flag (:func:`parser`). The layout's sizes that were not given
    are ``None`` here; :meth:`layout` completes them for a number of ranks.
    ``warmup`` and ``grad_accum`` left ``None`` take defaults that follow the other
    flags (:func:`default_warmup`, :func:`default_grad_accum`), so every field holds a
    number once the config is built. ``micro_batch`` is in sequences per
    data-parallel rank and micro-step, ``lr`` in units of the AdamW update,
    ``peak_flops`` in FLOP/s per device, ``ckpt_every`` and ``log_every`` in
    optimiser steps.
    """

    parallel: str | None = flag(
        None, "shorthand: ddp (--dp-replicate WORLD), fsdp (--dp-shard WORLD)"
    )
    tp: int | None = flag(None, "tensor-parallel ranks (with sequence parallelism)")
    pp: int | None = flag(None, "pipeline stages (ranks)")
    dp_replicate: int | None = flag(None, "replicated data-parallel groups (HSDP)")
    dp_shard: int | None = flag(None, "ranks the model state is sharded over (FSDP)")
    cp: int | None = flag(None, "context-parallel ranks (ring attention)")
    pp_schedule: str = flag("1f1b", "1f1b or interleaved")
    virtual_stages: int = flag(1, "model chunks per pipeline rank")
    steps: int = flag(100, "optimiser steps in the whole run")
    micro_batch: int = flag(8, "sequences per rank per forward pass")
    grad_accum: int | None = flag(
        None,
        "micro-batches per step (pipelined: per stage); default: from --global-batch, or 1,"
        " or --pp if --pp > 1",
    )
    global_batch: int | None = flag(
        None,
        "sequences per optimiser step in the whole job, whatever the layout: --grad-accum"
        " becomes it / (data-parallel ranks x --micro-batch)",
    )
    lr: float = flag(3e-3, "peak learning rate")
    warmup: int | None = flag(
        None, "steps of linear warmup before cosine decay; default: min(10, --steps // 10)"
    )
    lr_floor: float = flag(0.1, "final learning rate, as a share of --lr")
    weight_decay: float = flag(0.1, "AdamW's decoupled weight decay")
    clip: float = flag(1.0, "clip the global gradient norm (0: never)")
    bf16: bool = flag(
        False,
        "bfloat16: FSDP2's mixed precision on GPUs (bf16 weights, fp32 gradient reduction),"
        " autocast on the CPU",
    )
    zero: int = flag(
        3, "ZeRO stage of --dp-shard: 3 frees gathered weights after forward, 1 or 2 keep them"
    )
    recompute: str | None = flag(
        None, f"what blocks recompute in backward, one of {', '.join(RECOMPUTE)} (default none)"
    )
    checkpoint_activations: bool = flag(
        False, "recompute each block in backward (--recompute full)"
    )
    local_accumulation: bool = flag(
        False,
        "accumulate gradients unsharded and reduce once per step (FSDP2's"
        " set_requires_gradient_sync(False)): fewer collectives, a whole fp32 gradient held",
    )
    seed: int = flag(0, "seeds the weights and the data")
    model: str | None = flag(
        None, f"a model's shape, one of {', '.join(MODEL_PRESETS)}; shape flags override it"
    )
    vocab: int | None = flag(None, "vocabulary size (default 64)")
    seq_len: int | None = flag(None, "tokens per sequence (default 32)")
    width: int | None = flag(None, "model width (default 64)")
    heads: int | None = flag(None, "attention heads per block (default 4)")
    layers: int | None = flag(None, "transformer blocks (default 2)")
    kv_heads: int | None = flag(None, "key-value heads per block (default: --heads)")
    ffn: int | None = flag(None, "the MLP's hidden width (default: 4 x --width)")
    mlp: str | None = flag(None, f"the MLP, one of {', '.join(MLPS)} (default gelu)")
    norm: str | None = flag(None, f"the norms, one of {', '.join(NORMS)} (default layernorm)")
    position: str | None = flag(None, f"positions, one of {', '.join(POSITIONS)} (default learned)")
    rope_theta: float | None = flag(None, "rotary embeddings' base (default 10000)")
    bias: bool | None = flag(None, "biases in the linear layers (default: yes)")
    tied: bool | None = flag(None, "the head reuses the token embedding (default: no)")
    strides: int = flag(4, "the data's sequences step by 1..strides")
    log_every: int = flag(10, "print a log line every this many steps")
    peak_flops: float | None = flag(None, "one device's peak FLOP/s, for MFU")
    ckpt_dir: str | None = flag(None, "folder for checkpoints (none: no checkpoints)")
    ckpt_every: int = flag(10, "save a checkpoint every this many steps")
    keep_checkpoints: int = flag(2, "complete checkpoints kept on disk")
    final_weights: str | None = flag(None, "rank 0 saves the full final weights here")
    fail_at_step: int | None = flag(None, "crash during this step, first try only")
    fail_rank: int = flag(0, "the rank that --fail-at-step crashes")
    deterministic: bool = flag(False, "deterministic kernels (for GPUs)")
    estimate_memory: bool = flag(
        False,
        "train nothing: one step of the fullest stage's rank on a fake world of the layout's"
        " size, torch's memory tracker beside the planner's estimate",
    )
    estimate_all_layers: bool = flag(
        False,
        "with --estimate-memory: run every block of the stage, not one or two per chunk"
        " scaled up (slower)",
    )
    drop_gradient: str | None = flag(
        None,
        "a planted bug, for the parity check: the first data-parallel rank zeroes its shard"
        " of parameter NAME's gradient after each step's first micro-batch (no pipeline)",
    )

    def __post_init__(self) -> None:
        self._fill_defaults()
        self._check_training()
        self._check_model()
        self._check_layout()

    def _fill_defaults(self) -> None:
        """Give ``warmup`` and ``grad_accum`` their defaults where they were not given,
        and the shape flags theirs (:data:`GPT_SHAPE`, or ``--model``'s preset); a
        ``--steps`` or ``--pp`` out of range is left for the checks to name."""
        shape = dict(GPT_SHAPE)
        if self.model is not None:
            _checks.choice("--model", self.model, tuple(MODEL_PRESETS))
            shape.update(MODEL_PRESETS[self.model])
        for name, value in shape.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.ffn is None and isinstance(self.width, int):
            object.__setattr__(self, "ffn", 4 * self.width)
        if self.warmup is None:
            with contextlib.suppress(ValueError):
                object.__setattr__(self, "warmup", default_warmup(self.steps))
        if self.recompute is None:
            mode = "full" if self.checkpoint_activations else "none"
            object.__setattr__(self, "recompute", mode)
        if self.grad_accum is None and self.global_batch is None:
            pipelined = isinstance(self.pp, int) and self.pp > 1
            object.__setattr__(
                self, "grad_accum", default_grad_accum(self.pp if pipelined else None)
            )

    def _check_training(self) -> None:
        _checks.count("--steps", self.steps, minimum=1)
        _checks.count("--micro-batch", self.micro_batch, minimum=1)
        if self.grad_accum is not None:
            _checks.count("--grad-accum", self.grad_accum, minimum=1)
        if self.global_batch is not None:
            _checks.count("--global-batch", self.global_batch, minimum=1)
        _checks.choice("--zero", self.zero, (1, 2, 3))
        _checks.choice("--recompute", self.recompute, RECOMPUTE)
        if self.checkpoint_activations and self.recompute != "full":
            raise ValueError(
                f"--checkpoint-activations must not be combined with --recompute "
                f"{self.recompute}: it means --recompute full"
            )
        _checks.positive("--lr", self.lr)
        if _checks.count("--warmup", self.warmup) >= self.steps:
            raise ValueError(
                f"--warmup must be in [0, --steps) = [0, {self.steps}), got {self.warmup}"
            )
        _checks.fraction("--lr-floor", self.lr_floor)
        _checks.non_negative("--weight-decay", self.weight_decay)
        _checks.non_negative("--clip", self.clip)  # 0: no clipping
        _checks.count("--seed", self.seed)
        _checks.count("--log-every", self.log_every, minimum=1)
        if self.peak_flops is not None:
            _checks.positive("--peak-flops", self.peak_flops)
        _checks.count("--ckpt-every", self.ckpt_every, minimum=1)
        _checks.count("--keep-checkpoints", self.keep_checkpoints, minimum=1)
        if self.fail_at_step is not None:
            _checks.count("--fail-at-step", self.fail_at_step, minimum=1)
        _checks.count("--fail-rank", self.fail_rank)

    def _check_model(self) -> None:
        _checks.count("--vocab", self.vocab, minimum=2)
        _checks.count("--seq-len", self.seq_len, minimum=1)
        _checks.count("--heads", self.heads, minimum=1)
        _checks.count("--layers", self.layers, minimum=1)
        if _checks.count("--width", self.width, minimum=1) % self.heads:
            raise ValueError(
                f"--width must be a multiple of --heads={self.heads}, got {self.width}"
            )
        if self.heads % _checks.count("--kv-heads", self.kv_heads, minimum=1):
            raise ValueError(f"--kv-heads must divide --heads={self.heads}, got {self.kv_heads}")
        _checks.count("--ffn", self.ffn, minimum=1)
        _checks.choice("--mlp", self.mlp, MLPS)
        _checks.choice("--norm", self.norm, NORMS)
        _checks.choice("--position", self.position, POSITIONS)
        _checks.positive("--rope-theta", self.rope_theta)
        if self.position == "rope" and (self.width // self.heads) % 2:
            raise ValueError(
                "--width / --heads must be even with --position rope, got "
                f"{self.width // self.heads}"
            )
        if not 1 <= self.strides < self.vocab:
            raise ValueError(
                f"--strides must be in [1, --vocab) = [1, {self.vocab}), got {self.strides}"
            )

    def _check_layout(self) -> None:
        given = [name for name in DIMS if getattr(self, name) is not None]
        if self.parallel is not None:
            _checks.choice("--parallel", self.parallel, ("ddp", "fsdp"))
            if given:
                flag = "--" + given[0].replace("_", "-")
                raise ValueError(
                    f"--parallel must not be combined with {flag}: it is shorthand for "
                    "--dp-replicate WORLD (ddp) or --dp-shard WORLD (fsdp)"
                )
        for name in given:
            _checks.count("--" + name.replace("_", "-"), getattr(self, name), minimum=1)
        _checks.choice("--pp-schedule", self.pp_schedule, PP_SCHEDULES)
        v = _checks.count("--virtual-stages", self.virtual_stages, minimum=1)
        if self.pp_schedule == "1f1b" and v != 1:
            raise ValueError(f"--virtual-stages must be 1 with --pp-schedule 1f1b, got {v}")
        if self.pp_schedule == "interleaved" and v < 2:
            raise ValueError(
                f"--virtual-stages must be >= 2 with --pp-schedule interleaved, got {v}"
            )
        tp, pp, cp = (getattr(self, name) or 1 for name in ("tp", "pp", "cp"))
        layer_counts(pp * v, self.layers)  # even, or one block short at either end
        if self.heads % tp:
            raise ValueError(f"--heads must be a multiple of --tp={tp}, got {self.heads}")
        if self.vocab % tp:
            raise ValueError(
                f"--vocab must be a multiple of --tp={tp} (the embedding and head are split "
                f"by vocabulary), got {self.vocab}"
            )
        if self.kv_heads % tp:
            raise ValueError(
                f"--kv-heads must be a multiple of --tp={tp} (each rank holds whole groups of "
                f"heads), got {self.kv_heads}"
            )
        if self.tied and (tp > 1 or pp > 1):
            raise ValueError(
                "--tied must not be combined with --tp or --pp > 1: the embedding and the "
                "head it would share sit on different stages, or split differently"
            )
        if self.seq_len % (cp * tp):
            raise ValueError(
                f"--seq-len must be a multiple of --cp x --tp = {cp * tp} (context and "
                f"sequence parallelism split it), got {self.seq_len}"
            )
        if v > 1 and pp < 2:
            raise ValueError(f"--pp must be >= 2 with --pp-schedule interleaved, got {pp}")
        if self.grad_accum is not None:
            self._check_pipeline(self.grad_accum, "--grad-accum")
        if self.drop_gradient is not None and pp > 1:
            raise ValueError(f"--drop-gradient must not be combined with --pp {pp}")

    def _check_pipeline(self, micro_batches: int, flag: str) -> None:
        """Whether the pipeline schedule takes ``micro_batches`` per step (``flag`` names
        where the number came from)."""
        pp, v = self.pp or 1, self.virtual_stages
        if pp > 1 and v == 1 and micro_batches < pp:
            raise ValueError(
                f"{flag} must be >= --pp={pp} for 1F1B (it is the number of "
                f"micro-batches in the pipeline), got {micro_batches}"
            )
        if v > 1 and micro_batches % pp:
            raise ValueError(
                f"{flag} must be a multiple of --pp={pp} for the interleaved "
                f"schedule (it is the number of micro-batches in the pipeline), "
                f"got {micro_batches}"
            )

    def layout(self, world_size: int) -> Layout:
        """The layout on ``world_size`` ranks; raises ``ValueError`` if the sizes'
        product is not ``world_size``. Sizes not given are 1, except that with no
        size given at all (or ``--parallel``) the ranks do data parallelism."""
        world = _checks.count("world_size", world_size, minimum=1)
        sizes = {name: getattr(self, name) for name in DIMS}
        parallel = self.parallel
        if parallel is None and all(size is None for size in sizes.values()):
            parallel = "ddp"
        if parallel is not None:
            sizes["dp_replicate" if parallel == "ddp" else "dp_shard"] = world
        layout = Layout(**{name: size or 1 for name, size in sizes.items()})
        if layout.world != world:
            flags = " x ".join(
                f"--{n.replace('_', '-')} {s}" for n, s in zip(DIMS, layout.sizes, strict=True)
            )
            raise ValueError(
                f"the layout's sizes must multiply to the number of ranks, {world}: "
                f"got {flags} = {layout.world}"
            )
        if self.global_batch is not None:
            self._micro_batches(layout)
        return layout

    def _micro_batches(self, layout: Layout) -> int:
        """Micro-batches per step on ``layout`` for ``--global-batch``, checked."""
        per_step = layout.dp * self.micro_batch  # sequences per micro-step, whole job
        if self.global_batch % per_step:
            raise ValueError(
                f"--global-batch must be a multiple of the data-parallel ranks x --micro-batch"
                f" = {layout.dp} x {self.micro_batch} = {per_step}, got {self.global_batch}"
            )
        k = self.global_batch // per_step
        if self.grad_accum is not None and self.grad_accum != k:
            raise ValueError(
                f"--grad-accum must be --global-batch / ({layout.dp} x --micro-batch) = {k}"
                f" when both are given, got {self.grad_accum}"
            )
        self._check_pipeline(k, f"--global-batch / ({layout.dp} x --micro-batch)")
        return k

    def for_world(self, world_size: int) -> TrainConfig:
        """This config on ``world_size`` ranks: its layout checked (:meth:`layout`) and,
        with ``--global-batch``, ``grad_accum`` derived from it, so that every layout
        trains on the same global batch."""
        layout = self.layout(world_size)
        if self.global_batch is None or self.grad_accum is not None:
            return self
        return dataclasses.replace(self, grad_accum=self._micro_batches(layout))


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``prog: error: message``: the
    usage of 34 flags would bury it (``--help`` shows them)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


FLAG_TYPES = {"int": int, "float": float, "str": None}
"""The value a flag converts its text to, by its field's annotation (``int | None``
reads as ``int``); ``bool`` fields are switches (``store_true``)."""


def _flag_type(annotation: str) -> type | None:
    """The converter for a field annotated ``annotation`` (a string, as
    ``from __future__ import annotations`` leaves it)."""
    kind = annotation.replace(" | None", "")
    if kind not in FLAG_TYPES:
        raise ValueError(f"annotation must be one of {tuple(FLAG_TYPES)} or bool, got {kind!r}")
    return FLAG_TYPES[kind]


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m trainscale.train``: under ``torchrun`` (or
    ``python -m trainscale.launch``), or alone as one process. One flag per field of
    :class:`TrainConfig`, in its order, with the field's default and help."""
    p = _Parser(
        prog=PROG,
        description=(
            "Train a small GPT on synthetic data, restartably: one process when run alone,"
            " or as many as python -m trainscale.launch (or torchrun) starts."
        ),
    )
    for field in dataclasses.fields(TrainConfig):
        name = "--" + field.name.replace("_", "-")
        options: dict[str, Any] = {"default": field.default, "help": field.metadata["help"]}
        if field.type == "bool":
            p.add_argument(name, action="store_true", **options)
            continue
        if field.type == "bool | None":  # --bias / --no-bias, None if neither is given
            p.add_argument(name, action=argparse.BooleanOptionalAction, **options)
            continue
        converter = _flag_type(str(field.type))
        if converter is not None:
            options["type"] = converter
        p.add_argument(name, **options)
    return p


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parse and check the command line; a bad value raises ``ValueError`` naming it."""
    return TrainConfig(**vars(parser().parse_args(argv)))


def model_config(config: TrainConfig) -> GPTConfig:
    """The model the arguments describe: its shape (``--model`` or the shape flags),
    fused attention (``scaled_dot_product_attention``), the ``qkv`` matrix stored
    head by head (so tensor parallelism splits it into whole heads, or whole groups
    of heads), no dropout, and each block recomputed in backward if
    ``--recompute full``; selective recomputation is the capstone's own, torch's
    selective activation checkpointing (:mod:`trainscale.train.parallelize`)."""
    return GPTConfig(
        vocab=config.vocab,
        context=config.seq_len,
        d_model=config.width,
        layers=config.layers,
        heads=config.heads,
        d_ff=config.ffn,
        tied=config.tied,
        attention="sdpa",
        recompute="full" if config.recompute == "full" else "none",
        qkv_layout="by_head",
        kv_heads=config.kv_heads,
        mlp=config.mlp,
        norm=config.norm,
        position=config.position,
        rope_theta=config.rope_theta,
        bias=config.bias,
    )
