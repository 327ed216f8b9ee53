"""The layout planner of chapter 16: which TP x PP x DP layout to start a large run with.

Given a model, a cluster and a global batch, :func:`plan` tries every way of
splitting the GPUs into tensor (TP), pipeline (PP) and data (DP) parallel groups,
and, where they can help, context-parallel (CP) groups and expert-parallel (EP)
groups inside DP, with every ZeRO stage, every activation-recomputation mode and every candidate
micro-batch size, and estimates for each one the memory per GPU and the time of
one training step. It is a *model*: a small set of stated assumptions, each
with its source, meant to rank layouts and to explain why the bad ones are bad,
not to predict a step time to the millisecond.

What the model leaves out: data loading and kernel launches, latency outside ZeRO-3,
uneven expert loads (routing is taken as even), and memory the estimate does not list
(CUDA context, NCCL buffers, fragmentation, the transient buffers of recomputation), for
which only :data:`USABLE_MEMORY` of each GPU is counted as
available.

The package follows chapter 16's sections; each module imports only those above it:

* :mod:`~trainscale.planner.inputs`: the model, the cluster, the worked examples (the
  software they train with is :class:`trainscale.software.Software`, re-exported here
  with its presets :data:`SOFTWARE` and :data:`DEFAULT_SOFTWARE`);
* :mod:`~trainscale.planner.unknowns`: what no source pins, the span of each, and how
  Table 4 ties the GEMM share to two of them (every range is built from these);
* :mod:`~trainscale.planner.memory`: model state and activations per GPU;
* :mod:`~trainscale.planner.traffic`: what each kind of parallelism sends;
* :mod:`~trainscale.planner.kernels`: every kernel at its roofline, the GEMM share;
* :mod:`~trainscale.planner.layout`: a layout's options and the record of its estimate;
* :mod:`~trainscale.planner.step`: one layout's step time, every term with its source;
* :mod:`~trainscale.planner.search`: every layout of a cluster, ranked;
* :mod:`~trainscale.planner.calibration`: the planner against published runs;
* :mod:`~trainscale.planner.commands`, :mod:`~trainscale.planner.arguments`,
  :mod:`~trainscale.planner.cli` and
  ``__main__``: ``python -m trainscale.planner``, which prints the best layouts and the
  ``torchrun`` command that trains one.

Everything chapter 16, the tests and the other modules use is re-exported here, so
``from trainscale import planner; planner.plan(...)`` needs no submodule.
"""

from __future__ import annotations

from trainscale.checkpointing import (
    ACTIVATION_PARTS,
    RECOMPUTE,
    layer_activation_bytes,
)
from trainscale.hardware import (
    TILE,
    gemm_seconds,
    tile_overhead_k,
)
from trainscale.memory import (
    USABLE_MEMORY,
)
from trainscale.planner.calibration import (
    CALIBRATION_TARGETS,
    FIT_GPUS,
    INTERLEAVING,
    MARGIN_COVERAGE,
    RunEstimate,
    calibration_targets,
    conformal_margin,
    estimate_run,
    mfu_range,
    model_margin,
    ranked_search,
    reported_mfu,
    reported_mfu_6n,
    restated_run,
    shape_rank,
    split_runs,
)
from trainscale.planner.inputs import (
    A100_NODE,
    EXAMPLE_CLUSTER,
    EXAMPLE_GLOBAL_BATCH,
    EXAMPLE_MODEL,
    GPT3_175B,
    H100_NODE,
    LLAMA3,
    LONG_CONTEXT_MODEL,
    MOE_MODEL,
    Cluster,
    Model,
    node_settings,
    published_cluster,
    published_model,
)
from trainscale.planner.kernels import (
    FUSED_BACKWARD_PASSES,
    TABLE4_GPU,
    TABLE4_RUN,
    TABLE4_SECONDS,
    gemm_share,
    table4_half_shares,
    table4_seconds,
)
from trainscale.planner.layout import (
    KERNEL_EFFICIENCY,
    MAX_BUBBLE,
    MEMORY_PARTS,
    SCHEDULES,
    TIME_PARTS,
    VERDICTS,
    Layout,
)
from trainscale.planner.memory import (
    FP32_GRADIENTS,
    activation_bytes_per_gpu,
    model_state_per_gpu,
    stage_params,
)
from trainscale.planner.search import (
    CP_MIN_LOCAL_TOKENS,
    context_parallel_degrees,
    expert_parallel_degrees,
    plan,
    top_layouts,
    verdict_counts,
)
from trainscale.planner.step import (
    OPTIMISER_STEP_BYTES,
    evaluate,
)
from trainscale.planner.traffic import (
    COLLECTIVE_STEP_SECONDS,
)
from trainscale.planner.unknowns import (
    CENTRAL,
    ELEMENTWISE_TRAFFIC,
    OVERLAP,
    TILE_OVERHEAD,
    Unknowns,
    range_corners,
)
from trainscale.published import (
    PublishedRun,
    published_runs,
)
from trainscale.software import (
    DEFAULT_SOFTWARE,
    SOFTWARE,
    Software,
)

