"""Every figure of the book, one function each, in one house style.

Each function takes numbers computed elsewhere in the package and returns a
matplotlib ``Figure`` (a :class:`~trainscale.figures.style.BookFigure`, which a
notebook shows as SVG); none computes results of its own, so what a figure
shows is what a cell printed. One module per chapter idea; the house style is
in :mod:`trainscale.figures.style`.
"""

from trainscale.figures.batch_size import batch_scaling, noise_scale_growth
from trainscale.figures.checkpointing import layer_bytes, memory_timelines, recompute_slowdown
from trainscale.figures.collectives import (
    alpha_beta_fit,
    bandwidth_against_size,
    exposed_communication,
    four_collectives,
    ring_stages,
    ring_step,
)
from trainscale.figures.compute import attention_share, budget_table, flop_breakdown
from trainscale.figures.context import (
    attention_work_per_rank,
    context_traffic_against_sequence,
    ring_attention_steps,
)
from trainscale.figures.data_parallel import batch_split, bucket_timeline
from trainscale.figures.decisions import failure_intervals, parallelism_flowchart
from trainscale.figures.efficiency import (
    loader_timeline,
    matmul_throughput,
    mfu_against_batch,
    restated_utilisation,
    step_breakdown,
    step_durations,
)
from trainscale.figures.experts import all_to_all_matrix, expert_loads
from trainscale.figures.hardware import (
    gemm_share_against_size,
    gemm_tile_waves,
    node_diagram,
    roofline,
)
from trainscale.figures.memory import activations_against_batch, memory_stack, state_bars
from trainscale.figures.mesh import device_mesh
from trainscale.figures.pipeline import bubble_curves, pipeline_timelines, schedule_comparison
from trainscale.figures.planner import (
    planner_calibration,
    planner_rejections,
    planner_top_layouts,
)
from trainscale.figures.precision import (
    accumulation,
    format_ranges,
    gradient_histogram,
    loss_scale_trace,
    scaled_cast_histogram,
)
from trainscale.figures.reliability import checkpoint_tradeoff, simulated_intervals
from trainscale.figures.schedule import decay_bars, lr_schedule, training_curves
from trainscale.figures.sharding import (
    fsdp_memory_timeline,
    fsdp_timeline,
    zero_accumulation_traffic,
    zero_stage_bars,
)
from trainscale.figures.step import flop_bars, step_timeline
from trainscale.figures.style import PALETTE, STYLE, BookFigure, new_figure, svg_text
from trainscale.figures.tensor_parallel import (
    activation_memory_bars,
    tensor_parallel_mlp_diagram,
    time_bars,
)

__all__ = [
    "PALETTE",
    "STYLE",
    "BookFigure",
    "accumulation",
    "activation_memory_bars",
    "activations_against_batch",
    "all_to_all_matrix",
    "alpha_beta_fit",
    "attention_share",
    "attention_work_per_rank",
    "bandwidth_against_size",
    "batch_scaling",
    "batch_split",
    "bubble_curves",
    "bucket_timeline",
    "budget_table",
    "checkpoint_tradeoff",
    "context_traffic_against_sequence",
    "decay_bars",
    "device_mesh",
    "expert_loads",
    "exposed_communication",
    "failure_intervals",
    "flop_bars",
    "flop_breakdown",
    "format_ranges",
    "four_collectives",
    "fsdp_memory_timeline",
    "fsdp_timeline",
    "gemm_share_against_size",
    "gemm_tile_waves",
    "gradient_histogram",
    "layer_bytes",
    "loader_timeline",
    "loss_scale_trace",
    "lr_schedule",
    "matmul_throughput",
    "memory_stack",
    "memory_timelines",
    "mfu_against_batch",
    "new_figure",
    "node_diagram",
    "noise_scale_growth",
    "parallelism_flowchart",
    "pipeline_timelines",
    "planner_calibration",
    "planner_rejections",
    "planner_top_layouts",
    "recompute_slowdown",
    "restated_utilisation",
    "ring_attention_steps",
    "ring_stages",
    "ring_step",
    "roofline",
    "scaled_cast_histogram",
    "schedule_comparison",
    "simulated_intervals",
    "state_bars",
    "step_breakdown",
    "step_durations",
    "step_timeline",
    "svg_text",
    "tensor_parallel_mlp_diagram",
    "time_bars",
    "training_curves",
    "zero_accumulation_traffic",
    "zero_stage_bars",
]
