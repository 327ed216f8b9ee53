"""The book's one GPT-style decoder: its attention, its block, its model (chapters 3-17).

The model is the usual stack: token and position embeddings, ``layers`` pre-LN
blocks (layer norm, causal multi-head self-attention, residual add; layer norm,
MLP, residual add), a final layer norm and a linear head onto the vocabulary,
whose weight may be *tied* to the token embedding. :class:`GPTConfig` holds
its shape and the switches the chapters turn. GPT-2's shape is the default; four
switches make it Llama's (Touvron et al. 2023, arXiv 2302.13971; Dubey et al. 2024,
arXiv 2407.21783), each on its own:

- ``kv_heads``: grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245):
  ``kv_heads`` key-value heads, each shared by ``heads / kv_heads`` query heads;
- ``mlp="swiglu"``: the gated MLP ``down(silu(gate(x)) * up(x))`` (Shazeer 2020,
  arXiv 2002.05202), ``d_ff`` wide;
- ``norm="rmsnorm"``: RMSNorm (Zhang and Sennrich 2019, arXiv 1910.07467), a scale
  and no shift;
- ``position="rope"``: rotary position embeddings on queries and keys (Su et al.
  2021, arXiv 2104.09864), base ``rope_theta``, instead of a learned position table;

and ``bias=False`` drops the biases of every linear layer, as Llama does.
:data:`LLAMA_SHAPE` lists the switches of a Llama shape.

- ``attention="naive"`` writes attention out as two matrix products (scores
  ``q @ k^T`` and the weighted sum ``p @ v``) with an explicit softmax, so that
  :class:`torch.utils.flop_counter.FlopCounterMode` sees every FLOP of it (in
  torch 2.13 it counts 0 for the CPU kernel of ``scaled_dot_product_attention``)
  and autograd keeps the score tables Korthikanti et al. count (chapters 3, 13 and 14);
  ``"sdpa"`` calls ``F.scaled_dot_product_attention``, which may pick a fused
  kernel that keeps no score table (chapters 3 and 16);
- ``dropout`` and ``fused_dropout``: dropout on the attention probabilities and
  on each residual branch, as the CPU runs it or as a GPU kernel does (chapter 3);
- ``recompute``: activation checkpointing, of each block's attention core
  (``"selective"``, chapter 3) or of each whole block (``"full"``, chapter 16);
- ``tied``: the head reuses the token embedding's weight;
- ``qk_norm``: a layer norm on each head's queries and keys before their dot
  product (QK-layernorm, Dehghani et al. 2023; Wortsman et al., arXiv
  2309.14322), which bounds the attention scores (chapter 13);
- ``qkv_layout="by_head"`` stores the fused query-key-value matrix head by head,
  as Megatron-LM does, so that splitting its rows into equal contiguous blocks
  gives each tensor-parallel rank whole heads (chapter 17). :func:`gpt` draws
  the same weights either way, so both layouts compute the same function.

:func:`attend` is the attention formula itself, which the tensor-parallel
demonstrations of chapter 8 reuse. :func:`parameter_counts` gives the exact
number of parameters of each part without building the model;
:func:`matmul_weights` the weights that take part in a matrix product for every
token, which is the ``N`` of ``6N`` FLOPs per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from trainscale import _checks
from trainscale.checkpointing import RECOMPUTE

ATTENTION = ("naive", "sdpa")
"""Ways to compute attention: the explicit softmax, or ``scaled_dot_product_attention``."""

QKV_LAYOUTS = ("blocked", "by_head")
"""How the rows of the fused ``qkv`` projection are ordered: all queries, then all keys,
then all values; or head by head (a head's query, key and value rows together; with
grouped-query attention, group by group: the group's query heads, then its key and value)."""

MLPS = ("gelu", "swiglu")
"""The MLP: ``d_model -> d_ff``, GELU, ``d_ff -> d_model``; or SwiGLU's gated three matrices."""

NORMS = ("layernorm", "rmsnorm")
"""The normalisation of each block and of the final stream."""

POSITIONS = ("learned", "rope")
"""Where positions enter: a learned table added to the token embeddings, or rotary
embeddings applied to every block's queries and keys."""

LLAMA_SHAPE = {"mlp": "swiglu", "norm": "rmsnorm", "position": "rope", "bias": False}
"""The switches of a Llama-shaped :class:`GPTConfig` (with its own ``kv_heads``, ``d_ff``
and ``rope_theta``), untied (``tied=False``)."""

NORM_EPS = 1e-5
"""Both norms' epsilon, LayerNorm's default and Llama's RMSNorm's."""


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a :class:`GPT` and how it runs.

    ``vocab`` tokens, sequences of up to ``context`` tokens, width ``d_model``,
    ``layers`` blocks of ``heads`` attention heads (``d_model`` must divide by
    ``heads``), an MLP of ``d_ff`` hidden features (``4 * d_model`` when left at
    0), and a head tied to the token embedding when ``tied``. ``attention`` is one
    of :data:`ATTENTION`, ``recompute`` one of :data:`RECOMPUTE` (``"selective"``
    needs ``attention="naive"``: the fused kernel keeps no score table to save).
    ``dropout`` in ``[0, 1)`` is applied in training mode to the attention
    probabilities and to the output of each residual branch;
    ``fused_dropout=True`` runs it as ``torch.native_dropout``, which keeps a
    1-byte mask per element, as on a GPU, instead of one in the activations' dtype.
    ``qk_norm=True`` adds a layer norm (weight and bias over one head's
    ``d_model / heads`` features) on the queries and one on the keys of every block.
    ``qkv_layout`` is one of :data:`QKV_LAYOUTS`. ``kv_heads`` (0: ``heads``) must
    divide ``heads``; ``mlp``, ``norm`` and ``position`` are one of :data:`MLPS`,
    :data:`NORMS` and :data:`POSITIONS`; ``rope_theta`` is the rotary base (used with
    ``position="rope"``); ``bias`` gives every linear layer but the head a bias.
    """

    vocab: int = 64
    context: int = 64
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    d_ff: int = 0
    tied: bool = True
    attention: str = "naive"
    dropout: float = 0.0
    fused_dropout: bool = False
    recompute: str = "none"
    qk_norm: bool = False
    qkv_layout: str = "blocked"
    kv_heads: int = 0
    mlp: str = "gelu"
    norm: str = "layernorm"
    position: str = "learned"
    rope_theta: float = 10_000.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab", "context", "d_model", "layers", "heads"):
            _checks.count(name, getattr(self, name), minimum=1)
        _checks.count("d_ff", self.d_ff)
        if self.d_model % self.heads:
            raise ValueError(f"heads must divide d_model = {self.d_model}, got {self.heads!r}")
        _checks.boolean("tied", self.tied)
        _checks.choice("attention", self.attention, ATTENTION)
        if _checks.fraction("dropout", self.dropout) == 1.0:
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        _checks.boolean("fused_dropout", self.fused_dropout)
        _checks.choice("recompute", self.recompute, RECOMPUTE)
        _checks.boolean("qk_norm", self.qk_norm)
        _checks.choice("qkv_layout", self.qkv_layout, QKV_LAYOUTS)
        if self.heads % (_checks.count("kv_heads", self.kv_heads) or self.heads):
            raise ValueError(f"kv_heads must divide heads = {self.heads}, got {self.kv_heads!r}")
        _checks.choice("mlp", self.mlp, MLPS)
        _checks.choice("norm", self.norm, NORMS)
        _checks.choice("position", self.position, POSITIONS)
        _checks.positive("rope_theta", self.rope_theta)
        if self.position == "rope" and (self.d_model // self.heads) % 2:
            raise ValueError(
                f"position='rope' needs an even head width, got d_model / heads = "
                f"{self.d_model // self.heads}"
            )
        _checks.boolean("bias", self.bias)
        if self.recompute == "selective" and self.attention != "naive":
            raise ValueError(
                f"recompute='selective' needs attention='naive', got {self.attention!r}"
            )

    @property
    def hidden(self) -> int:
        """Hidden features of each MLP: ``d_ff``, or ``4 * d_model`` if it is 0."""
        return self.d_ff or 4 * self.d_model

    @property
    def groups(self) -> int:
        """Key-value heads: ``kv_heads``, or ``heads`` (multi-head attention) if it is 0."""
        return self.kv_heads or self.heads

    @property
    def head_width(self) -> int:
        """Features of one head, ``d_model / heads``."""
        return self.d_model // self.heads

    @property
    def qkv_rows(self) -> int:
        """Output features of the fused ``qkv`` projection: ``(heads + 2 kv_heads)`` heads."""
        return (self.heads + 2 * self.groups) * self.head_width


def _check_config(config: object) -> GPTConfig:
    if not isinstance(config, GPTConfig):
        raise ValueError(f"config must be a GPTConfig, got {type(config).__name__}")
    return config


def norm(config: GPTConfig, features: int) -> nn.Module:
    """The config's normalisation over ``features``: ``nn.LayerNorm`` or ``nn.RMSNorm``."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(features, eps=NORM_EPS)
    return nn.LayerNorm(features)


# --- attention ---------------------------------------------------------------------------


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` (``(..., seq, head width)``) at ``positions``
    (``seq`` token indices): each pair of features ``(2i, 2i + 1)`` is turned by the
    angle ``position * theta ** (-2i / head width)`` (Su et al. 2021; the pairing of
    Meta's Llama code). The dot product of a rotated query and key then depends on their
    positions only through their difference."""
    width = x.shape[-1]
    exponents = torch.arange(0, width, 2, device=x.device, dtype=torch.float32) / width
    angles = positions.to(torch.float32)[:, None] * theta**-exponents
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def dropout(x: torch.Tensor, p: float, training: bool, fused: bool = False) -> torch.Tensor:
    """Dropout with probability ``p`` in training mode, as ``F.dropout`` runs it here
    or (``fused=True``) as the fused kernel does; ``x`` itself otherwise.

    On the CPU ``F.dropout`` multiplies by a mask of the input's own dtype and
    autograd saves that mask (2 bytes per element in bf16). On a GPU it calls
    ``torch.native_dropout``, whose saved mask is a bool tensor: 1 byte per
    element. ``fused=True`` calls ``native_dropout`` on any device.
    """
    if not training or p == 0.0:
        return x
    if fused:
        return torch.native_dropout(x, p, True)[0]
    return F.dropout(x, p, training=True)


def causal_mask(seq: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """``seq x seq``: 0 where token ``t`` may look (tokens ``0..t``), ``-inf`` above.

    Added to the scores rather than written in with ``masked_fill``, so autograd
    keeps no mask for backward (adding a constant needs nothing saved).
    """
    future = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(seq, seq, dtype=dtype, device=device).masked_fill(future, float("-inf"))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    kind: str = "naive",
    dropout_p: float = 0.0,
    training: bool = False,
    fused_dropout: bool = False,
) -> torch.Tensor:
    """Scaled dot-product attention over ``(..., heads, seq, head width)`` tensors.

    ``softmax(q k^T / sqrt(head width) + mask) v``, with the causal mask of
    :func:`causal_mask` when ``causal`` and dropout of probability ``dropout_p`` on the
    probabilities in ``training`` mode. ``kind="naive"`` writes it out, so autograd
    keeps the softmax output (and, after dropout, its mask and the dropped-out
    probabilities), each ``heads x seq x seq`` per sequence; ``kind="sdpa"`` calls
    ``F.scaled_dot_product_attention`` (``fused_dropout`` does not apply to it).
    """
    _checks.choice("kind", kind, ATTENTION)
    if kind == "sdpa":
        onednn = torch._C._get_mkldnn_enabled()
        if _packs_beyond_capability(q):
            torch._C._set_mkldnn_enabled(False)
        try:
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p if training else 0.0, is_causal=causal
            )
        finally:
            torch._C._set_mkldnn_enabled(onednn)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores + causal_mask(scores.shape[-1], scores.dtype, scores.device)
    return dropout(scores.softmax(dim=-1), dropout_p, training, fused_dropout) @ v


def _packs_beyond_capability(q: torch.Tensor) -> bool:
    """Whether torch 2.13's CPU flash attention would fail on ``q``: for bf16 and fp16 it
    packs its inputs for AMX when the CPU has AMX (through oneDNN), and the packing then
    refuses ("pack_vnni2 is only supported when avx512 is supported") when
    ``ATEN_CPU_CAPABILITY`` holds the kernels below AVX512, as the book's second kernel
    path does. With oneDNN off, the forward takes its other path and autograd keeps the
    same tensors (checked: the same bytes); the backward is unaffected."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.bfloat16, torch.float16)
        and not torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    )


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which token ``t`` sees tokens ``0..t`` only.

    One ``qkv`` projection (``d_model -> 3 d_model``: queries, keys, values, each
    ``heads`` slices of ``d_model / heads`` features, in the order
    ``config.qkv_layout`` says), :func:`attend`, and the output projection ``proj``.

    With ``qkv_layout="by_head"`` the number of heads is read from the
    projection's output width, not from the config: under tensor parallelism a
    rank's share of ``qkv`` produces only its own heads, and the same code runs
    on them. ``attend_fn``, if set, replaces :func:`attend` as ``attend_fn(q, k, v)``
    (causal): chapter 17 sets it to ring attention over a context-parallel group.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.qkv = nn.Linear(config.d_model, config.qkv_rows, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        if config.qk_norm:  # over each head's features, shared by the heads
            self.q_norm = norm(config, config.head_width)
            self.k_norm = norm(config, config.head_width)
        self.attend_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None
        self.attend_fn = None
        self.positions: torch.Tensor | None = None  # of the tokens, for rotary embeddings

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        c = self.config
        share = c.heads // c.groups  # query heads per key-value head
        if c.qkv_layout == "by_head":  # (batch, seq, groups, share + 2, head width)
            fused = self.qkv(x).view(batch, seq, -1, share + 2, c.head_width)
            if share == 1:
                q, k, v = (t.transpose(1, 2) for t in fused.unbind(dim=3))
            else:
                q = fused[:, :, :, :share].flatten(2, 3).transpose(1, 2)
                k, v = (fused[:, :, :, i].transpose(1, 2) for i in (share, share + 1))
        elif share == 1:
            q, k, v = self.qkv(x).split(width, dim=-1)
            # (batch, seq, width) -> (batch, heads, seq, head width)
            q, k, v = (t.view(batch, seq, c.heads, -1).transpose(1, 2) for t in (q, k, v))
        else:
            kv_width = c.groups * c.head_width
            q, k, v = self.qkv(x).split((width, kv_width, kv_width), dim=-1)
            q, k, v = (t.view(batch, seq, -1, c.head_width).transpose(1, 2) for t in (q, k, v))
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if c.position == "rope":
            positions = self.positions
            if positions is None:
                positions = torch.arange(seq, device=x.device)
            q, k = rotate(q, positions, c.rope_theta), rotate(k, positions, c.rope_theta)
        fused_groups = share > 1 and c.attention == "sdpa" and self.attend_fn is None
        if fused_groups and c.recompute != "selective":  # the kernel reads each kv head once
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=c.dropout if self.training else 0.0, is_causal=True,
                enable_gqa=True,
            )  # fmt: skip
            return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))
        if share > 1:  # each key-value head serves its group's query heads
            k, v = k.repeat_interleave(share, dim=1), v.repeat_interleave(share, dim=1)
        options = {
            "kind": c.attention,
            "dropout_p": c.dropout,
            "training": self.training,
            "fused_dropout": c.fused_dropout,
        }
        if self.attend_fn is not None:
            out = self.attend_fn(q, k, v)
        elif c.recompute == "selective":  # Korthikanti et al.'s selective recomputation
            out = checkpoint(attend, q, k, v, use_reentrant=False, **options)
        else:
            out = attend(q, k, v, **options)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class GatedMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, ``d_model -> hidden -> d_model``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.d_model, config.hidden, bias=config.bias)
        self.up = nn.Linear(config.d_model, config.hidden, bias=config.bias)
        self.down = nn.Linear(config.hidden, config.d_model, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """One pre-LN block: ``x + dropout(attention(norm(x)))``, then
    ``x + dropout(mlp(norm(x)))``, on ``(batch, seq, d_model)``; the MLP is
    ``d_model -> hidden``, GELU, ``hidden -> d_model`` (``mlp.0``, ``mlp.2``), or
    :class:`GatedMLP`."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = _check_config(config)
        self.norm1 = norm(config, config.d_model)
        self.attention = CausalSelfAttention(config)
        self.norm2 = norm(config, config.d_model)
        self.mlp: nn.Module
        if config.mlp == "swiglu":
            self.mlp = GatedMLP(config)
        else:
            self.mlp = nn.Sequential(
                nn.Linear(config.d_model, config.hidden, bias=config.bias),
                nn.GELU(),
                nn.Linear(config.hidden, config.d_model, bias=config.bias),
            )

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.config.dropout, self.training, self.config.fused_dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._dropout(self.attention(self.norm1(x)))
        return x + self._dropout(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """A GPT-style decoder: ``tokens`` of shape (batch, seq) -> logits (batch, seq, vocab).

    With ``recompute="full"`` each block runs under ``torch.utils.checkpoint``
    when gradients are on: forward keeps only the block's input, and backward
    runs the block again.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = _check_config(config)
        self.token_embedding = nn.Embedding(config.vocab, config.d_model)
        self.position_embedding: nn.Embedding | None = None
        if config.position == "learned":
            self.position_embedding = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.final_norm = norm(config, config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab, bias=False)
        if config.tied:
            self.head.weight = self.token_embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[-1]
        if not 1 <= seq <= self.config.context:
            raise ValueError(
                f"tokens must hold 1 to context = {self.config.context} positions, got {seq}"
            )
        x = self.token_embedding(tokens)
        if self.position_embedding is not None:
            x = x + self.position_embedding(torch.arange(seq, device=tokens.device))
        recompute = self.config.recompute == "full" and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.head(self.final_norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of predicting ``targets`` (the next tokens) from ``tokens``."""
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def gpt(config: GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> GPT:
    """A freshly initialised :class:`GPT`, the same for the same ``seed``.

    GPT-2's initialisation: every weight matrix and embedding drawn from
    N(0, 0.02²), biases zero, and the two projections that write into the
    residual stream (attention's ``proj`` and the MLP's second layer) scaled
    down by ``sqrt(2 * layers)``, so the residual stream does not grow with depth.
    The weights are drawn in ``dtype``: float32 draws can differ in the last bit
    between CPUs, float64 draws are the same on every CPU (chapter 13 uses them).
    The global random state is left untouched.
    """
    _check_config(config)
    seed = _checks.count("seed", seed)
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config).to(dtype)
        for name, param in model.named_parameters():
            init_parameter(config, name, param)
        if config.qkv_layout == "by_head":
            _store_qkv_by_head(model)
    return model


RESIDUAL_WEIGHTS = ("proj.weight", "mlp.2.weight", "mlp.down.weight")
"""The matrices that write into the residual stream, whose initial spread shrinks with
depth (:func:`init_parameter`)."""


@torch.no_grad()
def init_parameter(
    config: GPTConfig, name: str, param: torch.Tensor, generator: torch.Generator | None = None
) -> None:
    """Draw parameter ``name`` of ``GPT(config)`` in place, by GPT-2's rule: biases 0,
    norm scales 1, the :data:`RESIDUAL_WEIGHTS` from N(0, (0.02 / sqrt(2 layers))²),
    every other matrix and embedding from N(0, 0.02²); from ``generator`` (``None``: the
    global one). :func:`gpt` draws every parameter this way in turn; the capstone draws
    each from a generator of its own (:mod:`trainscale.train.parallelize`)."""
    if name.endswith("bias"):
        nn.init.zeros_(param)
    elif "norm" in name:
        nn.init.ones_(param)
    elif name.endswith(RESIDUAL_WEIGHTS):
        nn.init.normal_(param, std=0.02 / math.sqrt(2 * config.layers), generator=generator)
    else:
        nn.init.normal_(param, std=0.02, generator=generator)


def qkv_by_head_order(d_model: int, heads: int, kv_heads: int = 0) -> torch.Tensor:
    """Row ``i`` of a head-by-head ``qkv`` matrix is row ``order[i]`` of the blocked one.

    Blocked rows are ``[q (d_model), k (d_model), v (d_model)]``, each ``heads``
    runs of ``d_model / heads``; head by head they are ``[q_0, k_0, v_0, q_1, ...]``.
    With ``kv_heads`` key-value heads (0: ``heads``), keys and values have ``kv_heads``
    runs each, and the rows go group by group: the ``heads / kv_heads`` query heads of
    group ``g``, then its key and its value (``[q_0, q_1, k_0, v_0, q_2, ...]`` for 2
    query heads per group), so that an equal contiguous block of rows is whole groups.
    """
    head = d_model // heads
    groups = kv_heads or heads
    share = heads // groups
    q = torch.arange(d_model).view(groups, share * head)
    k = d_model + torch.arange(groups * head).view(groups, head)
    v = d_model + groups * head + torch.arange(groups * head).view(groups, head)
    return torch.cat((q, k, v), dim=1).reshape(-1)


@torch.no_grad()
def _store_qkv_by_head(model: GPT) -> None:
    """Reorder every block's ``qkv`` rows from blocked to head by head, in place."""
    c = model.config
    order = qkv_by_head_order(c.d_model, c.heads, c.kv_heads)
    for block in model.blocks:
        block.attention.qkv.weight.copy_(block.attention.qkv.weight[order])
        if block.attention.qkv.bias is not None:
            block.attention.qkv.bias.copy_(block.attention.qkv.bias[order])


def parameter_counts(config: GPTConfig) -> dict[str, int]:
    """The exact number of parameters of each part of ``GPT(config)``.

    Keys: ``"token embedding"``, ``"position embedding"`` (0 with rotary
    embeddings), ``"attention"`` (query, key, value and output matrices with their
    biases, all layers), ``"mlp"``, ``"layer norms"`` (two per block and the final
    one; a layer norm has a scale and a shift, ``2 d_model``, an RMSNorm a scale) and
    ``"head"`` (0 when tied: it reuses the token embedding). ``qk_norm`` adds two
    norms of one head's width per block to ``"layer norms"``. The values add up
    to ``sum(p.numel() for p in model.parameters())``.
    """
    _check_config(config)
    d, hidden, layers = config.d_model, config.hidden, config.layers
    qkv, bias = config.qkv_rows, int(config.bias)
    matrices = 3 if config.mlp == "swiglu" else 2
    per_norm = 2 if config.norm == "layernorm" else 1
    head_norms = 2 * layers * per_norm * config.head_width if config.qk_norm else 0
    return {
        "token embedding": config.vocab * d,
        "position embedding": config.context * d if config.position == "learned" else 0,
        "attention": layers * (d * qkv + d * d + bias * (qkv + d)),
        "mlp": layers * (matrices * d * hidden + bias * ((matrices - 1) * hidden + d)),
        "layer norms": (2 * layers + 1) * per_norm * d + head_norms,
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
    ``d_ff = 4 * d_model``; with ``kv_heads`` the key and value matrices are
    ``kv_heads / heads`` of that, and SwiGLU has three MLP matrices) and the head
    (``d_model * vocab``, counted even when tied, since the head multiplies by it).
    Embedding look-ups, biases and norms are not matrix products. Each of these
    weights costs 2 FLOPs per token forward and 4 backward.
    """
    _check_config(config)
    d = config.d_model
    matrices = 3 if config.mlp == "swiglu" else 2
    per_layer = d * config.qkv_rows + d * d + matrices * d * config.hidden
    return config.layers * per_layer + d * config.vocab


class TransformerLayer(Block):
    """One :class:`Block`, set up as Korthikanti et al. count it (chapter 3, which reads it
    as :class:`trainscale.checkpointing.TransformerLayer`).

    A pre-LN layer, batch first, ``(batch, seq, hidden)``:
    ``x + dropout(proj(attention(ln(x))))``, then ``+ dropout(mlp(ln(.)))`` with an
    MLP of width ``4 * hidden`` and GELU. ``attention`` is ``"naive"`` (written out,
    so autograd keeps the softmax output, the dropout mask and the dropped-out
    probabilities) or ``"sdpa"`` (``F.scaled_dot_product_attention``, which may
    pick a fused kernel that keeps no score table); ``recompute_attention=True``
    checkpoints the naive attention core, Korthikanti et al.'s *selective*
    recomputation; ``fused_dropout=True`` stores 1-byte dropout masks as GPU
    kernels do. The causal mask is added to the scores, so it keeps nothing.
    Weights are PyTorch's default initialisation drawn from ``seed``, without
    touching the global random state. The dtype is the caller's:
    ``layer.to(torch.bfloat16)``.
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        dropout: float = 0.1,
        attention: str = "naive",
        recompute_attention: bool = False,
        fused_dropout: bool = False,
        seed: int = 0,
    ) -> None:
        h = _checks.count("hidden", hidden, minimum=1)
        if h % _checks.count("heads", heads, minimum=1):
            raise ValueError(f"heads must divide hidden = {h}, got {heads!r}")
        if _checks.boolean("recompute_attention", recompute_attention) and attention != "naive":
            raise ValueError(f"recompute_attention needs attention='naive', got {attention!r}")
        config = GPTConfig(
            d_model=h,
            heads=heads,
            layers=1,
            attention=attention,
            dropout=dropout,
            fused_dropout=_checks.boolean("fused_dropout", fused_dropout),
            recompute="selective" if recompute_attention else "none",
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_checks.count("seed", seed))
            super().__init__(config)
