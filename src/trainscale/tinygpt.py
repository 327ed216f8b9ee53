"""A small GPT-style language model for the book's real training runs (chapter 13).

Token embedding plus learned positions, ``layers`` pre-LayerNorm blocks (causal
self-attention, then a GELU MLP, each added back to the residual stream), a final
LayerNorm and a linear head that scores every token of the vocabulary. There is
no dropout: a forward pass depends only on the weights and the input, which is
what lets a resumed run end bitwise equal to an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from trainscale import _checks


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a :class:`TinyGPT`; ``width`` must be divisible by ``heads``."""

    vocab: int = 64
    seq_len: int = 32
    width: int = 64
    heads: int = 4
    layers: int = 2

    def __post_init__(self) -> None:
        _checks.count("vocab", self.vocab, minimum=2)
        _checks.count("seq_len", self.seq_len, minimum=1)
        _checks.count("heads", self.heads, minimum=1)
        _checks.count("layers", self.layers, minimum=1)
        if _checks.count("width", self.width, minimum=1) % self.heads:
            raise ValueError(f"width must be a multiple of heads={self.heads}, got {self.width}")


class Block(nn.Module):
    """One pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, t, head width)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    """Logits ``(batch, t, vocab)`` for token ids ``(batch, t)``, ``t <= seq_len``.

    Set ``checkpoint_activations = True`` to keep only each block's input during
    the forward pass and recompute the block in the backward pass (chapter 09).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.checkpoint_activations = False
        self.tokens = nn.Embedding(config.vocab, config.width)
        self.positions = nn.Embedding(config.seq_len, config.width)
        self.blocks = nn.ModuleList(Block(config.width, config.heads) for _ in range(config.layers))
        self.ln = nn.LayerNorm(config.width)
        self.head = nn.Linear(config.width, config.vocab, bias=False)
        for module in self.modules():  # GPT-2's initialisation: small normal weights
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[-1]
        if not 1 <= t <= self.config.seq_len:
            raise ValueError(
                f"tokens must have 1 to seq_len={self.config.seq_len} columns, got {t}"
            )
        x = self.tokens(tokens) + self.positions(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            if self.checkpoint_activations and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln(x))


def matmul_weights(config: GPTConfig) -> int:
    """Weights that enter a matrix product for every token: the ``N`` of the ``6N``
    FLOPs per trained token that MFU counts.

    Per block ``12 * width**2`` (query, key and value ``3 w^2``, output ``w^2``,
    the MLP's ``4 w^2`` up and ``4 w^2`` down), plus the head's ``width * vocab``.
    Embedding look-ups, biases and LayerNorm scales are not matrix products.
    """
    return config.layers * 12 * config.width**2 + config.width * config.vocab


def total_params(config: GPTConfig) -> int:
    """Every parameter of ``TinyGPT(config)``: per block ``12 w^2 + 13 w`` (the
    matrices, their biases and two LayerNorms), the final LayerNorm ``2 w``, the
    head ``w * vocab`` and the token and position tables ``(vocab + seq_len) * w``."""
    w = config.width
    blocks = config.layers * (12 * w * w + 13 * w)
    return blocks + 2 * w + w * config.vocab + (config.vocab + config.seq_len) * w
