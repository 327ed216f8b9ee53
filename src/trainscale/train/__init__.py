"""The capstone of chapters 16 and 17: a small GPT trained on any layout, restartably.

The model is the book's decoder (:mod:`trainscale.transformer`) with fused
attention and an untied head: a tiny GPT-2 by default, or Llama-shaped
(``--model llama-3-70b``, or the shape flags: ``--kv-heads``, ``--mlp swiglu``,
``--norm rmsnorm``, ``--position rope``, ``--no-bias``). Each rank builds only its
pipeline stages, on the meta device; the parallelisms are applied to them; then
they get memory and each rank draws its own shards of the weights, every parameter
from a generator seeded by the run's seed and its name, so that any layout starts
from one process's weights (:mod:`trainscale.train.stages`). One script puts the
book's techniques together, composed as torchtitan composes them, over one
``DeviceMesh`` whose dimensions are ``["pp", "dp_replicate", "dp_shard", "cp", "tp"]``:

* pipeline parallelism (``--pp``): the decoder split by layers into stages
  (the first holds the embeddings, the last the final norm and head), run by
  ``torch.distributed.pipelining`` with ``Schedule1F1B`` or
  ``ScheduleInterleaved1F1B`` (``--pp-schedule``, ``--virtual-stages``);
* tensor parallelism with sequence parallelism (``--tp``) on each stage's
  blocks (DTensor ``parallelize_module``, chapter 8's plan), the embedding and
  head split by vocabulary and the loss taken on split logits (``loss_parallel``),
  then recomputation (``--recompute selective``, torch's selective activation
  checkpointing, or ``full``);
* context parallelism (``--cp``): each sequence split zig-zag over the ``cp``
  ranks, attention computed as ring attention (chapter 10,
  :func:`trainscale.workers.context.ring_attention`); on GPUs, torch's
  ``context_parallel`` (untested here);
* FSDP2's ``fully_shard`` over the data-parallel ranks (``--dp-shard``, and the
  ``cp`` ranks with them, whose gradients are averaged too; ``--zero 1`` or ``2``
  keeps the gathered weights from forward to backward), HSDP when
  ``--dp-replicate`` > 1; ``--parallel ddp`` and ``--parallel fsdp`` are
  shorthand for ``--dp-replicate WORLD`` and ``--dp-shard WORLD``;

and bf16 (FSDP2's ``MixedPrecisionPolicy`` on GPUs, autocast on the CPU), gradient
accumulation that reduce-scatters every micro-batch (the pipeline's micro-batches
under ``--pp``; ``--global-batch`` fixes the sequences per step whatever the
layout), warmup plus cosine decay, global-norm clipping, a log of loss,
gradient norm, learning rate, throughput and MFU, and checkpoints it resumes
from after a crash, on the same layout or another. Eight CPU processes on a
laptop (gloo), started by the package's launcher, which keeps every listening
socket on 127.0.0.1 (:mod:`trainscale.launch`; plain ``torchrun`` listens on
every interface)::

    python -m trainscale.launch --nproc-per-node=8 --max-restarts=1 \\
        -m trainscale.train --tp 2 --pp 2 --dp-shard 2 --grad-accum 4 --ckpt-dir /tmp/capstone

The same command on a node with eight GPUs runs on NCCL, one GPU per process
(:func:`trainscale.distributed.backend_and_device`). Whatever the layout, the
job trains on the same data as one process would (:func:`global_batch`), and
its loss is the mean over every token of the global batch.

Run alone, without a launcher, ``python -m trainscale.train --steps 4`` trains as
one process (a layout of several ranks says, in one line, how to launch it), and a
bad flag ends it with one line naming the flag (:func:`main`). ``--warmup`` and
``--grad-accum`` default to what the other flags allow: ``min(10, --steps // 10)``
warmup steps, and one micro-batch per step, or one per pipeline stage with ``--pp``
(:func:`default_warmup`, :func:`default_grad_accum`).

What makes a restart exact:

* the data of optimiser step ``s`` is a function of ``(seed, s)`` alone
  (:func:`global_batch`), so the data loader's whole state is the step count;
* a checkpoint holds the model, the optimiser (Adam's moments and step
  counts), the step, from which the learning rate follows, and the data
  position, every tensor under its name in the unsplit model
  (:class:`TrainState`), so that another layout can load it, each rank
  reading the pieces it needs. ``torch.distributed.checkpoint`` writes each rank's shards in
  parallel; the folder is renamed to its final name only once every rank has
  finished, so a crash mid-save leaves no checkpoint that looks complete;
* the model has no dropout and the same seed initialises it in every layout.

:mod:`trainscale.train.parity` checks a layout against one process on every final
weight and both of Adam's moments (``--final-weights``), within a tolerance
measured from float32's order of additions.

``--fail-at-step K --fail-rank R`` makes rank ``R`` exit abruptly in the middle
of step ``K`` (counted from 0), on the first attempt only: ``torchrun`` counts
its restarts in ``TORCHELASTIC_RESTART_COUNT``. With ``--max-restarts=1``,
torchrun then stops the other ranks, starts them all again, and the run resumes
from its latest complete checkpoint.

The package, in torchtitan's split by concern: :mod:`~trainscale.train.shapes` (the
model presets), :mod:`~trainscale.train.config` (the flags, declared once, and the
layout), :mod:`~trainscale.train.data`, :mod:`~trainscale.train.parity`,
:mod:`~trainscale.train.stages` (the model on the meta device, and its weights shard
by shard), :mod:`~trainscale.train.parallelize` (TP, CP, recomputation, FSDP2, the
pipeline schedule), :mod:`~trainscale.train.checkpoints`, :mod:`~trainscale.train.loop`
and :mod:`~trainscale.train.cli` (``worker`` and ``main``); their names are
re-exported here.
"""

