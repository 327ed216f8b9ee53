"""The capstone's model shapes: a tiny GPT-2 by default, and the planner's Llama 3
presets under the planner's names (``--model llama-3-70b``)."""

from __future__ import annotations

from typing import Any

from trainscale.planner.inputs import LLAMA3
from trainscale.transformer import LLAMA_SHAPE

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
experts, which the capstone does not (chapter 15 runs them)."""

SHAPE_FLAGS = (*GPT_SHAPE, "kv_heads", "ffn")
"""The fields that ``--model`` sets and a shape flag given with it overrides."""
