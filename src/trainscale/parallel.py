"""The parallelisms simulated in one process (chapters 5, 8 and 3).

The pipeline's bubble and schedules live in :mod:`trainscale.pipeline` (chapter 9).

Each function computes, on one CPU, what a group of GPUs would compute
together, so its result can be compared with the plain single-device answer.
Gradients are returned as a dict ``{parameter name: gradient}`` and computed
with ``torch.autograd.grad``: the model's ``.grad`` fields are left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from trainscale import _checks

# One layer's collectives live with the other collectives, which the planner imports without
# torch; chapter 8 reads them here.
from trainscale.collectives import SEQUENCE_PARALLEL_STYLES as SEQUENCE_PARALLEL_STYLES
from trainscale.collectives import layer_collective_bytes as layer_collective_bytes
from trainscale.collectives import layer_collectives as layer_collectives
from trainscale.collectives import ring_bytes_per_rank
from trainscale.memory import run_checkpointed
from trainscale.transformer import attend

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A loss that averages over the batch, such as ``nn.functional.mse_loss``."""


def _gradient(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, forward=None
) -> dict[str, torch.Tensor]:
    """Gradient of ``loss_fn(model(x), y)`` for every trainable parameter."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    output = forward(model, x) if forward else model(x)
    grads = torch.autograd.grad(loss_fn(output, y), [p for _, p in named])
    return {name: g for (name, _), g in zip(named, grads, strict=True)}


def full_batch_gradient(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The reference: the gradient of the mean loss over the whole batch on one device."""
    return _gradient(model, loss_fn, x, y)


def _sliced_gradient(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, slices: int, name: str
) -> dict[str, torch.Tensor]:
    """Sum of per-slice gradients, each weighted by its share of the batch."""
    n = _checks.count(name, slices, minimum=1)
    batch = x.shape[0]
    if n > batch:
        raise ValueError(f"{name} must be between 1 and the batch size {batch}, got {slices}")
    total: dict[str, torch.Tensor] = {}
    for xs, ys in zip(torch.tensor_split(x, n), torch.tensor_split(y, n), strict=True):
        weight = xs.shape[0] / batch
        for key, grad in _gradient(model, loss_fn, xs, ys).items():
            total[key] = total[key] + weight * grad if key in total else weight * grad
    return total


def data_parallel_gradient(
    model: nn.Module,
    loss_fn: LossFn,
    x: torch.Tensor,
    y: torch.Tensor,
    replicas: int,
    weighted: bool = True,
) -> dict[str, torch.Tensor]:
    """What ``replicas`` data-parallel GPUs agree on after their all-reduce.

    The batch is cut into ``replicas`` slices (unequal when the batch size is
    not divisible); each replica computes the gradient of the mean loss on its
    slice. ``weighted=True`` weights each slice by its share of the batch,
    which equals the full-batch gradient for any slicing. ``weighted=False``
    takes the plain mean, as DDP's all-reduce does: correct only for equal slices.
    """
    if weighted:
        return _sliced_gradient(model, loss_fn, x, y, replicas, "replicas")
    n = _checks.count("replicas", replicas, minimum=1)
    if n > x.shape[0]:
        raise ValueError(f"replicas must be between 1 and the batch size {x.shape[0]}, got {n}")
    per_replica = [
        _gradient(model, loss_fn, xs, ys)
        for xs, ys in zip(torch.tensor_split(x, n), torch.tensor_split(y, n), strict=True)
    ]
    return {key: sum(g[key] for g in per_replica) / n for key in per_replica[0]}


def accumulated_gradient(
    model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, micro_batches: int
) -> dict[str, torch.Tensor]:
    """Gradient accumulation on one device: ``micro_batches`` passes, one step.

    Each micro-batch's loss is scaled by its share of the batch (``1 / micro_batches``
    when they are equal) before its gradient is added, so the sum equals the
    full-batch gradient while only one micro-batch's activations are alive at a time.
    """
    return _sliced_gradient(model, loss_fn, x, y, micro_batches, "micro_batches")


IGNORE_INDEX = -100
"""The label of a padding position: ``cross_entropy`` leaves it out (PyTorch's default)."""

TOKEN_NORMALISATIONS = ("micro-batch mean", "global token count")
"""How :func:`accumulated_token_gradient` scales each micro-batch's token loss."""

