"""Activation checkpointing: memory traded for recomputation (chapter 3).

Four parts:

- a model of a checkpointed stack of identical blocks, in bytes:
  :func:`segment_memory` (what is stored, and the peak while backward
  recomputes one segment) and :func:`memory_timeline` (saved bytes over a
  whole step), from two measured sizes per block;
- :func:`step_flops`, the matrix-product FLOPs of forward and backward with
  and without checkpointing, counted by ``FlopCounterMode``, and
  :func:`step_operator_calls`, the operators the same step calls;
- :class:`TransformerLayer` (kept in :mod:`trainscale.transformer`, read here), the book's
  transformer block as chapter 3 measures it, with
  :func:`saved_by_op` to list what autograd keeps for it, set beside
  Korthikanti et al.'s estimate :func:`korthikanti_bytes` (arXiv 2205.05198);
- Korthikanti et al.'s table of what a layer keeps (:data:`ACTIVATION_PARTS`),
  with tensor and sequence parallelism and the recomputation modes
  (:func:`layer_activation_bytes`, :data:`RECOMPUTE`), and the FLOPs selective
  recomputation adds (:func:`selective_recompute_flops`), which chapter 16's
  planner composes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from trainscale import _checks
from trainscale.memory import run_checkpointed

if TYPE_CHECKING:  # torch runs only where tensors do: the activation formulas need none
    import torch
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode

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


def _check_step_model(model: object, segment: int | None) -> nn.Module:
    from torch import nn

    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    if segment is not None and not isinstance(model, nn.Sequential):
        raise ValueError(
            f"model must be an nn.Sequential of blocks to checkpoint, got {type(model).__name__}"
        )
    return model


def _count_step(
    model: nn.Module,
    x: torch.Tensor,
    segment: int | None,
    counter: Callable[[], TorchDispatchMode],
) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """Run one forward and one backward of ``model`` on ``x``, each under a fresh
    ``counter()`` (a ``TorchDispatchMode``), and return the two counters."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    with counter() as forward:
        out = model(x) if segment is None else run_checkpointed(model, x, segment)
        loss = out.float().pow(2).mean()
    with counter() as backward:
        torch.autograd.grad(loss, params)
    return forward, backward


def step_flops(model: nn.Module, x: torch.Tensor, segment: int | None = None) -> dict[str, int]:
    """Matrix-product FLOPs of one forward and one backward pass of ``model`` on ``x``.

    The loss is the mean square of the output. With ``segment`` the model (then an
    ``nn.Sequential`` of blocks) runs through
    :func:`trainscale.memory.run_checkpointed`, so the backward count includes
    the recomputed forward. Gradients are taken for the parameters only, with
    ``torch.autograd.grad``; the model's ``.grad`` fields are left alone.
    FLOPs are torch's ``FlopCounterMode``'s: matrix products only, 2 per
    multiply-add. Returns ``{"forward": ..., "backward": ...}``.
    """
    from torch.utils.flop_counter import FlopCounterMode

    model = _check_step_model(model, segment)
    forward, backward = _count_step(model, x, segment, lambda: FlopCounterMode(display=False))
    return {"forward": forward.get_total_flops(), "backward": backward.get_total_flops()}


def _operator_counter() -> TorchDispatchMode:
    """A ``TorchDispatchMode`` whose ``calls`` counts every ATen operator call that reaches
    the dispatcher's Python mode (a class made here, so that importing this module needs
    no torch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OperatorCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    return OperatorCounter()


def step_operator_calls(
    model: nn.Module, x: torch.Tensor, segment: int | None = None
) -> dict[str, int]:
    """The ATen operator calls of one forward and one backward pass of ``model`` on ``x``.

    The same step as :func:`step_flops` (mean-square loss, parameter gradients,
    ``segment`` for checkpointing), counted in operator calls rather than FLOPs:
    every matrix product, element-wise operation, reduction, view and copy that
    reaches the dispatcher counts 1, whatever its size. Each call has a fixed
    cost on the host (Python, the dispatcher, autograd's bookkeeping; on a GPU,
    a kernel launch), so for small tensors the time of a step depends on this count
    more than on the FLOPs. Returns ``{"forward": ..., "backward": ...}``.
    """
    model = _check_step_model(model, segment)
    forward, backward = _count_step(model, x, segment, _operator_counter)
    return {"forward": forward.calls, "backward": backward.calls}


# --- one transformer layer --------------------------------------------------------------


def __getattr__(name: str) -> object:
    """:class:`TransformerLayer`, from :mod:`trainscale.transformer` when first asked for:
    a torch module, so that the formulas here import without torch."""
    if name == "TransformerLayer":
        from trainscale.transformer import TransformerLayer

        return TransformerLayer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation modes (:mod:`trainscale.transformer`'s model runs them): keep
everything; recompute only the attention scores (Korthikanti et al.'s *selective*
recomputation, which is also what FlashAttention does inside its kernel); keep only each
layer's input and rerun its forward pass during backward (*full* recomputation)."""


