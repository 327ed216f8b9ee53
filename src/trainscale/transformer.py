"""A minimal GPT-style decoder, small enough to train on a CPU (chapters 10 and 11).

The model is the usual stack: token and position embeddings, ``layers`` pre-LN
blocks (layer norm, causal multi-head self-attention, residual add; layer norm,
MLP, residual add), a final layer norm and a linear head onto the vocabulary,
whose weight may be *tied* to the token embedding. Attention is written out as
two matrix products (scores ``q @ k^T`` and the weighted sum ``p @ v``) rather
than a fused kernel, so that :class:`torch.utils.flop_counter.FlopCounterMode`
sees every FLOP of it (in torch 2.13 it counts 0 for the CPU kernel of
``scaled_dot_product_attention``).

:func:`parameter_counts` gives the exact number of parameters of each part
without building the model; :func:`matmul_weights` the weights that take part
in a matrix product for every token, which is the ``N`` of ``6N`` FLOPs per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from trainscale import _checks


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a :class:`GPT`.

    ``vocab`` tokens, sequences of up to ``context`` tokens, width ``d_model``,
    ``layers`` blocks of ``heads`` attention heads (``d_model`` must divide by
    ``heads``), an MLP of ``d_ff`` hidden features (``4 * d_model`` when left at
    0), and a head tied to the token embedding when ``tied``.
    """

    vocab: int = 64
    context: int = 64
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    d_ff: int = 0
    tied: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab", "context", "d_model", "layers", "heads"):
            _checks.count(name, getattr(self, name), minimum=1)
        _checks.count("d_ff", self.d_ff)
        if self.d_model % self.heads:
            raise ValueError(f"heads must divide d_model = {self.d_model}, got {self.heads!r}")
        if not isinstance(self.tied, bool):
            raise ValueError(f"tied must be True or False, got {self.tied!r}")

    @property
    def hidden(self) -> int:
        """Hidden features of each MLP: ``d_ff``, or ``4 * d_model`` if it is 0."""
        return self.d_ff or 4 * self.d_model


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which token ``t`` sees tokens ``0..t`` only."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        # (batch, seq, width) -> (batch, heads, seq, head width)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        future = torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1)
        weights = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(batch, seq, width)
        return self.proj(out)


class Block(nn.Module):
    """One pre-LN block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.d_model)
        self.attention = CausalSelfAttention(config)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(config.d_model, config.hidden),
            nn.GELU(),
            nn.Linear(config.hidden, config.d_model),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A GPT-style decoder: ``tokens`` of shape (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab, config.d_model)
        self.position_embedding = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.final_norm = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        if config.tied:
            self.head.weight = self.token_embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[-1]
        if seq > self.config.context:
            raise ValueError(
                f"tokens must hold at most context = {self.config.context} positions, got {seq}"
            )
        positions = torch.arange(seq, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of predicting ``targets`` (the next tokens) from ``tokens``."""
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def gpt(config: GPTConfig, seed: int = 0) -> GPT:
    """A freshly initialised :class:`GPT`, the same for the same ``seed``.

    GPT-2's initialisation: every weight matrix and embedding drawn from
    N(0, 0.02²), biases zero, and the two projections that write into the
    residual stream (attention's ``proj`` and the MLP's second layer) scaled
    down by ``sqrt(2 * layers)``, so the residual stream does not grow with depth.
    The global random state is left untouched.
    """
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    seed = _checks.count("seed", seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config)
        residual_std = 0.02 / math.sqrt(2 * config.layers)
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif "norm" in name:
                nn.init.ones_(param)
            elif name.endswith(("proj.weight", "mlp.2.weight")):
                nn.init.normal_(param, std=residual_std)
            else:
                nn.init.normal_(param, std=0.02)
    return model


def parameter_counts(config: GPTConfig) -> dict[str, int]:
    """The exact number of parameters of each part of ``GPT(config)``.

    Keys: ``"token embedding"``, ``"position embedding"``, ``"attention"``
    (query, key, value and output matrices with their biases, all layers),
    ``"mlp"``, ``"layer norms"`` (two per block and the final one) and
    ``"head"`` (0 when tied: it reuses the token embedding). The values add up
    to ``sum(p.numel() for p in model.parameters())``.
    """
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    d, hidden, layers = config.d_model, config.hidden, config.layers
    return {
        "token embedding": config.vocab * d,
        "position embedding": config.context * d,
        "attention": layers * (4 * d * d + 4 * d),
        "mlp": layers * (2 * d * hidden + hidden + d),
        "layer norms": (2 * layers + 1) * 2 * d,
        "head": 0 if config.tied else config.vocab * d,
    }


def non_embedding_params(config: GPTConfig) -> int:
    """Kaplan et al.'s ``N``: every parameter except the vocabulary and position
    matrices (token embedding, position embedding and an untied head)."""
    parts = parameter_counts(config)
    return parts["attention"] + parts["mlp"] + parts["layer norms"]


def matmul_weights(config: GPTConfig) -> int:
    """Weights that enter a matrix product for every token.

    The four attention matrices and two MLP matrices of every block
    (``2 * d_model * (2 * d_model + d_ff)`` per layer, ``12 * d_model**2`` when
    ``d_ff = 4 * d_model``) and the head (``d_model * vocab``, counted even when
    tied, since the head multiplies by it). Embedding look-ups, biases and layer
    norms are not matrix products. Each of these weights costs 2 FLOPs per token
    forward and 4 backward.
    """
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    d = config.d_model
    return config.layers * 2 * d * (2 * d + config.hidden) + d * config.vocab
