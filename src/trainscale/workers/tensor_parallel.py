"""Tensor parallelism on real processes (chapter 8).

:func:`worker` splits one MLP and one multi-head attention block over the ranks
of a ``torch.distributed`` job in two ways and returns what each computed, for
the chapter to compare with the unsplit layer in one process:

* with PyTorch's DTensor API: ``parallelize_module`` with ``ColwiseParallel``
  for the first matrix (and for the query, key and value projections) and
  ``RowwiseParallel`` for the second (and for the output projection); the
  collectives it runs are counted with ``CommDebugMode``;
* by hand, with plain tensors: each rank keeps its slices of the weights,
  computes its partial output, and calls ``dist.all_reduce`` once in forward (on
  the output) and once in backward (on the input gradient).

It also splits a whole pre-LN transformer :class:`Block` (layer norms, attention,
MLP, residual additions) in float64 twice, with the same column- and row-wise plans:
as plain tensor parallelism (:func:`block_plan` with ``sequence_parallel=False``:
the layer norms and residuals run whole on every rank) and with Megatron's sequence
parallelism (``SequenceParallel`` on the layer norms: they and the residual stream
keep ``1/N`` of the sequence each, as torchtitan's Llama plan does), and a third
time without DTensor, as Megatron-LM runs sequence parallelism
(:class:`RegatherBlock`): its column-parallel products keep only this rank's ``1/N``
of their input and all-gather it again in backward (:class:`_ColumnParallelRegather`),
where DTensor's plan keeps the gathered input whole. For each it returns the output,
the gradients, the collectives of each pass (counted, and their sizes,
:class:`CollectiveSizes`) and every tensor autograd keeps for backward
(:func:`saved_tensors`).

The same file runs on a GPU node, one process per GPU, with NCCL::

    torchrun --nproc-per-node=8 -m trainscale.workers.tensor_parallel
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from trainscale import _checks
from trainscale.distributed import device, torchrun_main
from trainscale.transformer import ATTENTION, attend


class MLP(nn.Module):
    """The transformer's MLP: ``up`` (hidden -> ffn), GELU, ``down`` (ffn -> hidden)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class Attention(nn.Module):
    """Multi-head self-attention with separate ``q``, ``k``, ``v`` and ``o`` projections.

    The model's attention (:class:`trainscale.transformer.CausalSelfAttention`)
    keeps queries, keys and values in one ``qkv`` matrix; here they are apart so
    that ``ColwiseParallel`` can split each by heads. The formula in between is the
    model's own, :func:`trainscale.transformer.attend` (without the causal mask).

    The number of heads is read from the projections' output width
    (``view(..., -1, head_size)``), not stored: under tensor parallelism each
    rank's ``q`` produces only its own heads, and the same code runs on them. ``kind``
    is :func:`~trainscale.transformer.attend`'s: ``"sdpa"`` (PyTorch's fused
    function) or ``"naive"`` (written out, so autograd keeps the softmax output).
    """

    def __init__(self, hidden: int, heads: int, kind: str = "sdpa") -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden must be divisible by heads = {heads}, got {hidden}")
        self.kind = str(_checks.choice("kind", kind, ATTENTION))
        self.head_size = hidden // heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape

        def by_head(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, -1, self.head_size).transpose(1, 2)

        q, k, v = by_head(self.q(x)), by_head(self.k(x)), by_head(self.v(x))
        out = attend(q, k, v, causal=False, kind=self.kind)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))


def layers(hidden: int = 16, ffn: int = 64, heads: int = 8, seed: int = 0) -> tuple[MLP, Attention]:
    """The chapter's MLP and attention block, with weights drawn from ``seed``
    (the global random state is left alone)."""
    d = _checks.count("hidden", hidden, minimum=1)
    h = _checks.count("ffn", ffn, minimum=1)
    n_heads = _checks.count("heads", heads, minimum=1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_checks.count("seed", seed))
        return MLP(d, h), Attention(d, n_heads)