from trainscale.train import estimate, parity
from trainscale.train.checkpoints import (
    CHECKPOINT_PREFIX,
    FINAL_MOMENTS,
    TrainState,
    checkpoint_path,
    complete_checkpoints,
    latest_checkpoint,
    load_latest,
    save_checkpoint,
    save_final_weights,
)
from trainscale.train.cli import TORCHRUN_ENVIRONMENT, main, ranks_needed, runs_alone, worker
from trainscale.train.config import (
    DIMS,
    PP_SCHEDULES,
    PROG,
    WARMUP_CAP,
    Layout,
    TrainConfig,
    default_grad_accum,
    default_warmup,
    model_config,
    parse_args,
    parser,
)
from trainscale.train.data import global_batch, loss_floor, micro_batch, tokens_per_step
from trainscale.train.loop import (
    FAIL_EXIT_CODE,
    GRAD_NORM_RTOL,
    LOSS_RTOL,
    _grad_norm,
    gradient_bytes,
    schedule_lr,
    train,
)
from trainscale.train.parallelize import (
    SAVED_OPS,
    Built,
    apply_context_parallel,
    apply_fsdp,
    apply_recomputation,
    apply_tensor_parallel,
    build,
    fsdp_mesh,
    loss_parallel,
    mixed_precision,
    reshard_after_forward,
    stage_plan,
    tensor_parallel_plan,
)
from trainscale.train.shapes import GPT_SHAPE, MODEL_PRESETS, RECOMPUTE, layer_counts
from trainscale.train.stages import (
    Stage,
    build_mesh,
    full_parameter,
    init_stage,
    materialise,
    meta_stages,
    parameter_seed,
    split_model,
    stage_ids,
    stage_layers,
)

__all__ = [
    "CHECKPOINT_PREFIX",
    "DIMS",
    "FAIL_EXIT_CODE",
    "FINAL_MOMENTS",
    "GPT_SHAPE",
    "GRAD_NORM_RTOL",
    "LOSS_RTOL",
    "MODEL_PRESETS",
    "PP_SCHEDULES",
    "PROG",
    "RECOMPUTE",
    "SAVED_OPS",
    "TORCHRUN_ENVIRONMENT",
    "WARMUP_CAP",
    "Built",
    "Layout",
    "Stage",
    "TrainConfig",
    "TrainState",
    "_grad_norm",
    "apply_context_parallel",
    "apply_fsdp",
    "apply_recomputation",
    "apply_tensor_parallel",
    "build",
    "build_mesh",
    "checkpoint_path",
    "complete_checkpoints",
    "default_grad_accum",
    "default_warmup",
    "estimate",
    "fsdp_mesh",
    "full_parameter",
    "global_batch",
    "gradient_bytes",
    "init_stage",
    "latest_checkpoint",
    "layer_counts",
    "load_latest",
    "loss_floor",
    "loss_parallel",
    "main",
    "materialise",
    "meta_stages",
    "micro_batch",
    "mixed_precision",
    "model_config",
    "parameter_seed",
    "parity",
    "parse_args",
    "parser",
    "ranks_needed",
    "reshard_after_forward",
    "runs_alone",
    "save_checkpoint",
    "save_final_weights",
    "schedule_lr",
    "split_model",
    "stage_ids",
    "stage_layers",
    "stage_plan",
    "tensor_parallel_plan",
    "tokens_per_step",
    "train",
    "worker",
]
