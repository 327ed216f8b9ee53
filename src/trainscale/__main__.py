"""``python -m trainscale``: the book's headline numbers, computed by the package.

Each block is labelled with the chapter it comes from and computed by the same
functions the chapter calls, with the chapter's own worked-example inputs (the
constants below). It needs no notebook, no GPU and no network, and takes a few
seconds, most of them importing torch. ``--help`` lists the package's other
command lines.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from trainscale import __version__, compute, memory, pipeline, planner, sharding
from trainscale.collectives import ring_bytes_per_rank, ring_factor

# The worked examples' inputs, as the chapters choose them (assumptions, not measurements).
PARAMS_7B = 7e9  # chapters 1, 2, 6, 7, 14 and 15: a 7B-parameter model
GPUS = 8  # chapters 1, 6, 7 and 14: one node of 8 GPUs
SEQUENCES_PER_GPU, SEQ_LEN = 4, 4096  # chapters 1, 6, 14: sequences per GPU per step
PEAK_FLOPS, MFU = 1000e12, 0.40  # chapters 1, 6, 14: FLOP/s per GPU, share of peak
LINK_BYTES_PER_S = 100e9  # chapters 1, 6, 14: bytes per second each GPU sends
BF16_BYTES = 2  # bytes per bf16 gradient
BUDGET_PARAMS, BUDGET_TOKENS = 1e9, 100e9  # chapter 14: 1B parameters on 100B tokens
STAGES, MICRO_BATCHES = 4, (4, 12)  # chapter 9: pipeline stages, micro-batches per step
INTERLEAVED_MICRO_BATCHES, INTERLEAVED_CHUNKS = 8, 2  # chapter 9: interleaved 1F1B
TOKENS_PER_GPU_PER_S, A100_BF16_FLOPS = 3000, 312e12  # chapter 15: the job's report, A100 peak
TOP_LAYOUTS = 3  # chapter 16: how many of the planner's best shapes to show

COMMANDS = """\
command lines of the package:
  python -m trainscale
      these headline numbers
  python -m trainscale.planner --model 70b [--laptop 8]
      the layout planner of chapter 16: the best layouts of a model on a cluster,
      and the torchrun command that trains the best (--help for models and clusters)
  python -m trainscale.efficiency [--device cuda --dtype bfloat16]
      measure a device's peak matmul rate and the MFU of a training loop (chapter 15)
  python -m trainscale.launch --nproc-per-node=2 -m trainscale.train --parallel fsdp
      the capstone: a small GPT on any TP x PP x DP layout, restartably (chapter 17);
      `python -m trainscale.train --help` lists its flags
  python -m trainscale.launch --nproc-per-node=4 -m trainscale.workers.NAME
      a chapter's real multi-process check, NAME one of data_parallel (05),
      collectives (06), sharding (07), tensor_parallel (08), pipeline (09)

python -m trainscale.launch takes torchrun's common flags and runs torchrun's job on
this computer with every listening socket on 127.0.0.1 (plain torchrun's stores listen
on every interface); gloo on the CPU, NCCL on a GPU node.
"""


def _gib(n_bytes: float) -> str:
    """``n_bytes`` in GiB (2**30 bytes), one decimal."""
    return f"{n_bytes / memory.GIB:,.1f} GiB"


def memory_lines() -> list[str]:
    """Chapter 2: bytes per parameter of bf16 mixed precision with Adam, and what that totals."""
    parts = " + ".join(f"{part} {size}" for part, size in memory.BYTES_PER_PARAM.items())
    total = sum(memory.BYTES_PER_PARAM.values())
    states = ", ".join(
        f"{params / 1e9:g}B parameters {_gib(memory.model_state_bytes(params))}"
        for params in (PARAMS_7B, 70e9)
    )
    return [
        "02 Where the memory goes",
        f"  bytes per parameter, bf16 + Adam: {parts} = {total}",
        f"  model state on one GPU: {states}",
    ]


def sharding_lines() -> list[str]:
    """Chapter 7: what each ZeRO stage leaves on each of :data:`GPUS` GPUs."""
    per_param = ", ".join(
        f"{name} {sharding.bytes_per_param(GPUS, stage):g}"
        for stage, name in sharding.STAGE_NAMES.items()
    )
    per_gpu = ", ".join(
        f"{name} {_gib(memory.model_state_bytes(PARAMS_7B, GPUS, stage))}"
        for stage, name in sharding.STAGE_NAMES.items()
    )
    return [
        "07 Sharding: ZeRO and FSDP",
        f"  bytes per parameter on each of {GPUS} GPUs: {per_param}",
        f"  {PARAMS_7B / 1e9:g}B parameters on {GPUS} GPUs, per GPU: {per_gpu}",
    ]


def collective_lines() -> list[str]:
    """Chapter 6: the ring all-reduce's traffic, and what it costs the 7B example."""
    factors = ", ".join(f"{ring_factor(ranks):.4g} on {ranks:,}" for ranks in (2, GPUS, 1024))
    gradient_bytes = BF16_BYTES * PARAMS_7B
    sent = ring_bytes_per_rank(gradient_bytes, GPUS)
    return [
        "06 Collectives",
        f"  ring all-reduce: each rank sends 2(N-1)/N x the tensor: {factors} ranks",
        f"  bf16 gradients of {PARAMS_7B / 1e9:g}B parameters ({gradient_bytes / 1e9:g} GB)"
        f" on {GPUS} GPUs: {sent / 1e9:.1f} GB sent per GPU,"
        f" {sent / LINK_BYTES_PER_S:.3f} s at {LINK_BYTES_PER_S / 1e9:g} GB/s",
    ]