class ActivationPart(NamedTuple):
    """One row of Korthikanti et al.'s count: what a layer keeps, in bytes per
    ``s b h`` and per ``a s^2 b``, whether tensor parallelism splits it, the
    ``block`` of the layer it belongs to, and what its size follows when the layer
    is not GPT-shaped (``scales_with``, one of :data:`SCALES_WITH`; see
    :func:`layer_activation_bytes`)."""

    what: str
    per_sbh: int
    per_as2b: int
    split_by_tp: bool
    block: str
    scales_with: str = "hidden"


SCALES_WITH = ("hidden", "queries and keys", "kv heads", "mlp input", "mlp output", "dropout")
"""What each row of :data:`ACTIVATION_PARTS` grows with beyond ``s b h`` (see
:func:`layer_activation_bytes`): the hidden size alone; queries (``heads``) and
keys (``kv_heads``); the key/value heads; the MLP's hidden width, twice when it is
gated (``mlp input``) or once (``mlp output``); or whether the layer uses dropout."""


ACTIVATION_PARTS: tuple[ActivationPart, ...] = (
    ActivationPart("layer-norm output, input of the QKV projection", 2, 0, False, "attention"),
    ActivationPart(
        "queries and keys, inputs of Q K^T", 4, 0, True, "attention", "queries and keys"
    ),
    ActivationPart("softmax output", 0, 2, True, "attention"),
    ActivationPart("attention dropout mask", 0, 1, True, "attention", "dropout"),
    ActivationPart("attention dropout output, input of scores x V", 0, 2, True, "attention"),
    ActivationPart("values", 2, 0, True, "attention", "kv heads"),
    ActivationPart("input of the output projection", 2, 0, True, "attention"),
    ActivationPart("attention-block dropout mask", 1, 0, False, "attention", "dropout"),
    ActivationPart("layer-norm output, input of the first linear layer", 2, 0, False, "MLP"),
    ActivationPart("GELU input", 8, 0, True, "MLP", "mlp input"),
    ActivationPart(
        "GELU output, input of the second linear layer", 8, 0, True, "MLP", "mlp output"
    ),
    ActivationPart("MLP dropout mask", 1, 0, False, "MLP", "dropout"),
    ActivationPart("inputs of the two layer norms", 4, 0, False, "layer norms"),
)
"""What one GPT-style transformer layer keeps for backward, per Korthikanti et al.
(arXiv 2205.05198, section 4.1), in 16-bit activations with 1-byte dropout masks.

The rows add up to ``34 s b h + 5 a s^2 b`` bytes, the paper's ``sbh(34 + 5as/h)``,
for sequence length ``s``, micro-batch ``b``, hidden size ``h`` and ``a`` heads:
``11 sbh + 5 as^2b`` in the attention block, ``19 sbh`` in the MLP and ``4 sbh``
for the layer norms. Tensor parallelism splits the rows inside the attention and
MLP blocks by ``t`` (the ``24 s b h`` and the ``5 a s^2 b``); the other ``10 s b h``
stay whole on every TP rank unless sequence parallelism splits them along the
sequence too. The one table behind :func:`korthikanti_terms`,
:func:`layer_activation_bytes` and the planner of chapter 16."""


def _layer_sizes(seq_len: int, micro_batch: int, hidden: int, heads: int) -> tuple[int, int]:
    """``(s b h, a s^2 b)`` after checking each argument is a whole number >= 1."""
    s = _checks.count("seq_len", seq_len, minimum=1)
    b = _checks.count("micro_batch", micro_batch, minimum=1)
    h = _checks.count("hidden", hidden, minimum=1)
    a = _checks.count("heads", heads, minimum=1)
    return s * b * h, a * s * s * b


def korthikanti_terms(seq_len: int, micro_batch: int, hidden: int, heads: int) -> dict[str, int]:
    """Korthikanti et al.'s activation bytes of one layer, block by block (16-bit
    activations, 1-byte dropout masks, no parallelism, no recomputation).

    Sums of :data:`ACTIVATION_PARTS`:

    - attention: ``11 s b h + 5 a s^2 b`` (QKV input 2sbh, Q and K 4sbh, V 2sbh,
      softmax output 2as²b, its dropout mask as²b and output 2as²b, projection
      input 2sbh, dropout mask sbh);
    - MLP: ``19 s b h`` (input 2sbh, GELU input 8sbh, GELU output 8sbh, mask sbh);
    - layer norms: ``4 s b h`` (each saves its 2sbh input).
    """
    sbh, as2b = _layer_sizes(seq_len, micro_batch, hidden, heads)
    terms: dict[str, int] = {}
    for part in ACTIVATION_PARTS:
        terms[part.block] = terms.get(part.block, 0) + part.per_sbh * sbh + part.per_as2b * as2b
    return terms


