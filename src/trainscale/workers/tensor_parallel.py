"""Tensor parallelism on real processes (chapter 06).

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
keep ``1/N`` of the sequence each, as torchtitan's Llama plan does). For each it
returns the output, the gradients, the collectives of each pass and every tensor
autograd keeps for backward (:func:`saved_tensors`).

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


def block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The DTensor plan of a :class:`Block`: Megatron's split, with or without sequence
    parallelism.

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
    """
    sp = _checks.boolean("sequence_parallel", sequence_parallel)
    stream = Shard(1) if sp else Replicate()  # the residual stream between the blocks
    plan: dict[str, ParallelStyle] = {}
    for part, first, second in (("attention", ("q", "k", "v"), "o"), ("mlp", ("up",), "down")):
        plan[part] = PrepareModuleInput(
            input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_output=False
        )
        plan |= {f"{part}.{name}": ColwiseParallel() for name in first}
        plan[f"{part}.{second}"] = RowwiseParallel(output_layouts=stream)
    if sp:
        plan |= {"attention_norm": SequenceParallel(), "mlp_norm": SequenceParallel()}
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


def _counts(mode: CommDebugMode) -> dict[str, int]:
    """``{"all_reduce": 1}`` from CommDebugMode's ``{OpOverloadPacket: count}``."""
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


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
    with CommDebugMode() as forward, saved_tensors(layer) as kept:
        out = layer(x)
    with CommDebugMode() as backward:
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
    the module); ``"block"`` maps ``"TP"`` and ``"TP + SP"`` to the two splits of
    the block.
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
