"""Activation checkpointing: memory traded for recomputation (chapter 09).

Three parts:

- a model of a checkpointed stack of identical blocks, in bytes:
  :func:`segment_memory` (what is stored, and the peak while backward
  recomputes one segment) and :func:`memory_timeline` (saved bytes over a
  whole step), from two measured sizes per block;
- :func:`step_flops`, the matrix-product FLOPs of forward and backward with
  and without checkpointing, counted by ``FlopCounterMode``;
- :class:`TransformerLayer`, a minimal pre-LN transformer layer, with
  :func:`saved_by_op` to list what autograd keeps for it, set beside
  Korthikanti et al.'s estimate :func:`korthikanti_bytes` (arXiv 2205.05198).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from trainscale import _checks
from trainscale.memory import run_checkpointed

# --- a checkpointed stack of blocks, modelled -------------------------------------------


def _stack_args(blocks: int, segment: int | None, block_input: int, block_saved: int):
    n = _checks.count("blocks", blocks, minimum=1)
    k = None if segment is None else _checks.count("segment", segment, minimum=1)
    size_in = _checks.count("block_input", block_input)
    size_saved = _checks.count("block_saved", block_saved)
    if size_saved < size_in:
        raise ValueError(
            f"block_saved must be >= block_input = {size_in} (a block saves its input),"
            f" got {block_saved!r}"
        )
    return n, k, size_in, size_saved


def memory_timeline(
    blocks: int, segment: int | None, block_input: int, block_saved: int
) -> list[tuple[float, int]]:
    """Bytes of saved activations over one training step, as ``(time, bytes)`` points.

    The model is a stack of ``blocks`` identical blocks. Without checkpointing
    (``segment=None``) each block keeps ``block_saved`` bytes, its input
    (``block_input`` bytes) included, until backward has used them. With
    checkpointing, consecutive blocks form segments of ``segment`` blocks (the
    last may be shorter); forward keeps only each segment's input, and backward,
    segment by segment from the last, first recomputes the segment's forward
    (which saves what a plain forward would) and then runs its backward.

    Time is counted in forward passes of one block; the backward of a block
    is taken to cost two (chapter 1). Only the activations are modelled; weights,
    gradients and the short-lived temporaries of each operation are not.
    """
    n, k, size_in, size_saved = _stack_args(blocks, segment, block_input, block_saved)
    time, held = 0.0, 0
    points = [(time, held)]
    if k is None:
        for _ in range(n):
            time, held = time + 1, held + size_saved
            points.append((time, held))
        for _ in range(n):
            time, held = time + 2, held - size_saved
            points.append((time, held))
        return points
    starts = list(range(0, n, k))
    for start in starts:  # forward: store each segment's input, drop the rest
        held += size_in
        points.append((time, held))
        time += min(k, n - start)
        points.append((time, held))
    for start in reversed(starts):
        length = min(k, n - start)
        for block in range(length):  # recompute the segment's forward
            time += 1
            held += size_saved - (size_in if block == 0 else 0)
            points.append((time, held))
        for _ in range(length):  # its backward frees block after block
            time += 2
            held -= size_saved
            points.append((time, held))
    return points


@dataclass(frozen=True)
class SegmentMemory:
    """Checkpointing a stack in segments, in bytes: what forward ``stored`` (segment
    inputs), the most that recomputing one segment adds (``recomputed``), the
    ``peak`` of the whole step, and ``extra_forward``, the share of one forward pass
    that backward runs again."""

    stored: int
    recomputed: int
    peak: int
    extra_forward: float


def segment_memory(
    blocks: int, segment: int | None, block_input: int, block_saved: int
) -> SegmentMemory:
    """Stored inputs, one segment's recomputation and the peak (see :func:`memory_timeline`).

    With ``segment = k`` dividing ``blocks = n`` the peak is
    ``(n / k) * block_input + k * block_saved - block_input``: every segment's
    input, plus the last segment recomputed (its own input counted once).
    Without checkpointing (``segment=None``) it is ``n * block_saved`` and
    nothing is recomputed. With checkpointing every block is recomputed once,
    whatever ``k``: one extra forward pass.
    """
    n, k, size_in, size_saved = _stack_args(blocks, segment, block_input, block_saved)
    if k is None:
        peak = n * size_saved
        return SegmentMemory(stored=peak, recomputed=0, peak=peak, extra_forward=0.0)
    segments = math.ceil(n / k)
    last = n - (segments - 1) * k  # the last segment may be shorter
    # While segment j (0-based) is recomputed, the inputs of segments 0..j are stored.
    # The peak comes with the last segment or with the last full one before it.
    at_last = segments * size_in + last * size_saved - size_in
    at_full = (segments - 1) * size_in + k * size_saved - size_in if segments > 1 else 0
    return SegmentMemory(
        stored=segments * size_in,
        recomputed=min(k, n) * size_saved - size_in,
        peak=max(at_last, at_full),
        extra_forward=1.0,
    )


def best_segment(blocks: int, block_input: int, block_saved: int) -> int:
    """The segment length with the smallest peak (the shortest if several tie).

    For ``n`` blocks whose saved activations are the size of their input, this is
    about ``sqrt(n)`` (Chen et al.'s rule); the larger a block's activations
    are against its input, the shorter the best segment.
    """
    n, _, size_in, size_saved = _stack_args(blocks, 1, block_input, block_saved)
    return min(range(1, n + 1), key=lambda k: (segment_memory(n, k, size_in, size_saved).peak, k))


# --- counted FLOPs ----------------------------------------------------------------------


def step_flops(model: nn.Module, x: torch.Tensor, segment: int | None = None) -> dict[str, int]:
    """Matrix-product FLOPs of one forward and one backward pass of ``model`` on ``x``.

    The loss is the mean square of the output. With ``segment`` the model (then an
    ``nn.Sequential`` of blocks) runs through
    :func:`trainscale.memory.run_checkpointed`, so the backward count includes
    the recomputed forward. Gradients are taken for the parameters only, with
    ``torch.autograd.grad``; the model's ``.grad`` fields are left alone.
    Returns ``{"forward": ..., "backward": ...}``.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if segment is not None and not isinstance(model, nn.Sequential):
        raise ValueError(
            f"model must be an nn.Sequential of blocks to checkpoint, got {type(model).__name__}"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    with FlopCounterMode(display=False) as forward:
        out = model(x) if segment is None else run_checkpointed(model, x, segment)
        loss = out.float().pow(2).mean()
    with FlopCounterMode(display=False) as backward:
        torch.autograd.grad(loss, params)
    return {"forward": forward.get_total_flops(), "backward": backward.get_total_flops()}


# --- one transformer layer --------------------------------------------------------------


def attention_core(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout: float,
    training: bool,
    fused_dropout: bool = False,
) -> torch.Tensor:
    """Naive attention: ``dropout(softmax(q k^T / sqrt(d))) v`` over (batch, heads, seq, d).

    Written out so that autograd saves what the textbook formula implies: the
    softmax output and, after dropout, its mask and the dropped-out
    probabilities, each ``batch x heads x seq x seq``.
    """
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    return _dropout(scores.softmax(dim=-1), dropout, training, fused_dropout) @ v


def _dropout(x: torch.Tensor, p: float, training: bool, fused: bool) -> torch.Tensor:
    """Dropout as ``F.dropout`` runs it on this device, or as the fused kernel does.

    On the CPU ``F.dropout`` multiplies by a mask of the input's own dtype and
    autograd saves that mask (2 bytes per element in bf16). On a GPU it calls
    ``torch.native_dropout``, whose saved mask is a bool tensor: 1 byte per
    element. ``fused=True`` calls ``native_dropout`` here too.
    """
    if not training or p == 0.0:
        return x
    if fused:
        return torch.native_dropout(x, p, True)[0]
    return F.dropout(x, p, training=True)


class TransformerLayer(nn.Module):
    """A minimal pre-LN transformer layer, batch first: ``(batch, seq, hidden)``.

    ``x + dropout(proj(attention(ln1(x))))``, then ``+ dropout(fc2(gelu(fc1(ln2(.)))))``,
    the layer Korthikanti et al. count, with no causal mask (a mask changes which
    scores count, not the activations' sizes). ``attention`` is ``"naive"``
    (:func:`attention_core`) or ``"sdpa"`` (``F.scaled_dot_product_attention``,
    which may pick a fused kernel that keeps no score matrix);
    ``recompute_attention=True`` checkpoints the naive attention core, Korthikanti
    et al.'s *selective* recomputation; ``fused_dropout=True`` stores 1-byte
    dropout masks as GPU kernels do. Weights come from ``seed`` without touching
    the global random state. The dtype is the caller's: ``layer.to(torch.bfloat16)``.
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
        super().__init__()
        h = _checks.count("hidden", hidden, minimum=1)
        self.heads = _checks.count("heads", heads, minimum=1)
        if h % self.heads:
            raise ValueError(f"heads must divide hidden = {h}, got {heads!r}")
        self.p = _checks.fraction("dropout", dropout)
        if self.p == 1.0:
            raise ValueError(f"dropout must be a number in [0, 1), got {dropout!r}")
        self.attention = _checks.choice("attention", attention, ("naive", "sdpa"))
        for name, flag in (
            ("recompute_attention", recompute_attention),
            ("fused_dropout", fused_dropout),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if recompute_attention and attention != "naive":
            raise ValueError("recompute_attention needs attention='naive', got 'sdpa'")
        self.recompute_attention = recompute_attention
        self.fused_dropout = fused_dropout
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_checks.count("seed", seed))
            self.ln1 = nn.LayerNorm(h)
            self.qkv = nn.Linear(h, 3 * h)
            self.proj = nn.Linear(h, h)
            self.ln2 = nn.LayerNorm(h)
            self.fc1 = nn.Linear(h, 4 * h)
            self.fc2 = nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        p, training, fused = self.p, self.training, self.fused_dropout
        q, k, v = self.qkv(self.ln1(x)).split(hidden, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            context = F.scaled_dot_product_attention(q, k, v, dropout_p=p if training else 0.0)
        elif self.recompute_attention:
            context = checkpoint(attention_core, q, k, v, p, training, fused, use_reentrant=False)
        else:
            context = attention_core(q, k, v, p, training, fused)
        context = context.transpose(1, 2).reshape(batch, seq, hidden)
        x = x + _dropout(self.proj(context), p, training, fused)
        mlp = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x + _dropout(mlp, p, training, fused)


def korthikanti_terms(seq: int, batch: int, hidden: int, heads: int) -> dict[str, int]:
    """Korthikanti et al.'s activation bytes of one layer, part by part (16-bit
    activations, 1-byte dropout masks, no parallelism, no recomputation).

    - attention: ``11 s b h + 5 a s^2 b`` (QKV input 2sbh, Q and K 4sbh, V 2sbh,
      softmax output 2as²b, its dropout mask as²b and output 2as²b, projection
      input 2sbh, dropout mask sbh);
    - MLP: ``19 s b h`` (input 2sbh, GELU input 8sbh, GELU output 8sbh, mask sbh);
    - layer norms: ``4 s b h`` (each saves its 2sbh input).
    """
    s, b, h, a = (
        _checks.count(name, value, minimum=1)
        for name, value in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads))
    )
    return {
        "attention": 11 * s * b * h + 5 * a * s * s * b,
        "MLP": 19 * s * b * h,
        "layer norms": 4 * s * b * h,
    }


def korthikanti_bytes(seq: int, batch: int, hidden: int, heads: int) -> int:
    """``s b h (34 + 5 a s / h)`` bytes: one layer's activations in 16-bit."""
    return sum(korthikanti_terms(seq, batch, hidden, heads).values())


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd keeps: the backward ``op`` that keeps it, the ``slot``
    it is kept in, its ``shape`` and ``dtype``, and the ``nbytes`` of its storage."""

    op: str
    slot: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def saved_by_op(output: torch.Tensor, exclude: set[int] | None = None) -> list[SavedTensor]:
    """Every tensor the autograd graph behind ``output`` keeps, named by its op.

    Walks the graph from ``output.grad_fn`` and reads each node's ``_saved_*``
    slots, in the order forward created the ops. A storage kept twice (the
    output of one op is often the saved input of the next, and views share their
    base's storage) is listed once, where it is first kept. Storages in
    ``exclude`` (pass the parameters' ``untyped_storage().data_ptr()``) and
    0-dimensional tensors (saved scalars) are skipped. Do not call it on a
    checkpointed graph: reading a slot there runs the recomputation. The total equals
    :func:`trainscale.memory.saved_activation_bytes` for the same forward.
    """
    if not isinstance(output, torch.Tensor) or output.grad_fn is None:
        raise ValueError("output must be a tensor produced by a forward pass with autograd")
    skip = set(exclude or ())
    nodes: dict[int, object] = {}
    stack = [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in nodes:
            continue
        nodes[id(node)] = node
        stack.extend(next_node for next_node, _ in node.next_functions)
    rows: list[SavedTensor] = []
    seen: set[int] = set()
    for node in sorted(nodes.values(), key=lambda n: n._sequence_nr()):  # forward order
        for slot in sorted(a for a in dir(node) if a.startswith("_saved_")):
            value = getattr(node, slot)
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            storage = value.untyped_storage()
            pointer = storage.data_ptr()
            if pointer in skip or pointer in seen:
                continue
            seen.add(pointer)
            rows.append(
                SavedTensor(
                    node.name(),
                    slot.removeprefix("_saved_"),
                    tuple(value.shape),
                    value.dtype,
                    storage.nbytes(),
                )
            )
    return rows