def korthikanti_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int) -> int:
    """``s b h (34 + 5 a s / h)`` bytes: one layer's activations in 16-bit.

    The same as :func:`layer_activation_bytes` with ``tp=1`` and no recomputation.
    """
    return sum(korthikanti_terms(seq_len, micro_batch, hidden, heads).values())


@dataclass(frozen=True)
class LayerShape:
    """What a layer's activations depend on beyond GPT's shape (chapter 16's planner).

    ``kv_heads`` (grouped-query attention, Ainslie et al. 2023; ``None``: one per query
    head), ``ffn_hidden`` (the MLP's hidden width; ``None``: ``4 hidden``),
    ``gated_mlp`` (SwiGLU, Shazeer 2020: two input matrices), ``fused_attention``
    (a FlashAttention kernel, Dao et al. 2022, arXiv 2205.14135: no ``s x s``
    table is kept) and ``dropout`` (whether the layer has dropout at all; Llama's
    do not).
    """

    kv_heads: int | None = None
    ffn_hidden: int | None = None
    gated_mlp: bool = False
    fused_attention: bool = False
    dropout: bool = True


def _scale(part: ActivationPart, heads: int, hidden: int, shape: LayerShape) -> float:
    """How much larger than in a GPT layer one row of :data:`ACTIVATION_PARTS` is."""
    kv = (shape.kv_heads or heads) / heads
    mlp = (shape.ffn_hidden or 4 * hidden) / (4 * hidden)
    if part.scales_with == "queries and keys":
        return (1 + kv) / 2
    if part.scales_with == "kv heads":
        return kv
    if part.scales_with == "mlp input":
        return mlp * (2 if shape.gated_mlp else 1)
    if part.scales_with == "mlp output":
        return mlp
    if part.scales_with == "dropout":
        return 1.0 if shape.dropout else 0.0
    return 1.0


def _layer_shape(kv_heads, ffn_hidden, gated_mlp, fused_attention, dropout, heads) -> LayerShape:
    if kv_heads is not None:
        kv_heads = _checks.count("kv_heads", kv_heads, minimum=1)
        if heads % kv_heads:
            raise ValueError(f"kv_heads must divide heads ({heads}), got {kv_heads}")
    if ffn_hidden is not None:
        ffn_hidden = _checks.count("ffn_hidden", ffn_hidden, minimum=1)
    return LayerShape(
        kv_heads=kv_heads,
        ffn_hidden=ffn_hidden,
        gated_mlp=_checks.boolean("gated_mlp", gated_mlp),
        fused_attention=_checks.boolean("fused_attention", fused_attention),
        dropout=_checks.boolean("dropout", dropout),
    )