def pipeline_lines() -> list[str]:
    """Chapter 9: the pipeline bubble, flat and interleaved."""
    flat = ", ".join(
        f"{pipeline.bubble(STAGES, m):.1%} with {m} micro-batches" for m in MICRO_BATCHES
    )
    interleaved = pipeline.bubble(STAGES, INTERLEAVED_MICRO_BATCHES, INTERLEAVED_CHUNKS)
    return [
        "09 Pipeline parallelism",
        f"  bubble (K-1)/(M+K-1) on {STAGES} stages: {flat}",
        f"  interleaved, {INTERLEAVED_CHUNKS} chunks per device, {INTERLEAVED_MICRO_BATCHES}"
        f" micro-batches: {interleaved:.1%}",
    ]


def step_lines() -> list[str]:
    """Chapter 1: 6ND for one step of the 7B example, and how long the step takes."""
    tokens = GPUS * SEQUENCES_PER_GPU * SEQ_LEN
    step_flops = compute.training_flops(PARAMS_7B, tokens)
    step_s = compute.training_seconds(PARAMS_7B, tokens, GPUS, PEAK_FLOPS, MFU)
    per_token = compute.FLOPS_PER_PARAM_PER_TOKEN
    passes = " + ".join(f"{name} {flops}" for name, flops in per_token.items())
    return [
        "01 One training step",
        f"  FLOPs per parameter per token: {passes} = {sum(per_token.values())} (6ND)",
        f"  one step of {PARAMS_7B / 1e9:g}B parameters on {GPUS} x {SEQUENCES_PER_GPU}"
        f" x {SEQ_LEN:,} = {tokens:,} tokens: {step_flops:.2e} FLOPs,"
        f" {step_s:.2f} s on {_assumed_gpus()}",
    ]


def budget_lines() -> list[str]:
    """Chapter 14: 6ND and the wall-clock time of a whole 1B-parameter run."""
    run = compute.training_budget(BUDGET_PARAMS, BUDGET_TOKENS, GPUS, PEAK_FLOPS, MFU, 1.0)
    return [
        "14 How much compute, how long?",
        f"  {BUDGET_PARAMS / 1e9:g}B parameters on {BUDGET_TOKENS / 1e9:g}B tokens:"
        f" 6ND = {run.flops:.1e} FLOPs, {run.seconds:,.0f} s = {run.days:.2f} days"
        f" on {_assumed_gpus()}",
    ]


def _assumed_gpus() -> str:
    """The hardware chapters 1, 6 and 14 assume, in words."""
    return f"{GPUS} GPUs at {PEAK_FLOPS / 1e12:,.0f} TFLOP/s and {MFU:.0%} MFU"


def efficiency_lines() -> list[str]:
    """Chapter 15: the MFU of the 7B job that reports 3,000 tokens per second per A100."""
    share = compute.mfu(TOKENS_PER_GPU_PER_S, PARAMS_7B, gpus=1, peak_flops=A100_BF16_FLOPS)
    return [
        "15 Measuring efficiency",
        f"  {PARAMS_7B / 1e9:g}B parameters at {TOKENS_PER_GPU_PER_S:,} tokens/s per A100"
        f" ({A100_BF16_FLOPS / 1e12:g} TFLOP/s bf16): MFU {share:.1%}",
    ]


def planner_lines() -> list[str]:
    """Chapter 16: the planner's best layouts for the 70B worked example."""
    model, cluster = planner.EXAMPLE_MODEL, planner.EXAMPLE_CLUSTER
    batch = planner.EXAMPLE_GLOBAL_BATCH
    layouts = planner.plan(model, cluster, batch)
    fitting = planner.verdict_counts(layouts)["fits"]
    lines = [
        "16 Planning a large run",
        f"  {model.params / 1e9:g}B parameters on {cluster.nodes} nodes x"
        f" {cluster.gpus_per_node} GPUs of {_gib(cluster.memory_bytes)}, global batch"
        f" {batch:,} sequences ({batch * model.seq_len:,} tokens): {len(layouts):,} layouts,"
        f" {fitting} fit; the fastest shapes:",
    ]
    for layout in planner.top_layouts(layouts, count=TOP_LAYOUTS):
        lines.append(
            f"    {layout.name}, {layout.settings}: step {layout.step_seconds:.2f} s,"
            f" MFU {layout.mfu:.1%}, {_gib(layout.memory_bytes)} per GPU"
        )
    return lines


SECTIONS = (
    step_lines,
    memory_lines,
    collective_lines,
    sharding_lines,
    pipeline_lines,
    budget_lines,
    efficiency_lines,
    planner_lines,
)
"""The blocks of the summary, in the chapters' order."""


def headline_lines() -> list[str]:
    """Every line the summary prints: a title, then one block per chapter idea."""
    lines = [f"Training at Scale: the book's headline numbers (trainscale {__version__})"]
    for section in SECTIONS:
        lines += ["", *section()]
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    """Print the book's headline numbers; ``--help`` lists the package's command lines."""
    parser = argparse.ArgumentParser(
        prog="python -m trainscale",
        description=(
            "Print the headline numbers of the book Training at Scale, each computed by"
            " the trainscale package and labelled with its chapter."
        ),
        epilog=COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"trainscale {__version__}")
    parser.parse_args(argv)
    print("\n".join(headline_lines()))


if __name__ == "__main__":
    main()