TokenBatch = tuple[Tensor, Tensor]
"""One micro-batch of a token loss: inputs ``(positions, features)`` and labels
``(positions,)``, a class index per position or :data:`IGNORE_INDEX` at padding."""


def padded_micro_batches(
    tokens: Sequence[int],
    positions: int,
    features: int,
    classes: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> list[TokenBatch]:
    """Micro-batches of ``positions`` slots each, of which the first ``tokens[j]`` are real.

    Micro-batch ``j`` has random inputs (``positions x features``, drawn in
    ``dtype`` from ``seed``) and a random class out of ``classes`` at each of its
    ``tokens[j]`` real positions; the rest is padding, labelled
    :data:`IGNORE_INDEX`, as a batch of sequences of different lengths is.
    """
    n_positions = _checks.count("positions", positions, minimum=1)
    n_features = _checks.count("features", features, minimum=1)
    n_classes = _checks.count("classes", classes, minimum=2)
    counts = [_checks.count("tokens", t) for t in tokens]
    if not counts or max(counts) > n_positions:
        raise ValueError(
            f"tokens must be a non-empty list of counts between 0 and positions = {n_positions},"
            f" got {list(tokens)}"
        )
    g = torch.Generator().manual_seed(_checks.count("seed", seed))
    batches = []
    for count in counts:
        inputs = torch.randn(n_positions, n_features, generator=g, dtype=dtype)
        labels = torch.randint(n_classes, (n_positions,), generator=g)
        labels[count:] = IGNORE_INDEX
        batches.append((inputs, labels))
    return batches


def token_count(labels: Tensor) -> int:
    """The number of real tokens among ``labels``: the positions not labelled padding."""
    return int((labels != IGNORE_INDEX).sum())


def _token_batches(micro_batches: Sequence[TokenBatch]) -> list[TokenBatch]:
    """``micro_batches`` as a list, refused when empty or without a single real token."""
    batches = list(micro_batches)
    if not batches or sum(token_count(labels) for _, labels in batches) == 0:
        raise ValueError("micro_batches must hold at least one real (non-padding) token")
    return batches


def token_mean_gradient(model: nn.Module, micro_batches: Sequence[TokenBatch]) -> dict[str, Tensor]:
    """The reference: one pass over every micro-batch at once, cross-entropy averaged
    over all real tokens (``reduction="mean"``, padding ignored)."""
    batches = _token_batches(micro_batches)
    inputs = torch.cat([x for x, _ in batches])
    labels = torch.cat([y for _, y in batches])

    def loss(output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output, target, ignore_index=IGNORE_INDEX)

    return _gradient(model, loss, inputs, labels)


def accumulated_token_gradient(
    model: nn.Module, micro_batches: Sequence[TokenBatch], normalise: str
) -> dict[str, Tensor]:
    """Gradient accumulation of a token loss (cross-entropy), one backward per micro-batch.

    ``normalise="micro-batch mean"`` divides each micro-batch's mean over its own
    ``n_j`` tokens by the number of micro-batches ``k``, as "divide the loss by
    the accumulation steps" does: a token of micro-batch ``j`` weighs
    ``1 / (k n_j)``, which is the full batch's ``1 / sum(n)`` only when every
    ``n_j`` is the same. ``normalise="global token count"`` divides each
    micro-batch's *summed* loss by the number of real tokens in all of them:
    every token weighs ``1 / sum(n)``, for any counts.
    """
    _checks.choice("normalise", normalise, TOKEN_NORMALISATIONS)
    batches = _token_batches(micro_batches)
    counts = [token_count(labels) for _, labels in batches]
    if normalise == "micro-batch mean" and min(counts) == 0:
        raise ValueError(
            f"micro_batches must each hold a real token to take its mean, got {counts}"
        )
    total: dict[str, Tensor] = {}
    for (inputs, labels), count in zip(batches, counts, strict=True):
        divisor = len(batches) * count if normalise == "micro-batch mean" else sum(counts)

        def loss(output: Tensor, target: Tensor, divisor: int = divisor) -> Tensor:
            summed = nn.functional.cross_entropy(
                output, target, ignore_index=IGNORE_INDEX, reduction="sum"
            )
            return summed / divisor

        for key, grad in _gradient(model, loss, inputs, labels).items():
            total[key] = total[key] + grad if key in total else grad
    return total


def checkpointed_gradient(
    model: nn.Sequential, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, segment: int = 1
) -> dict[str, torch.Tensor]:
    """The full-batch gradient with activation checkpointing every ``segment`` blocks."""
    return _gradient(model, loss_fn, x, y, lambda m, inp: run_checkpointed(m, inp, segment))


def tensor_parallel_mlp(x: Tensor, w1: Tensor, w2: Tensor, shards: int) -> Tensor:
    """Megatron's MLP ``gelu(x @ w1) @ w2`` split over ``shards`` devices.

    ``w1`` (``d x h``) is split by columns and ``w2`` (``h x d``) by the
    matching rows. Device ``i`` computes ``gelu(x @ w1[:, cols_i]) @ w2[cols_i, :]``
    with no communication: GELU acts element by element, so each device can
    apply it to its own slice of the hidden layer. The partial outputs are then
    summed, which is the one all-reduce of the forward pass.
    """
    n = _checks.count("shards", shards, minimum=1)
    _check_chain(x, w1, w2)
    column_blocks = torch.tensor_split(w1, n, dim=1)
    row_blocks = torch.tensor_split(w2, n, dim=0)
    partials = [
        nn.functional.gelu(x @ a) @ b for a, b in zip(column_blocks, row_blocks, strict=True)
    ]
    return sum(partials[1:], start=partials[0])  # the all-reduce: a sum over devices


def _check_chain(x: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> None:
    """Raise unless ``x @ first @ second`` is a valid chain of products."""
    if x.shape[-1] != first.shape[0] or first.shape[1] != second.shape[0]:
        raise ValueError(
            f"shapes do not chain: x {tuple(x.shape)}, w1 {tuple(first.shape)},"
            f" w2 {tuple(second.shape)}"
        )


def first_matrix_by_rows_mlp(
    x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, shards: int, sync_before_gelu: bool
) -> torch.Tensor:
    """The MLP ``gelu(x @ up) @ down`` with its first matrix split the other way: by rows.

    Device ``i`` holds rows ``i`` of ``up`` (``d x h``) and the matching columns of
    ``x``, so ``x[:, rows_i] @ up[rows_i, :]`` is only a *partial sum* of the hidden
    layer. With ``sync_before_gelu=True`` the partial sums are added up first (an
    all-reduce of the whole hidden layer, ``4x`` wider than the output, in every
    forward pass) and the result is right. With ``False`` each device applies GELU
    to its own partial sum and the results are added afterwards: wrong, because
    GELU is not linear, ``gelu(a + b) != gelu(a) + gelu(b)``. ``down`` (``h x d``)
    is used whole.
    """
    n = _checks.count("shards", shards, minimum=1)
    _check_chain(x, up, down)
    _checks.boolean("sync_before_gelu", sync_before_gelu)
    x_blocks = torch.tensor_split(x, n, dim=-1)
    row_blocks = torch.tensor_split(up, n, dim=0)
    partial_sums = [xb @ wb for xb, wb in zip(x_blocks, row_blocks, strict=True)]
    if sync_before_gelu:
        return nn.functional.gelu(torch.stack(partial_sums).sum(dim=0)) @ down
    return torch.stack([nn.functional.gelu(p) for p in partial_sums]).sum(dim=0) @ down


def tensor_parallel_shapes(tokens: int, hidden: int, ffn: int, shards: int) -> list[dict]:
    """What each of ``shards`` devices holds and computes in Megatron's split MLP.

    ``tokens`` rows of ``hidden`` features go through ``hidden -> ffn -> hidden``.
    Device ``i`` holds a ``hidden x ffn_i`` column block of the first matrix and
    the ``ffn_i x hidden`` row block of the second (``ffn_i`` is ``ffn / shards``,
    or one more or less when it does not divide), computes a ``tokens x ffn_i``
    slice of the hidden layer and a ``tokens x hidden`` partial output.
    """
    t = _checks.count("tokens", tokens, minimum=1)
    d = _checks.count("hidden", hidden, minimum=1)
    h = _checks.count("ffn", ffn, minimum=1)
    n = _checks.count("shards", shards, minimum=1)
    if n > h:
        raise ValueError(f"shards must be between 1 and ffn = {h}, got {shards}")
    widths = [h // n + (i < h % n) for i in range(n)]
    return [
        {
            "input": (t, d),
            "first matrix": (d, w),
            "hidden slice": (t, w),
            "second matrix": (w, d),
            "partial output": (t, d),
        }
        for w in widths
    ]


def tensor_parallel_traffic(
    tokens: int, hidden: int, shards: int, bytes_per_value: int = 2
) -> dict[str, float]:
    """Bytes one device sends per transformer layer for one micro-batch, by all-reduce.

    Attention and the MLP each end with one all-reduce of the ``tokens x hidden``
    activations in forward, and each needs one of the same size for the input
    gradient in backward: four per layer. A ring all-reduce sends ``2(N-1)/N``
    of the tensor from each device (chapter 6). ``bytes_per_value`` is 2 for bf16.
    """
    t = _checks.count("tokens", tokens, minimum=1)
    d = _checks.count("hidden", hidden, minimum=1)
    n = _checks.count("shards", shards, minimum=1)
    size = _checks.count("bytes_per_value", bytes_per_value, minimum=1)
    one = ring_bytes_per_rank(t * d * size, n)
    return {
        f"{block}, {phase}": one
        for phase in ("forward", "backward")
        for block in ("attention", "MLP")
    }


def _check_attention(x, wq, wk, wv, wo, heads) -> int:
    n_heads = _checks.count("heads", heads, minimum=1)
    d = x.shape[-1]
    if x.dim() < 2 or d % n_heads:
        raise ValueError(
            f"x must be (..., sequence, features) with features divisible by heads = {n_heads},"
            f" got {tuple(x.shape)}"
        )
    for name, w in (("wq", wq), ("wk", wk), ("wv", wv), ("wo", wo)):
        if tuple(w.shape) != (d, d):
            raise ValueError(f"{name} must be {d} x {d}, got {tuple(w.shape)}")
    return n_heads


def _attend(x, wq, wk, wv, wo, heads: int) -> torch.Tensor:
    """Multi-head attention on the columns of ``wq``, ``wk``, ``wv`` and rows of ``wo``:
    the projections of this demonstration around the model's own attention formula,
    :func:`trainscale.transformer.attend`, without its causal mask."""
    size = wq.shape[1] // heads

    def by_head(
        t: torch.Tensor,
    ) -> torch.Tensor:  # (..., seq, heads*size) -> (..., heads, seq, size)
        return t.unflatten(-1, (heads, size)).transpose(-2, -3)

    q, k, v = by_head(x @ wq), by_head(x @ wk), by_head(x @ wv)
    return attend(q, k, v, causal=False).transpose(-2, -3).flatten(-2) @ wo


def multi_head_attention(
    x: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    wo: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """Plain multi-head self-attention on one device (no mask, no bias).

    ``x`` is ``(..., sequence, features)``; the projections are ``features x
    features`` and used as ``x @ wq``. Head ``j`` uses columns ``j`` of ``wq``,
    ``wk`` and ``wv`` (``features / heads`` of them) and the matching rows of ``wo``.
    """
    return _attend(x, wq, wk, wv, wo, _check_attention(x, wq, wk, wv, wo, heads))


def attention_by_heads(
    x: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    wo: torch.Tensor,
    heads: int,
    shards: int,
) -> torch.Tensor:
    """:func:`multi_head_attention` split over ``shards`` devices, by heads.

    Each device takes a group of whole heads: the matching columns of ``wq``,
    ``wk`` and ``wv`` (a column split, like the MLP's first matrix) and rows of
    ``wo`` (a row split, like its second). Heads never look at each other, so each
    device computes its heads alone; the partial outputs are summed, the one
    all-reduce of the forward pass. Groups may differ by one head when ``heads``
    is not divisible by ``shards``.
    """
    n_heads = _check_attention(x, wq, wk, wv, wo, heads)
    n = _checks.count("shards", shards, minimum=1)
    if n > n_heads:
        raise ValueError(f"shards must be between 1 and heads = {n_heads}, got {shards}")
    size = x.shape[-1] // n_heads
    outputs = []
    for group in torch.tensor_split(torch.arange(n_heads), n):
        cols = slice(int(group[0]) * size, (int(group[-1]) + 1) * size)
        outputs.append(_attend(x, wq[:, cols], wk[:, cols], wv[:, cols], wo[cols, :], len(group)))
    return torch.stack(outputs).sum(dim=0)  # the all-reduce
