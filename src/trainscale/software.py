"""The software a run trains with, as the planner's input (chapter 16).

What a training stack does changes a step's time and memory as much as the layout:
whether its attention kernel is fused (the ``s x s`` scores never reach GPU memory),
whether its layers keep dropout masks, in which dtype it reduces the gradients, which
pipeline schedules and ZeRO stages its engine accepts, and which communication it
overlaps with compute. :class:`Software` holds those facts, :data:`SOFTWARE` the named
presets, each field with its source (:attr:`Software.sources`: code or docs at a
commit). What no source documents stays ``None`` (unknown), and the planner then
spans its whole range (:data:`trainscale.planner.OVERLAP`).

:data:`DEFAULT_SOFTWARE` (``"planner-default"``) is what the planner assumed for any
model before the software was an input, so a plan that names no software is the plan
it always was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainscale import _checks

GRADIENT_REDUCE_DTYPES = ("bf16", "fp16", "fp32")
"""Dtypes a stack reduces (and accumulates) gradients in: 2, 2 and 4 bytes each."""

SEQUENCE_PARALLEL_STYLES = ("re-gather", "keep gathered")
"""How a stack runs sequence parallelism (:data:`trainscale.parallel.SEQUENCE_PARALLEL_STYLES`,
chapter 8): Megatron-LM keeps each rank's ``s/t`` shard of the layer-norm outputs and
all-gathers it again in backward (a quarter more tensor-parallel bytes); PyTorch's DTensor
plan keeps the gathered input whole (more memory, no more bytes)."""

CONTEXT_PARALLEL_STYLES = ("ring", "all-gather")
"""How a stack moves keys and values for context parallelism (chapter 10): around a ring,
each block's transfer under the attention of the one before (Liu et al. 2023), or
all-gathered before the attention, in the critical path (Llama 3). The same bytes reach
each rank (the other ranks' blocks, once); what differs is how much hides."""

SELECTIVE_RECOMPUTE = ("scores", "core attention", "every other matmul")
"""What a stack's *selective* activation recomputation recomputes: the attention scores
an unfused kernel would have stored (Korthikanti et al. 2022; nothing with a fused kernel,
whose backward rebuilds them anyway), the whole core-attention function whatever its
kernel (Megatron-Core's ``checkpoint_core_attention``), or every other matrix product and
everything element-wise (torchtitan's per-op policy)."""

LINEAR_DTYPES = ("bf16", "fp8")
"""The dtypes a stack's linear layers multiply in: 16-bit, or FP8 (Transformer Engine's or
torchao's float8 linears; attention and the output layer stay 16-bit). FP8 in the planner
is less validated than bf16: one measured GEMM, no published run priced."""

OVERLAP_FIELDS = ("overlap_grad_reduce", "overlap_param_gather", "overlap_tp_comm", "fsdp_prefetch")
"""The fields that say what a stack overlaps with compute (``None``: not documented)."""

FIELDS = (
    "fused_attention",
    "dropout",
    "gradient_reduce_dtype",
    "zero_stages",
    "pipeline_interleaving",
    "pipeline_zero_stages",
    "reduce_after_flush",
    "interleaving_min_stages",
    "interleaving_divides_micro_batches",
    "sequence_parallel_style",
    "selective_recompute",
    "context_parallel_style",
    "linear_dtype",
    "fused_elementwise",
    "fused_loss",
    *OVERLAP_FIELDS,
)
"""Every field of :class:`Software` that describes the stack (all but ``name``, ``title``
and ``sources``); each preset of :data:`SOFTWARE` gives each one a source."""


def _stages(name: str, value: object) -> tuple[int, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, tuple | list) or not value:
        raise ValueError(f"{name} must be a non-empty tuple of ZeRO stages 0-3, got {value!r}")
    return tuple(int(_checks.choice(name, v, (0, 1, 2, 3))) for v in value)  # type: ignore[call-overload]


@dataclass(frozen=True)
class Software:
    """A training stack as the planner sees it; ``None`` in an overlap field: not documented.

    * ``fused_attention``: a FlashAttention-style kernel (Dao et al. 2022, arXiv
      2205.14135): no ``s x s`` scores in memory, and context parallelism possible;
    * ``dropout``: the layers keep 1-byte dropout masks (a model's own
      :attr:`trainscale.planner.Model.dropout`, when given, wins);
    * ``gradient_reduce_dtype``: one of :data:`GRADIENT_REDUCE_DTYPES` (fp32: 4 bytes
      per gradient in memory and on the wire);
    * ``zero_stages``: the ZeRO stages the stack offers; ``pipeline_zero_stages``: those it
      accepts with pipeline parallelism; ``pipeline_interleaving``: whether its pipeline
      engine interleaves model chunks; ``reduce_after_flush``: with a pipeline, the
      gradients are reduced only after the last micro-batch's backward (nothing hides);
    * ``interleaving_min_stages`` and ``interleaving_divides_micro_batches``: the engine's
      asserts on an interleaved schedule (at least that many stages; micro-batches a
      multiple of the stages). Recorded, and reported by
      :meth:`interleaving_problems`, but not yet a rule of the planner's search;
    * ``sequence_parallel_style``: one of :data:`SEQUENCE_PARALLEL_STYLES`;
      ``selective_recompute``: one of :data:`SELECTIVE_RECOMPUTE`;
      ``context_parallel_style``: one of :data:`CONTEXT_PARALLEL_STYLES`;
      ``linear_dtype``: one of :data:`LINEAR_DTYPES`; ``fused_elementwise``: the
      norms, activations and rotary embeddings run as fused kernels that keep only their
      inputs (Korthikanti et al.'s count), or as separate eager PyTorch ops, each keeping
      what its backward needs (:func:`trainscale.planner.memory.eager_layer_activation_bytes`)
      and each reading and writing its operands in memory
      (:func:`trainscale.planner.memory.eager_layer_traffic_bytes`);
      ``fused_loss``: the cross-entropy's backward writes the logits' gradient over its
      saved fp32 softmax (Megatron's vocabulary-parallel cross entropy, Korthikanti et
      al.'s ``4 s b V`` bytes), or, as PyTorch's eager ``F.cross_entropy``, allocates the
      fp32 gradients of the log-probabilities and of the logits beside the saved
      log-probabilities: ``8 s b V / t`` bytes more at the start of the last stage's
      backward, measured by torch's memory tracker (``python -m trainscale.train
      --estimate-memory``, chapter 17);
    * what hides under compute: ``overlap_grad_reduce`` (the data-parallel gradient
      reduction under the backward), ``overlap_param_gather`` (ZeRO's weight all-gather
      under the forward), ``overlap_tp_comm`` (the backward's tensor-parallel
      collectives under the weight-gradient GEMMs), ``fsdp_prefetch`` (ZeRO-3 gathers the
      next layer while this one computes).

    ``sources`` maps each field of :data:`FIELDS` to where its value is read from.
    """

    name: str
    title: str
    fused_attention: bool
    dropout: bool
    gradient_reduce_dtype: str
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    pipeline_interleaving: bool = True
    pipeline_zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    reduce_after_flush: bool = False
    interleaving_min_stages: int = 2
    interleaving_divides_micro_batches: bool = False
    sequence_parallel_style: str = "re-gather"
    selective_recompute: str = "scores"
    context_parallel_style: str = "ring"
    linear_dtype: str = "bf16"
    fused_elementwise: bool = True
    fused_loss: bool = True
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    overlap_tp_comm: bool | None = None
    fsdp_prefetch: bool | None = None
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("name", "title"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        for name in (
            "fused_attention",
            "dropout",
            "pipeline_interleaving",
            "reduce_after_flush",
            "fused_elementwise",
            "fused_loss",
        ):
            _checks.boolean(name, getattr(self, name))
        _checks.boolean(
            "interleaving_divides_micro_batches", self.interleaving_divides_micro_batches
        )
        _checks.choice("gradient_reduce_dtype", self.gradient_reduce_dtype, GRADIENT_REDUCE_DTYPES)
        for name in ("zero_stages", "pipeline_zero_stages"):
            object.__setattr__(self, name, _stages(name, getattr(self, name)))
        if not set(self.pipeline_zero_stages) <= set(self.zero_stages):
            raise ValueError(
                f"pipeline_zero_stages must be among zero_stages {self.zero_stages}, "
                f"got {self.pipeline_zero_stages}"
            )
        _checks.count("interleaving_min_stages", self.interleaving_min_stages, minimum=2)
        _checks.choice(
            "sequence_parallel_style", self.sequence_parallel_style, SEQUENCE_PARALLEL_STYLES
        )
        _checks.choice("selective_recompute", self.selective_recompute, SELECTIVE_RECOMPUTE)
        _checks.choice(
            "context_parallel_style", self.context_parallel_style, CONTEXT_PARALLEL_STYLES
        )
        _checks.choice("linear_dtype", self.linear_dtype, LINEAR_DTYPES)
        for name in OVERLAP_FIELDS:
            if getattr(self, name) is not None:
                _checks.boolean(name, getattr(self, name))
        if not isinstance(self.sources, Mapping) or not set(self.sources) <= set(FIELDS):
            raise ValueError(f"sources must map fields of {FIELDS} to where they are read from")

    @property
    def gradient_bytes(self) -> int:
        """Bytes per gradient in memory and on the wire: 4 for fp32, else 2."""
        return 4 if self.gradient_reduce_dtype == "fp32" else 2

    def stages_for(self, pp: int) -> tuple[int, ...]:
        """The ZeRO stages this stack runs with ``pp`` pipeline stages."""
        return self.pipeline_zero_stages if pp > 1 else self.zero_stages

    def depths_for(self, depths: tuple[int, ...]) -> tuple[int, ...]:
        """The interleaving depths of ``depths`` this stack's pipeline engine runs."""
        return depths if self.pipeline_interleaving else (1,)

    def overlap_shares(self, pp: int, zero_stage: int) -> tuple[float | None, float | None]:
        """``(data, tensor)``: the share of the data-parallel traffic and of the backward's
        tensor-parallel collectives that hides, where documented (``None``: unknown).

        Data: 0 when the gradients are reduced after the backward (not overlapped, or after
        a pipeline's flush); 1 when the reduction and, at ZeRO 1-3, the gather (and at ZeRO-3
        the prefetch) are documented as overlapped; else unknown. Tensor: 0 or 1 as
        ``overlap_tp_comm`` says."""
        if self.overlap_grad_reduce is False or (pp > 1 and self.reduce_after_flush):
            data: float | None = 0.0
        else:
            needed = [self.overlap_grad_reduce]
            needed += [self.overlap_param_gather] if zero_stage >= 1 else []
            needed += [self.fsdp_prefetch] if zero_stage == 3 else []
            data = 1.0 if all(flag is True for flag in needed) else None
        tensor = None if self.overlap_tp_comm is None else float(self.overlap_tp_comm)
        return data, tensor

    def layout_problems(self, pp: int, virtual_stages: int, zero_stage: int) -> list[str]:
        """Why this stack cannot run a layout (its engine's refusals), if it cannot."""
        problems = []
        if zero_stage not in self.zero_stages:
            problems.append(f"{self.title} has no ZeRO-{zero_stage}")
        elif pp > 1 and zero_stage not in self.pipeline_zero_stages:
            problems.append(f"{self.title} refuses ZeRO-{zero_stage} with pipeline parallelism")
        if pp > 1 and virtual_stages > 1 and not self.pipeline_interleaving:
            problems.append(f"{self.title}'s pipeline engine does not interleave")
        return problems

    def interleaving_problems(self, pp: int, virtual_stages: int, micro_batches: int) -> list[str]:
        """The asserts this stack's interleaved schedule would fail (recorded, not a rule
        of the search: see :class:`Software`)."""
        if pp == 1 or virtual_stages == 1 or not self.pipeline_interleaving:
            return []
        problems = []
        if pp < self.interleaving_min_stages:
            problems.append(f"interleaving needs at least {self.interleaving_min_stages} stages")
        if self.interleaving_divides_micro_batches and micro_batches % pp:
            problems.append(f"interleaving needs micro-batches ({micro_batches}) a multiple of PP")
        return problems

    def replace(self, **changes: object) -> Software:
        """This stack with some fields changed (each change's source: ``"given by the
        caller"``), named after what changed."""
        unknown = set(changes) - set(FIELDS)
        if unknown:
            raise ValueError(f"changes must be fields of {FIELDS}, got {sorted(unknown)}")
        changed = {k: v for k, v in changes.items() if getattr(self, k) != v}
        if not changed:
            return self
        label = ", ".join(f"{k}={v}" for k, v in changed.items())
        sources = {**self.sources, **dict.fromkeys(changed, "given by the caller")}
        name = f"{self.name} ({label})"
        return dataclasses.replace(self, name=name, sources=sources, **changed)  # type: ignore[arg-type]


MEGATRON = "NVIDIA/Megatron-LM"
DEEPSPEED = "microsoft/DeepSpeed"
TORCHTITAN = "pytorch/torchtitan@b5bcd76"
_ASSUMED = "assumed (the planner's default for any model, issue 12)"
_UNKNOWN = "not documented: unknown (the planner's range)"


def _preset(name: str, title: str, sources: dict[str, str], **values: object) -> Software:
    """A preset; every field of :data:`FIELDS` not given a source here is a default that
    does not apply to the stack, said so."""
    filled = {f: sources.get(f, _UNKNOWN if f in OVERLAP_FIELDS else "the default") for f in FIELDS}
    return Software(name=name, title=title, sources=filled, **values)  # type: ignore[arg-type]


_MEGATRON_2021 = f"{MEGATRON}@cdde433 (9 Apr 2021, Narayanan et al.'s code)"
_MEGATRON_2022 = f"{MEGATRON}@d239429 (10 May 2022) and 739cb43 (24 May 2022, Korthikanti et al.'s)"
_CORE = f"{MEGATRON}@d98e8a6 (22 Aug 2026, Megatron-Core)"
_CORE_08 = f"{MEGATRON}@baf94af (core_r0.8.0, July 2024)"
_README_08 = (
    f"{MEGATRON}@937571c README.md, 'fine-grained overlapping of data-parallel "
    "(--overlap-grad-reduce --overlap-param-gather), tensor-parallel (--tp-comm-overlap)'"
)
_TITAN_2024 = "pytorch/torchtitan@9dec370 (26 Dec 2024, its H100 benchmark's commit)"
_FSDP2_OVERLAP = {
    "overlap_grad_reduce": "PyTorch FSDP2 (fully_shard): gradients reduce-scattered during"
    " the backward, layer by layer",
    "overlap_param_gather": "PyTorch FSDP2 (fully_shard): the next layer's all-gather"
    " overlaps this one's compute",
    "fsdp_prefetch": "PyTorch FSDP2 (fully_shard): implicit forward and backward prefetching",
}
"""Where the overlap fields of every FSDP2 stack come from (torchtitan's presets)."""
_TORCHTITAN: dict[str, object] = {
    "fused_attention": True,
    "dropout": False,
    "gradient_reduce_dtype": "fp32",
    "pipeline_zero_stages": (0, 1),
    "sequence_parallel_style": "keep gathered",
    "selective_recompute": "every other matmul",
    "fused_loss": False,
    "overlap_grad_reduce": True,
    "overlap_param_gather": True,
    "overlap_tp_comm": False,
    "fsdp_prefetch": True,
}
"""The values torchtitan's presets share (each preset sources them at its commit)."""
_PIPELINED_FSDP = (
    "torch.distributed.pipelining (torch 2.13) stage.py:844-848, backward_maybe_with_nosync:"
    " FSDP2's gradient sync and reshard after backward off until the step's last backward"
    " (perform_reduce_grad), so with pipelines the weights stay gathered and the gradients"
    " whole: ZeRO-1's memory, whatever the sharding"
)

SOFTWARE: dict[str, Software] = {
    s.name: s
    for s in (
        _preset(
            "planner-default",
            "the planner's default stack",
            dict.fromkeys(FIELDS[: -len(OVERLAP_FIELDS)], _ASSUMED),
            fused_attention=True,
            dropout=True,
            gradient_reduce_dtype="bf16",
        ),
        _preset(
            "megatron-lm-2021",
            "Megatron-LM (2021)",
            {
                "fused_elementwise": f"{_MEGATRON_2021}: fused layer norm and the bias-GeLU and "
                "bias-dropout-add fusions, which keep what Korthikanti et al. count",
                "fused_attention": f"{_MEGATRON_2021}: a fused softmax that still writes the "
                "s x s scores; FlashAttention (arXiv 2205.14135) came in May 2022",
                "dropout": f"{_MEGATRON_2021} megatron/arguments.py:337-340, "
                "--attention-dropout and --hidden-dropout default 0.1",
                "gradient_reduce_dtype": f"{_MEGATRON_2021} examples/pretrain_gpt3_175B.sh:51,"
                " --fp16 (16-bit gradients all-reduced)",
                "zero_stages": f"{_MEGATRON_2021}: its own DDP only (--DDP-impl local, "
                "arguments.py:574); no distributed optimizer",
                "pipeline_zero_stages": "as zero_stages",
                "pipeline_interleaving": f"{_MEGATRON_2021} megatron/schedules.py, "
                "forward_backward_pipelining_with_interleaving",
                "interleaving_min_stages": f"{_MEGATRON_2021} arguments.py:118-124: "
                "'pipeline-model-parallel size should be greater than 2 with interleaved "
                "schedule'; the layers divisible by the chunks",
                "interleaving_divides_micro_batches": "not asserted at cdde433",
                "overlap_grad_reduce": f"{_MEGATRON_2021} megatron/training.py: train_step "
                "all-reduces the gradients after forward_backward_func returns",
                "overlap_tp_comm": f"{_MEGATRON_2021} megatron/mpu/layers.py: synchronous "
                "tensor-parallel all-reduces",
            },
            fused_attention=False,
            dropout=True,
            gradient_reduce_dtype="fp16",
            zero_stages=(0,),
            pipeline_zero_stages=(0,),
            interleaving_min_stages=3,
            overlap_grad_reduce=False,
            overlap_tp_comm=False,
        ),
        _preset(
            "megatron-lm-2022",
            "Megatron-LM (2022, sequence parallelism and selective recomputation)",
            {
                "fused_elementwise": f"{_MEGATRON_2022}: fused layer norm and the bias-GeLU and "
                "bias-dropout-add fusions (Korthikanti et al.'s count)",
                "fused_attention": f"{_MEGATRON_2022}: Megatron's fused softmax (scores "
                "written to memory)",
                "dropout": f"{_MEGATRON_2022} megatron/arguments.py: --attention-dropout and "
                "--hidden-dropout default 0.1",
                "gradient_reduce_dtype": f"{_MEGATRON_2022} examples/pretrain_gpt3_175B.sh:51,"
                " --fp16",
                "zero_stages": f"{_MEGATRON_2022}: its own DDP; no --use-distributed-optimizer "
                "in arguments.py",
                "pipeline_zero_stages": "as zero_stages",
                "pipeline_interleaving": f"{_MEGATRON_2022} megatron/schedules.py",
                "interleaving_min_stages": f"{_MEGATRON_2022} arguments.py:137-143 (d239429): "
                "'greater than 2 with interleaved schedule'",
                "interleaving_divides_micro_batches": f"{_MEGATRON_2022} megatron/schedules.py:"
                "36-42: 'number of microbatches is not divisible by pipeline-model-parallel-size"
                " when using interleaved schedule'",
                "sequence_parallel_style": f"{_MEGATRON_2022} megatron/mpu/layers.py: with "
                "sequence parallelism the column-parallel backward all-gathers its input again"
                " for the weight gradient",
                "selective_recompute": f"{_MEGATRON_2022} megatron/model/transformer.py: "
                "--recompute-granularity selective checkpoints the core attention (the scores"
                " and their softmax, which its unfused kernel stores)",
                "overlap_grad_reduce": f"{_MEGATRON_2022} megatron/training.py: the gradient "
                "all-reduce after the backward (default --DDP-impl local)",
                "overlap_tp_comm": f"{_MEGATRON_2022}: async_tensor_model_parallel_allreduce "
                "(arguments.py:532, on by default) runs the column-parallel backward all-reduce"
                " under the weight-gradient GEMM; with sequence parallelism (739cb43, "
                "mpu/layers.py:240-305) the all-gather under the input-gradient GEMM and the "
                "reduce-scatter under the weight-gradient GEMM",
            },
            fused_attention=False,
            dropout=True,
            gradient_reduce_dtype="fp16",
            zero_stages=(0,),
            pipeline_zero_stages=(0,),
            interleaving_min_stages=3,
            interleaving_divides_micro_batches=True,
            overlap_grad_reduce=False,
            overlap_tp_comm=True,
        ),
        _preset(
            "deepspeed-megatron",
            "DeepSpeed (Megatron-DeepSpeed: BLOOM, MT-NLG)",
            {
                "fused_attention": "Megatron's fused softmax (scores written to memory): "
                "BLOOM and MT-NLG trained before FlashAttention (arXiv 2205.14135)",
                "dropout": "Megatron-LM's default 0.1, as the planner read it (issue 12); "
                "BLOOM's own setting not re-checked",
                "gradient_reduce_dtype": "16-bit gradients, as the planner read it (issue 12), "
                "kept so the estimates do not move; but BLOOM trained in bf16 (arXiv "
                f"2211.05100), and {DEEPSPEED}@0050fda deepspeed/runtime/pipe/engine.py says "
                "'BF16 Optimizer is hardcoded for fp32 gradient accumulation': to re-check",
                "zero_stages": f"{DEEPSPEED} deepspeed/runtime/zero: stages 0-3",
                "pipeline_zero_stages": f"{DEEPSPEED}@0050fda deepspeed/runtime/pipe/engine.py,"
                " PipelineEngine.__init__: assert zero_optimization_stage() < gradients, "
                "'ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism'",
                "pipeline_interleaving": f"{DEEPSPEED}@077e674 deepspeed/runtime/pipe/schedule.py:"
                " TrainSchedule.steps is 1F1B over 2 (m + stages - 1) steps, one model chunk"
                " per stage",
                "reduce_after_flush": f"{DEEPSPEED}@077e674 deepspeed/runtime/pipe/schedule.py:"
                " TrainSchedule.steps issues ReduceGrads at its last step, after the last "
                "micro-batch's backward",
            },
            fused_attention=False,
            dropout=True,
            gradient_reduce_dtype="bf16",
            pipeline_interleaving=False,
            pipeline_zero_stages=(0, 1),
            reduce_after_flush=True,
        ),
        _preset(
            "meta-llama3",
            "Meta's Llama 3 stack (as its paper describes it)",
            {
                "fused_attention": "Dubey et al. 2024 (arXiv 2407.21783): a fused attention "
                "kernel, as the planner read it (issue 12)",
                "dropout": "meta-llama/llama3 llama/model.py: no dropout in the layers",
                "gradient_reduce_dtype": "Dubey et al. 2024, section 3.3.2 (numerical "
                "stability): gradients accumulated and reduce-scattered in fp32",
                "zero_stages": "Dubey et al. 2024, section 3.3.2: FSDP (ZeRO) with TP, CP, PP",
                "pipeline_zero_stages": "Dubey et al. 2024, section 3.3.2: FSDP with pipelines",
                "pipeline_interleaving": "Dubey et al. 2024, section 3.3.2: an interleaved, "
                "tunable 1F1B schedule",
                "context_parallel_style": "Dubey et al. 2024, section 3.3.2: 'an all-gather "
                "based method where we first all-gather the key (K) and value (V) tensors'; "
                "'the all-gather communication latency is exposed in the critical path'",
            },
            fused_attention=True,
            dropout=False,
            gradient_reduce_dtype="fp32",
            context_parallel_style="all-gather",
        ),
        _preset(
            "torchtitan-fsdp2",
            "torchtitan with FSDP2",
            {
                "fused_attention": f"{TORCHTITAN} torchtitan/models/llama3/__init__.py:78-82,"
                " attention through a fused backend (SDPA or flex)",
                "dropout": f"{TORCHTITAN} torchtitan/models/llama3/model.py: no dropout",
                "gradient_reduce_dtype": f"{TORCHTITAN} torchtitan/config/configs.py:102, "
                "mixed_precision_reduce = 'float32' (fsdp.py:155, MixedPrecisionPolicy)",
                "zero_stages": f"{TORCHTITAN} torchtitan/distributed/fsdp.py: DDP or FSDP2 "
                "(fully_shard)",
                "pipeline_zero_stages": _PIPELINED_FSDP,
                "pipeline_interleaving": f"{TORCHTITAN} configs.py:216, pipeline_parallel_schedule"
                " (Interleaved1F1B among the choices, configs.py:221)",
                "sequence_parallel_style": f"{TORCHTITAN} torchtitan/models/llama3/"
                "parallelize.py: DTensor SequenceParallel and PrepareModuleInput (the gathered "
                "input kept whole)",
                "selective_recompute": f"{TORCHTITAN} torchtitan/distributed/"
                "activation_checkpoint.py:243-271, the 'op' policy: every other mm saved, the "
                "rest recomputed",
                "fused_elementwise": f"{TORCHTITAN} torchtitan/models/llama3/model.py: "
                "RMSNorm, rotary embedding and SiLU as eager ops (compile off by default)",
                "fused_loss": f"{TORCHTITAN} torchtitan/components/loss.py:57, "
                "F.cross_entropy(pred.float(), ...) in eager mode (without TP)",
                "overlap_tp_comm": f"{TORCHTITAN} configs.py:298, enable_async_tensor_parallel "
                "= False",
                **_FSDP2_OVERLAP,
            },
            fused_elementwise=False,
            **_TORCHTITAN,
        ),
        _preset(
            "megatron-core-te",
            "Megatron-Core with Transformer Engine (its defaults)",
            {
                "fused_elementwise": f"{_CORE}: Transformer Engine's fused norm-linear and "
                "activation kernels",
                "fused_attention": f"{_CORE} megatron/core/transformer/transformer_config.py:151,"
                " attention_backend = AttnBackend.auto (Transformer Engine's fused kernels)",
                "dropout": f"{_CORE} transformer_config.py:188-191, hidden_dropout and "
                "attention_dropout 0.1",
                "gradient_reduce_dtype": f"{_CORE} megatron/training/arguments.py:1210-1217, "
                "bf16 accumulates and reduces in fp32 unless --grad-reduce-in-bf16",
                "zero_stages": f"{_CORE} arguments.py: DDP, --use-distributed-optimizer "
                "(ZeRO-1), --use-torch-fsdp2 (ZeRO-3)",
                "pipeline_zero_stages": f"{_CORE} arguments.py:1035, '--use-torch-fsdp2 is not "
                "supported with pipeline parallelism'",
                "pipeline_interleaving": f"{_CORE} --num-layers-per-virtual-pipeline-stage",
                "interleaving_min_stages": f"{_CORE}: no 'greater than 2' assert any more",
                "sequence_parallel_style": f"{_CORE} megatron/core/tensor_parallel/layers.py:"
                "665-680, the backward all-gathers the saved s/t input again",
                "selective_recompute": f"{_CORE} megatron/core/transformer/attention.py:392, "
                "checkpoint_core_attention: the core attention reruns whatever its kernel",
                "overlap_grad_reduce": f"{_CORE} megatron/core/distributed/"
                "distributed_data_parallel_config.py:18, overlap_grad_reduce = False",
                "overlap_param_gather": f"{_CORE} distributed_data_parallel_config.py:21, "
                "overlap_param_gather = False",
                "overlap_tp_comm": f"{_CORE} megatron/core/model_parallel_config.py:265, "
                "tp_comm_overlap = False",
            },
            fused_attention=True,
            dropout=True,
            gradient_reduce_dtype="fp32",
            zero_stages=(0, 1, 3),
            pipeline_zero_stages=(0, 1),
            selective_recompute="core attention",
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            overlap_tp_comm=False,
        ),
        _preset(
            "megatron-core-r0.8",
            "Megatron-Core r0.8.0, tuned (its README's H100 scaling runs)",
            {
                "fused_elementwise": f"{_CORE_08}: Transformer Engine's fused norm-linear and "
                "activation kernels",
                "fused_attention": f"{_CORE_08} megatron/training/arguments.py:668, "
                "--transformer-impl transformer_engine by default (Transformer Engine's fused "
                "attention)",
                "dropout": f"{_CORE_08} megatron/core/transformer/transformer_config.py:43-46, "
                "hidden_dropout and attention_dropout 0.1 (the benchmark's flags are not "
                "published)",
                "gradient_reduce_dtype": f"{_CORE_08} megatron/training/arguments.py:299-305, "
                "'bfloat16 requires gradient accumulation and all-reduce to be done in fp32'",
                "zero_stages": f"{_CORE_08}: DDP or --use-distributed-optimizer (ZeRO-1)",
                "pipeline_zero_stages": "as zero_stages",
                "pipeline_interleaving": f"{_CORE_08} --num-layers-per-virtual-pipeline-stage",
                "interleaving_min_stages": f"{_CORE_08}: no 'greater than 2' assert",
                "sequence_parallel_style": f"{_CORE_08} megatron/core/tensor_parallel/layers.py:"
                "401-418, the input saved as the s/t shard and all-gathered again in backward",
                "selective_recompute": f"{_CORE_08} megatron/core/transformer/attention.py:103,"
                " checkpoint_core_attention when --recompute-granularity selective",
                "overlap_grad_reduce": f"{_README_08}: --overlap-grad-reduce",
                "overlap_param_gather": f"{_README_08}: --overlap-param-gather",
                "overlap_tp_comm": f"{_README_08}: --tp-comm-overlap",
            },
            fused_attention=True,
            dropout=True,
            gradient_reduce_dtype="fp32",
            zero_stages=(0, 1),
            pipeline_zero_stages=(0, 1),
            selective_recompute="core attention",
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            overlap_tp_comm=True,
        ),
        *(
            _preset(
                f"torchtitan-2024{suffix}",
                f"torchtitan with FSDP2, December 2024{title}",
                {
                    "fused_attention": f"{_TITAN_2024} torchtitan/models/llama/model.py:209, "
                    "F.scaled_dot_product_attention(..., is_causal=True)",
                    "dropout": f"{_TITAN_2024} torchtitan/models/llama/model.py: no dropout",
                    "gradient_reduce_dtype": f"{_TITAN_2024} torchtitan/config_manager.py:389-392,"
                    " --training.mixed_precision_reduce float32 (its only choice)",
                    "zero_stages": f"{_TITAN_2024} torchtitan/parallelisms/parallelize_llama.py:"
                    " FSDP2 (fully_shard), each block resharded after forward but the last",
                    "pipeline_zero_stages": _PIPELINED_FSDP,
                    "pipeline_interleaving": f"{_TITAN_2024}: Interleaved1F1B among its schedules",
                    "sequence_parallel_style": f"{_TITAN_2024} torchtitan/parallelisms/"
                    "parallelize_llama.py:137-176, DTensor SequenceParallel and "
                    "PrepareModuleInput (the gathered input kept whole)",
                    "selective_recompute": f"{_TITAN_2024} torchtitan/parallelisms/"
                    "parallelize_llama.py:214-276, selective_ac_option 'op': an mm's output "
                    "saved when its count is odd, everything else recomputed",
                    "fused_elementwise": f"{_TITAN_2024} torchtitan/models/norms.py and "
                    "models/llama/model.py: RMSNorm, rotary embedding and SiLU as eager ops "
                    "(norm_type 'rmsnorm'); torch.compile fuses them"
                    + (" (this preset)" if suffix else " (not this preset)"),
                    "fused_loss": f"{_TITAN_2024} train.py:130-133, F.cross_entropy("
                    "pred.flatten(0, 1).float(), ...) in eager mode (compiling it 'causes CUDA"
                    " errors, turning off for now')",
                    "overlap_tp_comm": f"{_TITAN_2024} config_manager.py:288, "
                    "--experimental.enable_async_tensor_parallel off by default",
                    **_FSDP2_OVERLAP,
                },
                fused_elementwise=bool(suffix),
                **_TORCHTITAN,
            )
            for suffix, title in (("", ""), ("-compiled", ", torch.compile"))
        ),
    )
}
"""The named software presets, by :attr:`Software.name`; each field's source in
:attr:`Software.sources` (a commit of the repository named, or a paper)."""

DEFAULT_SOFTWARE = SOFTWARE["planner-default"]
"""The software a plan assumes when it names none: the planner's assumptions before the
software was an input (a fused attention kernel, dropout, 16-bit gradients, overlap
unknown, any ZeRO stage and interleaving with pipelines)."""


def software(name: object) -> Software:
    """The preset of :data:`SOFTWARE` called ``name`` (a :class:`Software` passes through)."""
    if isinstance(name, Software):
        return name
    return SOFTWARE[str(_checks.choice("software", name, tuple(SOFTWARE)))]
