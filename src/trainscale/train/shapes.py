"""The capstone's shapes: the mesh's (:data:`DIMS`, :class:`Layout`, torchtitan's
``ParallelDims``) and the model's, a tiny GPT-2 by default, and the planner's Llama 3
presets under the planner's names (``--model llama-3-70b``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trainscale import _checks
from trainscale.planner.inputs import LLAMA3
from trainscale.transformer import LLAMA_SHAPE

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The device mesh's dimensions, outermost first, in torchtitan's order: pipeline
stages, replicated data parallelism, sharded data parallelism, context
parallelism, tensor parallelism (the innermost, whose collectives are the most
frequent, on the ranks that are closest)."""

PP_SCHEDULES = ("1f1b", "interleaved")
"""Pipeline schedules: ``Schedule1F1B`` (one stage per rank) or
``ScheduleInterleaved1F1B`` (``--virtual-stages`` stages per rank)."""


@dataclass(frozen=True)
class Layout:
    """How ``world`` ranks split the work: a size for each of :data:`DIMS`.

    Their product is the number of ranks. ``dp`` (= ``dp_replicate * dp_shard``)
    ranks see different data; the ``pp * cp * tp`` ranks of one data-parallel
    group see the same.
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def sizes(self) -> tuple[int, ...]:
        """The mesh's shape, in the order of :data:`DIMS`."""
        return tuple(getattr(self, name) for name in DIMS)

    @property
    def world(self) -> int:
        """Ranks the layout needs."""
        return math.prod(self.sizes)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many different slices of the global batch run at once."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        """``TP 2 x PP 2 x DP 2 (replicate 1 x shard 2)``: the layout in words."""
        dp = f"DP {self.dp} (replicate {self.dp_replicate} x shard {self.dp_shard})"
        cp = f" x CP {self.cp}" if self.cp > 1 else ""
        return f"TP {self.tp} x PP {self.pp} x {dp}{cp}"


def layer_counts(stages: int, layers: int) -> list[int]:
    """How many of ``layers`` blocks each of ``stages`` pipeline stages (model chunks, in
    the order of the model) holds: an equal share, or, when they do not divide, Llama 3's
    balance (Dubey et al. 2024, arXiv 2407.21783, section 3.3.2), which the planner
    assumes too (``trainscale.planner.memory``'s ``_stage``): every stage
    ``ceil(layers / stages)`` blocks, the first and then the last one fewer, the embedding
    and the output layer taking a block's place. 126 blocks on 16 stages: 7, 8, ..., 8, 7.
    More than two blocks short has no such balance: ``ValueError`` naming ``--layers``."""
    n = _checks.count("stages", stages, minimum=1)
    total = _checks.count("layers", layers, minimum=1)
    per = -(-total // n)
    short = per * n - total
    if short > min(2, n):
        raise ValueError(
            f"--layers must fill --pp x --virtual-stages = {n} stages evenly or leave only"
            f" the first and the last one block short ({n * per - 2} to {n * per} for"
            f" {per} per stage), got {total}"
        )
    counts = [per] * n
    for stage in (0, n - 1)[:short]:
        counts[stage] -= 1
    return counts


RECOMPUTE = ("none", "selective", "full")
"""What each block keeps for backward: everything, what torch's selective activation
checkpointing saves (:data:`trainscale.train.parallelize.SAVED_OPS`), or only its input."""

GPT_SHAPE: dict[str, Any] = {
    "vocab": 64,
    "seq_len": 32,
    "width": 64,
    "heads": 4,
    "layers": 2,
    "mlp": "gelu",
    "norm": "layernorm",
    "position": "learned",
    "rope_theta": 10_000.0,
    "bias": True,
    "tied": False,
}
"""The model's shape when neither ``--model`` nor a shape flag says otherwise: a tiny
GPT-2 (learned positions, layer norms, a GELU MLP, biases), untied; ``--kv-heads``
defaults to ``--heads`` and ``--ffn`` to ``4 x --width``."""

LLAMA3_ROPE_THETA = 500_000.0
"""Llama 3's rotary base (Dubey et al. 2024, arXiv 2407.21783, section 3.2.1)."""


def _preset(size: str) -> dict[str, Any]:
    """The flags of Llama 3 ``size`` (a key of :data:`trainscale.planner.LLAMA3`): the
    planner's shape, with Llama's switches (:data:`trainscale.transformer.LLAMA_SHAPE`)."""
    m = LLAMA3[size]
    return {
        "vocab": m.vocab,
        "seq_len": m.seq_len,
        "width": m.hidden,
        "heads": m.heads,
        "layers": m.layers,
        "kv_heads": m.kv_heads,
        "ffn": m.ffn_hidden,
        **LLAMA_SHAPE,
        "rope_theta": LLAMA3_ROPE_THETA,
        "tied": False,
    }


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    f"llama-3-{size.lower()}": _preset(size) for size in LLAMA3
}
"""``--model``'s shapes, under the planner's names (``python -m trainscale.planner
--model llama-3-70b``): Llama 3 8B, 70B and 405B. The planner's ``mixtral-8x7b`` has
experts, which the capstone does not (chapter 11 runs them)."""

SHAPE_FLAGS = (*GPT_SHAPE, "kv_heads", "ffn")
"""The fields that ``--model`` sets and a shape flag given with it overrides."""