def layer_activation_bytes(
    seq_len: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    *,
    kv_heads: int | None = None,
    ffn_hidden: int | None = None,
    gated_mlp: bool = False,
    fused_attention: bool = False,
    dropout: bool = True,
    keep_gathered_inputs: bool = False,
) -> float:
    """Bytes one transformer layer keeps for backward on one GPU (Korthikanti et al.).

    With ``s = seq_len``, ``b = micro_batch``, ``h = hidden``, ``a = heads`` and
    ``t = tp`` this is the paper's Table 2 (arXiv 2205.05198), summed from
    :data:`ACTIVATION_PARTS`:

    * no parallelism: ``sbh (34 + 5as/h)``;
    * tensor parallelism: ``sbh (10 + 24/t + 5as/(ht))``;
    * tensor and sequence parallelism: ``sbh (34/t + 5as/(ht))``;
    * selective recomputation drops the ``5as/h`` term (the attention scores are
      recomputed): ``sbh (10 + 24/t)``, or ``sbh 34/t`` with sequence parallelism;
    * full recomputation keeps only the layer's 16-bit input: ``2 sbh``, or
      ``2 sbh / t`` with sequence parallelism, which shards that input along the
      sequence (as Megatron-LM stores it).

    The keyword arguments describe layers that are not GPT-shaped (defaults: GPT's),
    each row of :data:`ACTIVATION_PARTS` scaled by what it holds (``scales_with``):

    * ``kv_heads``: grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245)
      keeps keys and values for ``kv_heads`` heads only, so the ``2 sbh`` of keys and
      the ``2 sbh`` of values shrink by ``kv_heads / heads`` (queries stay ``2 sbh``);
    * ``ffn_hidden``: the MLP's two rows of ``8 sbh`` (``2 x 4h`` bytes per token)
      scale with ``ffn_hidden / (4 h)``; ``gated_mlp`` (SwiGLU, Shazeer 2020, arXiv
      2002.05202) keeps both input projections (gate and up) and their product, the
      input of the output projection: three ``2 ffn_hidden`` rows per token;
    * ``fused_attention``: a FlashAttention kernel (Dao et al. 2022, arXiv
      2205.14135, section 3.1) keeps no ``s x s`` softmax, mask or dropout output
      (its backward recomputes them from Q, K, V and a per-row statistic); it keeps
      that statistic, one fp32 number per head and token, ``4 a s b`` bytes, split
      by TP. Selective recomputation then changes nothing;
    * ``dropout=False``: a layer without dropout (Llama's) keeps no 1-byte masks.

    Full recomputation keeps the layer's input whatever its shape.

    ``keep_gathered_inputs`` (only with ``sequence_parallel=True``) says *how*
    sequence parallelism is run. The paper's ``34/t`` (section 4.2.2) and Megatron-LM
    keep only each rank's ``s/t`` shard of the two layer-norm outputs that feed the
    column-parallel products, and all-gather it again in backward for the weight
    gradients (:data:`ACTIVATION_PARTS`' two ``"layer-norm output, input of ..."``
    rows, split by ``t``). PyTorch's DTensor plan (``SequenceParallel`` with
    ``PrepareModuleInput``, torchtitan's) keeps the all-gathered input itself, whole:
    those two ``2 sbh`` rows are then kept whole, ``4 sbh (1 - 1/t)`` more, so a GPT
    layer with the scores recomputed keeps ``sbh (4 + 30/t)`` instead of ``34 sbh/t``.
    """
    sbh, as2b = _layer_sizes(seq_len, micro_batch, hidden, heads)
    t = _checks.count("tp", tp, minimum=1)
    sp = _checks.boolean("sequence_parallel", sequence_parallel)
    mode = str(_checks.choice("recompute", recompute, RECOMPUTE))
    shape = _layer_shape(kv_heads, ffn_hidden, gated_mlp, fused_attention, dropout, heads)
    keep_gathered = _checks.boolean("keep_gathered_inputs", keep_gathered_inputs)
    if keep_gathered and not sp:
        raise ValueError(
            "keep_gathered_inputs applies only with sequence_parallel=True (without it"
            " the inputs are whole anyway), got keep_gathered_inputs=True"
        )
    if mode == "full":
        return 2 * sbh / (t if sp else 1)
    scores = 0 if mode == "selective" or shape.fused_attention else as2b
    total = 4 * heads * seq_len * micro_batch / t if shape.fused_attention else 0.0
    for part in ACTIVATION_PARTS:
        size = (part.per_sbh * sbh + part.per_as2b * scores) * _scale(part, heads, hidden, shape)
        gathered = keep_gathered and part.what.startswith("layer-norm output")
        total += size / t if part.split_by_tp or (sp and not gathered) else size
    return total


def selective_recompute_flops(seq_len: int, micro_batch: int, hidden: int, tp: int = 1) -> float:
    """FLOPs one GPU spends per layer and micro-batch on selective recomputation: ``2 b s^2 h / t``.

    What it counts: the product ``Q K^T`` that rebuilds the attention scores, ``2 s^2 (h/a)``
    FLOPs per head and sequence, so ``2 b s^2 h`` for the ``a`` heads of ``b`` sequences
    (the whole ``s x s`` matrix, as :func:`trainscale.compute.attention_training_flops`
    counts it), split over the ``t`` tensor-parallel GPUs by heads. The softmax and the
    dropout that turn the scores back into the probabilities backward needs have no
    matrix-product FLOPs and are not counted.

    What it leaves out, and why: the product of the probabilities with ``V``. Its
    output (the input of the output projection) is kept, and its backward needs only
    its inputs, so it need not run again. PyTorch's ``checkpoint`` stops recomputing
    once backward has every tensor it needs, and chapter 3 measures exactly
    ``2 b s^2 h``; FlashAttention's backward also recomputes only the scores.
    Megatron-LM's checkpointed core attention reruns the whole function, the product
    with ``V`` included: ``4 b s^2 h``, an upper bound, and the count the text of
    Korthikanti et al.'s appendix A gives (arXiv 2205.05198); their hardware-FLOPs
    formula, equation 8, adds three times that, ``12 b s^2 h`` per layer.
    """
    s = _checks.count("seq_len", seq_len, minimum=1)
    b = _checks.count("micro_batch", micro_batch, minimum=1)
    h = _checks.count("hidden", hidden, minimum=1)
    t = _checks.count("tp", tp, minimum=1)
    return 2 * b * s * s * h / t


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
    import torch

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