__all__ = [  # this module's public names, and those it re-exports for chapter 16
    "A100_NODE",
    "ACTIVATION_PARTS",
    "CALIBRATION_TARGETS",
    "CENTRAL",
    "COLLECTIVE_STEP_SECONDS",
    "CP_MIN_LOCAL_TOKENS",
    "DEFAULT_SOFTWARE",
    "ELEMENTWISE_TRAFFIC",
    "EXAMPLE_CLUSTER",
    "EXAMPLE_GLOBAL_BATCH",
    "EXAMPLE_MODEL",
    "FIT_GPUS",
    "FP32_GRADIENTS",
    "FUSED_BACKWARD_PASSES",
    "GEMM_SHARE",
    "GPT3_175B",
    "H100_NODE",
    "INTERLEAVING",
    "KERNEL_EFFICIENCY",
    "LLAMA3",
    "LONG_CONTEXT_MODEL",
    "MARGIN_COVERAGE",
    "MAX_BUBBLE",
    "MEMORY_PARTS",
    "MODEL_MARGIN",
    "MOE_MODEL",
    "OPTIMISER_STEP_BYTES",
    "OVERLAP",
    "RECOMPUTE",
    "SCHEDULES",
    "SOFTWARE",
    "TABLE4_GPU",
    "TABLE4_RUN",
    "TABLE4_SECONDS",
    "TILE",
    "TILE_OVERHEAD",
    "TIME_PARTS",
    "USABLE_MEMORY",
    "VERDICTS",
    "Cluster",
    "Layout",
    "Model",
    "PublishedRun",
    "RunEstimate",
    "Software",
    "Unknowns",
    "activation_bytes_per_gpu",
    "calibration_targets",
    "conformal_margin",
    "context_parallel_degrees",
    "estimate_run",
    "evaluate",
    "expert_parallel_degrees",
    "gemm_seconds",
    "gemm_share",
    "layer_activation_bytes",
    "mfu_range",
    "model_margin",
    "model_state_per_gpu",
    "node_settings",
    "plan",
    "published_cluster",
    "published_model",
    "published_runs",
    "range_corners",
    "ranked_search",
    "reported_mfu",
    "reported_mfu_6n",
    "restated_run",
    "shape_rank",
    "split_runs",
    "stage_params",
    "table4_half_shares",
    "table4_seconds",
    "tile_overhead_k",
    "top_layouts",
    "verdict_counts",
]

_FORMULA_NAMES = {
    "selective_recompute_flops": "trainscale.checkpointing",
    "ring_factor": "trainscale.collectives",
    "FLOPS_PER_PARAM_PER_TOKEN": "trainscale.compute",
    "PublishedUtilisation": "trainscale.compute",
    "mfu": "trainscale.compute",
    "CAUSAL_WORK_SHARE": "trainscale.context",
    "cp_beats_tp_local_tokens": "trainscale.context",
    "cp_hiding_threshold_tokens": "trainscale.context",
    "ring_bytes_per_rank": "trainscale.context",
    "ALL_TO_ALLS_PER_LAYER": "trainscale.experts",
    "all_to_all_bytes_per_rank": "trainscale.experts",
    "BYTES_PER_PARAM": "trainscale.memory",
    "GIB": "trainscale.memory",
    "OPTIMIZER_STATE": "trainscale.memory",
    "STATE_GROUPS": "trainscale.memory",
    "StateDtypes": "trainscale.memory",
    "model_state_groups": "trainscale.memory",
    "bubble": "trainscale.pipeline",
    "bubble_zb_h1": "trainscale.pipeline",
    "GPUS": "trainscale.published",
    "ZERO_COLLECTIVES": "trainscale.sharding",
    "zero_collective_bytes": "trainscale.sharding",
}
"""Names the planner, as one module, made reachable by importing them from the formula
modules: each still reads as ``planner.NAME`` (:func:`__getattr__`), though it is not the
planner's API (:data:`__all__`); its home is the module named here."""


_COMPUTED_WHEN_READ = {
    "GEMM_SHARE": "trainscale.planner.kernels",
    "MODEL_MARGIN": "trainscale.planner.calibration",
}
"""Names of the planner's API computed when first read rather than at import (the GEMM
share bisects Table 4's layer), by the module that computes them."""


def __getattr__(name: str) -> object:
    """A name of :data:`_COMPUTED_WHEN_READ` or :data:`_FORMULA_NAMES`, from its module."""
    import importlib

    module = _COMPUTED_WHEN_READ.get(name) or _FORMULA_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_COMPUTED_WHEN_READ, *_FORMULA_NAMES})