def layer_input(batch: int = 2, seq: int = 5, hidden: int = 16, seed: int = 0) -> torch.Tensor:
    """The activations entering the layer: ``batch`` sequences of ``seq`` tokens."""
    g = torch.Generator().manual_seed(_checks.count("seed", seed) + 1)
    return torch.randn(
        _checks.count("batch", batch, minimum=1),
        _checks.count("seq", seq, minimum=1),
        _checks.count("hidden", hidden, minimum=1),
        generator=g,
    )


class Block(nn.Module):
    """A pre-LN transformer block without dropout, batch first, ``(batch, seq, hidden)``:
    ``h = x + attention(attention_norm(x))``, then ``h + mlp(mlp_norm(h))``.

    Its parts carry the names of torchtitan's Llama block (``attention_norm``,
    ``attention``, ``mlp_norm`` standing for its ``ffn_norm``, ``mlp``), so that
    :func:`block_plan` reads like the plans written for real models. The attention
    is written out (``kind="naive"``) and not causal.
    """

    def __init__(self, hidden: int, ffn: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(hidden)
        self.attention = Attention(hidden, heads, kind="naive")
        self.mlp_norm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.mlp(self.mlp_norm(h))


def block(hidden: int = 16, ffn: int = 64, heads: int = 8, seed: int = 0) -> Block:
    """The chapter's transformer :class:`Block` in float64, its weights drawn from ``seed``.

    Every parameter is drawn in float64 with a generator of its own (weights
    ``N(0, 1/fan_in)``, biases ``N(0, 0.01)``, layer-norm scales ``1 + N(0, 0.01)``),
    so the block is the same on every rank and every CPU; the global random state
    is left alone.
    """
    layer = Block(
        _checks.count("hidden", hidden, minimum=1),
        _checks.count("ffn", ffn, minimum=1),
        _checks.count("heads", heads, minimum=1),
    ).double()
    g = torch.Generator().manual_seed(_checks.count("seed", seed) + 2)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            draw = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if p.dim() == 2:
                p.copy_(draw / p.shape[1] ** 0.5)
            else:
                p.copy_(draw * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    return layer


def block_input(batch: int = 2, seq: int = 8, hidden: int = 16, seed: int = 0) -> torch.Tensor:
    """The float64 activations entering the :class:`Block`: ``batch`` sequences of ``seq``
    tokens of ``hidden`` features."""
    g = torch.Generator().manual_seed(_checks.count("seed", seed) + 3)
    return torch.randn(
        _checks.count("batch", batch, minimum=1),
        _checks.count("seq", seq, minimum=1),
        _checks.count("hidden", hidden, minimum=1),
        generator=g,
        dtype=torch.float64,
    )


Part = tuple[str, tuple[str, ...], str]
"""One sublayer of a block for :func:`block_plan`: ``(module, column-parallel matrices,
row-parallel matrix)``, the matrices named inside the module (``("mlp", ("up",), "down")``)."""


def block_plan(
    sequence_parallel: bool,
    *,
    attention: Part = ("attention", ("q", "k", "v"), "o"),
    mlp: Part = ("mlp", ("up",), "down"),
    norms: tuple[str, ...] = ("attention_norm", "mlp_norm"),
) -> dict[str, ParallelStyle]:
    """The DTensor plan of a :class:`Block`: Megatron's split, with or without sequence
    parallelism. The one plan of the package: the capstone applies it to its decoder's
    blocks (:func:`trainscale.train.parallelize.tensor_parallel_plan`), under their names.

    Both plans split ``q``, ``k``, ``v`` and ``up`` column-wise and ``o`` and
    ``down`` row-wise, and give attention and the MLP their input as one
    replicated DTensor (``PrepareModuleInput``), so that ``q``, ``k`` and ``v``
    share it and backward sums their input gradients in one collective, as
    Megatron's fused QKV matrix does. Without sequence parallelism the residual
    stream is whole on every rank: the row-wise outputs are all-reduced
    (``Replicate``) and the layer norms run unsplit. With it, the layer norms are
    ``SequenceParallel`` and the residual stream keeps ``1/N`` of the sequence
    (``Shard(1)``) on each rank: the row-wise outputs are reduce-scattered into it,
    and the input of attention and of the MLP is all-gathered from it. This is the
    plan of torchtitan's Llama and of PyTorch's tensor-parallel tutorial.
    ``attention`` and ``mlp`` name a block's two sublayers and their matrices
    (:data:`Part`), ``norms`` its layer norms, for a block whose names are not
    :class:`Block`'s.
    """
    sp = _checks.boolean("sequence_parallel", sequence_parallel)
    stream = Shard(1) if sp else Replicate()  # the residual stream between the blocks
    plan: dict[str, ParallelStyle] = {}
    for part, first, second in (attention, mlp):
        plan[part] = PrepareModuleInput(
            input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_output=False
        )
        plan |= {f"{part}.{name}": ColwiseParallel() for name in first}
        plan[f"{part}.{second}"] = RowwiseParallel(output_layouts=stream)
    if sp:
        plan |= {norm: SequenceParallel() for norm in norms}
    return plan


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, a plain tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


@contextmanager
def saved_tensors(model: nn.Module) -> Iterator[list[tuple[tuple[int, ...], int, str]]]:
    """Record what autograd keeps for backward while the ``with`` body runs forward.

    Yields a list that fills with ``(shape, bytes, layout)`` of each storage kept, in
    the order forward saves them: for a DTensor its local shard on this rank, the
    bytes this rank really holds, and its placement (``"Replicate()"``: whole on
    every rank, ``"Shard(dim=1)"``: split along the sequence); ``"plain"`` for a plain
    tensor. As :func:`trainscale.memory.saved_activation_bytes`
    does, a storage kept twice is listed once and ``model``'s parameters are left
    out (they are stored anyway).
    """
    exclude = {_local(weight).untyped_storage().data_ptr() for weight in model.parameters()}
    seen: set[int] = set()
    rows: list[tuple[tuple[int, ...], int, str]] = []

    def note(kept: torch.Tensor) -> torch.Tensor:
        local = _local(kept)
        storage = local.untyped_storage()
        if storage.data_ptr() not in exclude | seen:
            seen.add(storage.data_ptr())
            layout = repr(kept.placements[0]) if isinstance(kept, DTensor) else "plain"
            rows.append((tuple(local.shape), storage.nbytes(), layout))
        return kept  # kept as it is: only its size is noted

    with torch.autograd.graph.saved_tensors_hooks(pack_hook=note, unpack_hook=lambda kept: kept):
        yield rows


_C10D_NAMES = {
    "_allgather_base_": "all_gather_into_tensor",
    "_reduce_scatter_base_": "reduce_scatter_tensor",
    "allreduce_": "all_reduce",
}
"""The c10d ops behind ``dist.all_gather_single`` and friends, named as DTensor's."""


def _counts(mode: CommDebugMode) -> dict[str, int]:
    """``{"all_reduce": 1}`` from CommDebugMode's ``{OpOverloadPacket: count}``."""
    counts: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = str(op).split(".")[-1]
        name = _C10D_NAMES.get(name, name)
        counts[name] = counts.get(name, 0) + n
    return counts


_KINDS = {
    "all_reduce": "all-reduce",
    "all_gather_into_tensor": "all-gather",
    "reduce_scatter_tensor": "reduce-scatter",
}
"""The collectives the chapter's blocks run, named as
:func:`trainscale.collectives.ring_factor` names them."""


class CollectiveSizes(TorchDispatchMode):
    """Note every collective that runs inside it: its kind and the bytes of the whole
    tensor it acts on (what an all-reduce or a reduce-scatter sums, what an
    all-gather assembles), as ``(kind, bytes)`` in :attr:`sizes`, in the order they
    run. DTensor's collectives are seen once DTensor has turned them into plain
    ops on the local tensors, as ``CommDebugMode`` sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn it into plain ops first
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        kind = _KINDS.get(_C10D_NAMES.get(name, name))
        if kind is not None:
            leaves = pytree.tree_leaves((args, kwargs, out))
            whole = max(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
            self.sizes.append((kind, whole))
        return out


def _seq_all_gather(shard: torch.Tensor) -> torch.Tensor:
    """All-gather the ranks' ``(batch, s/N, hidden)`` shards into ``(batch, s, hidden)``."""
    n = dist.get_world_size()
    out = shard.new_empty((n * shard.shape[0], *shard.shape[1:]))  # the ranks' shards, stacked
    dist.all_gather_single(out, shard.contiguous())
    return out.view(n, *shard.shape).movedim(0, 1).flatten(1, 2)


def _seq_reduce_scatter(full: torch.Tensor) -> torch.Tensor:
    """Sum ``(batch, s, hidden)`` over the ranks and keep this rank's ``s/N`` tokens."""
    n = dist.get_world_size()
    batch, seq, hidden = full.shape
    chunks = full.reshape(batch, n, seq // n, hidden).movedim(1, 0).reshape(-1, seq // n, hidden)
    out = full.new_empty((batch, seq // n, hidden))
    dist.reduce_scatter_single(out, chunks)
    return out


class _ColumnParallelRegather(torch.autograd.Function):
    """Megatron-LM's column-parallel linear under sequence parallelism.

    Forward all-gathers the ``s/N`` shard, multiplies, and keeps only the shard (and
    the weight) for backward; backward all-gathers the shard *again* for the weight
    gradient and reduce-scatters the input gradient. Megatron Core's
    ``LinearWithGradAccumulationAndAsyncCommunication`` does the same
    (``ctx.save_for_backward(input, weight)`` before the gather).
    """

    @staticmethod
    def forward(ctx, shard, weight, bias):
        ctx.save_for_backward(shard, weight)
        ctx.has_bias = bias is not None
        return nn.functional.linear(_seq_all_gather(shard), weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        shard, weight = ctx.saved_tensors
        full = _seq_all_gather(shard)  # the gathered input was not kept: gather it again
        grad_input = _seq_reduce_scatter(grad_output @ weight)
        grad_weight = grad_output.flatten(0, -2).T @ full.flatten(0, -2)
        grad_bias = grad_output.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias


class _ReduceScatter(torch.autograd.Function):
    """Where a row-parallel block ends: reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, partial):
        return _seq_reduce_scatter(partial)

    @staticmethod
    def backward(ctx, grad_output):
        return _seq_all_gather(grad_output)


class RegatherBlock(nn.Module):
    """This rank's part of a :class:`Block` under Megatron-LM's sequence parallelism.

    It holds its slices of the weights as plain tensors (``q``, ``k`` and ``v`` fused
    into one ``qkv`` matrix, as Megatron's), the layer norms and ``mlp.down``'s bias
    whole, and takes and returns its ``s/N`` tokens. The column-parallel products go
    through :class:`_ColumnParallelRegather`, the row-parallel ones end in a
    reduce-scatter, and the layer norms, residual additions and the second bias run
    on the shard. The layer norms' and ``down``'s bias gradients are then partial
    sums, summed once per step by :meth:`full_gradients` (Megatron Core's
    ``_allreduce_layernorm_grads``, which also covers that bias).
    """

    def __init__(self, whole: Block, rank: int, world_size: int) -> None:
        super().__init__()
        self.world_size = world_size
        self.head_size = whole.attention.head_size
        # my rows of each column-parallel weight, the same columns of each row-parallel one
        a = torch.tensor_split(torch.arange(whole.attention.q.out_features), world_size)[rank]
        m = torch.tensor_split(torch.arange(whole.mlp.up.out_features), world_size)[rank]
        attention, mlp = whole.attention, whole.mlp

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t.detach().clone())

        self.attention_norm, self.mlp_norm = whole.attention_norm, whole.mlp_norm
        self.qkv = param(
            torch.cat([attention.q.weight[a], attention.k.weight[a], attention.v.weight[a]])
        )
        self.o = param(attention.o.weight[:, a])
        self.up_weight, self.up_bias = param(mlp.up.weight[m]), param(mlp.up.bias[m])
        self.down_weight, self.down_bias = param(mlp.down.weight[:, m]), mlp.down.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.shape[0], x.shape[1] * self.world_size
        qkv = _ColumnParallelRegather.apply(self.attention_norm(x), self.qkv, None)
        q, k, v = (
            t.view(batch, seq, -1, self.head_size).transpose(1, 2) for t in qkv.chunk(3, dim=-1)
        )
        out = attend(q, k, v, causal=False, kind="naive").transpose(1, 2).reshape(batch, seq, -1)
        h = x + _ReduceScatter.apply(nn.functional.linear(out, self.o))
        up = _ColumnParallelRegather.apply(self.mlp_norm(h), self.up_weight, self.up_bias)
        down = _ReduceScatter.apply(nn.functional.linear(nn.functional.gelu(up), self.down_weight))
        return h + down + self.down_bias

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every gradient of the :class:`Block`, by its names, after ``backward``.

        Sums the partial ones (the layer norms, ``mlp.down.bias``) in one all-reduce,
        as Megatron does once per step, then gathers the slices of the others from the
        ranks (only for the chapter to compare: training needs no such gather).
        """
        partial = {
            "attention_norm.weight": self.attention_norm.weight,
            "attention_norm.bias": self.attention_norm.bias,
            "mlp_norm.weight": self.mlp_norm.weight,
            "mlp_norm.bias": self.mlp_norm.bias,
            "mlp.down.bias": self.down_bias,
        }
        flat = torch.cat([p.grad.flatten() for p in partial.values()])
        dist.all_reduce(flat)  # one per step, for the whole model in Megatron
        pieces = flat.split([p.numel() for p in partial.values()])
        summed = {name: t.view_as(p) for (name, p), t in zip(partial.items(), pieces, strict=True)}

        def gathered(local: torch.Tensor, dim: int) -> torch.Tensor:
            parts = [torch.empty_like(local) for _ in range(self.world_size)]
            dist.all_gather(parts, local.contiguous())
            return torch.cat(parts, dim=dim)

        q, k, v = (
            gathered(self.qkv.grad, 0).view(self.world_size, 3, -1, self.qkv.shape[1]).unbind(1)
        )
        full = {
            "attention.q.weight": q.flatten(0, 1),
            "attention.k.weight": k.flatten(0, 1),
            "attention.v.weight": v.flatten(0, 1),
            "attention.o.weight": gathered(self.o.grad, 1),
            "mlp.up.weight": gathered(self.up_weight.grad, 0),
            "mlp.up.bias": gathered(self.up_bias.grad, 0),
            "mlp.down.weight": gathered(self.down_weight.grad, 1),
        }
        return {name: t.detach().cpu().clone() for name, t in (summed | full).items()}


def _regather_block(layer: Block, x: torch.Tensor, rank: int, world_size: int) -> dict:
    """The block under :class:`RegatherBlock` on this rank's ``1/N`` of the sequence."""
    part = RegatherBlock(layer, rank, world_size)
    x = torch.tensor_split(x, world_size, dim=1)[rank].clone().requires_grad_(True)
    with CommDebugMode() as forward, CollectiveSizes() as sizes, saved_tensors(part) as kept:
        out = part(x)
    with CommDebugMode() as backward, CollectiveSizes() as backward_sizes:
        out.sum().backward()
    with CommDebugMode() as step:
        gradients = part.full_gradients()
    return {
        "output": out.detach().cpu().clone(),
        "input gradient": x.grad.detach().cpu().clone(),
        "weight gradients": {n: gradients[n] for n, _ in layer.named_parameters()},
        "forward collectives": _counts(forward),
        "backward collectives": _counts(backward),
        "step collectives": {"all_reduce": _counts(step).get("all_reduce", 0)},
        "collective sizes": sizes.sizes + backward_sizes.sizes,
        "kept": kept,
        "kept bytes": sum(row[1] for row in kept),
    }


def _plain(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor from a DTensor output (an ``AsyncCollectiveTensor`` waits here)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def _dtensor_mlp(mlp: MLP, mesh, x: torch.Tensor) -> dict:
    """The MLP under ``ColwiseParallel`` / ``RowwiseParallel``: output, gradients, traffic."""
    parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = x.clone().requires_grad_(True)  # as if it came from the layer below
    with CommDebugMode() as forward:
        out = mlp(x)
    with CommDebugMode() as backward:
        out.sum().backward()
    return {
        "output": _plain(out),
        "input gradient": _plain(x.grad),
        "weight gradients": {n: _plain(p.grad) for n, p in mlp.named_parameters()},
        "local shapes": {n: tuple(p.to_local().shape) for n, p in mlp.named_parameters()},
        "forward collectives": _counts(forward),
        "backward collectives": _counts(backward),
    }


def _by_hand_mlp(mlp: MLP, rank: int, world_size: int, x: torch.Tensor) -> dict:
    """The same split with plain tensors: one ``dist.all_reduce`` each way."""
    up = torch.tensor_split(torch.arange(mlp.up.out_features), world_size)[rank]
    w1 = mlp.up.weight[up].detach().clone().requires_grad_(True)  # my rows of W1 = my columns
    b1 = mlp.up.bias[up].detach().clone().requires_grad_(True)  # of the x @ W1.T product
    w2 = mlp.down.weight[:, up].detach().clone().requires_grad_(True)  # matching part of W2
    x = x.clone().requires_grad_(True)

    partial = nn.functional.linear(nn.functional.gelu(nn.functional.linear(x, w1, b1)), w2)
    out = partial.detach().clone()
    dist.all_reduce(out)  # forward: sum the partial outputs
    out += mlp.down.bias.detach()  # the second bias is added once, after the sum

    partial.backward(torch.ones_like(out))  # d(out.sum())/d(out), known on every rank
    input_gradient = x.grad.clone()
    dist.all_reduce(input_gradient)  # backward: sum the partial input gradients
    return {
        "output": out.cpu(),
        "input gradient": input_gradient.cpu(),
        "my weight gradient": w1.grad.cpu(),  # no communication needed: my slice only
        "my rows": (int(up[0]), int(up[-1]) + 1),
    }


def _dtensor_attention(attention: Attention, mesh, x: torch.Tensor) -> dict:
    """Attention split by heads: ``q``, ``k``, ``v`` column-wise, ``o`` row-wise."""
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel()}
    parallelize_module(attention, mesh, {**plan, "o": RowwiseParallel()})
    with CommDebugMode() as forward:
        out = attention(x)
    local_rows = attention.q.weight.to_local().shape[0]
    return {
        "output": _plain(out),
        "heads here": local_rows // attention.head_size,
        "forward collectives": _counts(forward),
    }


def _dtensor_block(
    layer: Block, mesh, x: torch.Tensor, sequence_parallel: bool, rank: int, world_size: int
) -> dict:
    """The block under :func:`block_plan`: output, gradients, traffic, kept tensors.

    With sequence parallelism the block takes, and returns, this rank's ``1/N`` of
    the sequence (as the block below would hand it over); the output and input
    gradient returned are then this rank's share of them.
    """
    parallelize_module(layer, mesh, block_plan(sequence_parallel))
    if sequence_parallel:
        x = torch.tensor_split(x, world_size, dim=1)[rank]
    x = x.clone().requires_grad_(True)
    with CommDebugMode() as forward, CollectiveSizes() as sizes, saved_tensors(layer) as kept:
        out = layer(x)
    with CommDebugMode() as backward, CollectiveSizes() as backward_sizes:
        out.sum().backward()  # the loss is the sum over every rank's share
    return {
        "output": _plain(out),
        "input gradient": _plain(x.grad),
        "partial gradients": [
            n
            for n, p in layer.named_parameters()
            if isinstance(p.grad, DTensor) and p.grad.placements[0].is_partial()
        ],
        "weight gradients": {n: _plain(p.grad) for n, p in layer.named_parameters()},
        "forward collectives": _counts(forward),
        "backward collectives": _counts(backward),
        "collective sizes": sizes.sizes + backward_sizes.sizes,
        "kept": kept,
        "kept bytes": sum(row[1] for row in kept),
    }


def worker(
    rank: int,
    world_size: int,
    hidden: int = 16,
    ffn: int = 64,
    heads: int = 8,
    batch: int = 2,
    seq: int = 5,
    seed: int = 0,
    block_seq: int = 8,
) -> dict:
    """Split the MLP and the attention block of :func:`layers`, then the transformer
    :class:`Block` (on sequences of ``block_seq`` tokens), over ``world_size`` ranks.

    ``ffn``, ``heads`` and ``block_seq`` must be divisible by ``world_size``
    (DTensor's even split). Returns the outputs and gradients of each version (see
    the module); ``"block"`` maps ``"TP"``, ``"TP + SP"`` (DTensor's plans) and
    ``"SP, re-gather"`` (:class:`RegatherBlock`) to the three splits of the block.
    """
    for name, value in (("ffn", ffn), ("heads", heads), ("block_seq", block_seq)):
        if _checks.count(name, value, minimum=1) % world_size:
            raise ValueError(f"{name} must be divisible by world_size = {world_size}, got {value}")
    dev = device()
    mesh = init_device_mesh(dev.type, (world_size,))
    x = layer_input(batch, seq, hidden, seed).to(dev)
    mlp, attention = (m.to(dev) for m in layers(hidden, ffn, heads, seed))
    result = {"by hand": _by_hand_mlp(mlp, rank, world_size, x)}
    result["DTensor"] = _dtensor_mlp(mlp, mesh, x)
    result["attention"] = _dtensor_attention(attention, mesh, x)
    x_block = block_input(batch, block_seq, hidden, seed).to(dev)
    result["block"] = {
        name: _dtensor_block(
            block(hidden, ffn, heads, seed).to(dev), mesh, x_block, sp, rank, world_size
        )
        for name, sp in (("TP", False), ("TP + SP", True))
    }
    result["block"]["SP, re-gather"] = _regather_block(
        block(hidden, ffn, heads, seed).to(dev), x_block, rank, world_size
    )
    rows = result["by hand"]["my rows"]
    print(
        f"holds hidden units {rows[0]}-{rows[1] - 1} and {result['attention']['heads here']} heads"
    )
    return result


def main(rank: int, world_size: int) -> None:
    """``torchrun`` entry: run :func:`worker`; rank 0 compares with the unsplit layers."""
    heads = 2 * world_size
    got = worker(
        rank,
        world_size,
        ffn=8 * world_size,
        heads=heads,
        hidden=4 * heads,
        block_seq=2 * world_size,
    )
    if rank != 0:
        return
    mlp, attention = layers(4 * heads, 8 * world_size, heads)
    x = layer_input(hidden=4 * heads).requires_grad_(True)
    expected = mlp(x)
    expected.sum().backward()
    for version in ("DTensor", "by hand"):
        error = (got[version]["output"] - expected).abs().max().item()
        grad_error = (got[version]["input gradient"] - x.grad).abs().max().item()
        print(f"{version:8s}: output {error:.1e}, input gradient {grad_error:.1e} from unsplit")
    error = (got["attention"]["output"] - attention(x)).abs().max().item()
    print(f"attention by heads: {error:.1e} from unsplit")
    print(f"DTensor collectives: forward {got['DTensor']['forward collectives']},")
    print(f"                     backward {got['DTensor']['backward collectives']}")
    for name, run in got["block"].items():
        print(
            f"block, {name}: forward {run['forward collectives']},"
            f" backward {run['backward collectives']}, keeps {run['kept bytes']:,} bytes"
        )


if __name__ == "__main__":
    torchrun_main(main)
