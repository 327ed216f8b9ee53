"""Context parallelism inside a two-dimensional mesh, on real processes (chapter 10).

Two runs on a ``DeviceMesh`` of four ranks:

* :func:`gradients_worker`, data x context parallelism (``dp`` x ``cp``): each
  data-parallel rank takes its own sequences, each context-parallel rank a zig-zag
  share of their tokens (ring attention over the ``cp`` ranks, from
  :mod:`trainscale.workers.context`). Every rank holds the whole model, so the
  gradients are reduced over the ``dp`` and ``cp`` ranks together: the mesh's two
  dimensions flattened into one (``DeviceMesh._flatten``, a private API, as
  torchtitan uses it), the group Megatron-Core calls
  ``get_data_parallel_group(with_context_parallel=True)``. The run reduces them
  by hand, over the flattened group and over ``dp`` alone, and with FSDP2's
  ``fully_shard`` on the flattened mesh, which also shards the weights and their
  gradients four ways;
* :func:`hybrid_worker`, DeepSpeed-Ulysses inside a ring (USP, Fang & Zhao 2024;
  Megatron-Core's ``cp_comm_type="a2a+p2p"``): all-to-alls over the ranks of one
  ``ulysses`` group (consecutive ranks, as on one node), ring attention over the
  ``ring`` ranks; the token layout is USP's (``zigzag_extract_local`` in its
  code): ring rank ``j`` owns zig-zag chunks ``j`` and ``2R - 1 - j`` of ``2R``,
  and its Ulysses ranks hold consecutive slices of them.

Both draw their inputs in float64 from a seed, the same on every rank, and return
plain tensors that the chapter compares with attention in one process. The same
file runs on a GPU node::

    torchrun --nproc-per-node=4 -m trainscale.workers.context_mesh
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainscale import _checks
from trainscale.context import token_positions, ulysses_heads_per_rank, ulysses_kv_replicas
from trainscale.distributed import device, torchrun_main
from trainscale.workers.context import (
    Tally,
    _expand,
    _heads_to_sequence,
    _sequence_to_heads,
    reference_attention,
    ring_attention,
    sequence_inputs,
)

NAMES = ("wq", "wk", "wv", "wo")
"""The attention block's weights: query, key and value projections, output projection."""


def block_inputs(
    sequences: int, seq: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Weights of one attention block, inputs and targets, float64 from ``seed``.

    ``wq`` and ``wo`` are ``(heads d, heads d)``, ``wk`` and ``wv`` ``(kv_heads d,
    heads d)``; ``x`` and ``y`` are ``(sequences, seq, heads d)``. The same on every
    rank and every CPU.
    """
    g = torch.Generator().manual_seed(_checks.count("seed", seed))
    width = _checks.count("heads", heads, minimum=1) * _checks.count("head_dim", head_dim, 1)
    kv = _checks.count("kv_heads", kv_heads, minimum=1) * head_dim
    if heads % kv_heads:
        raise ValueError(f"kv_heads must divide heads = {heads}, got {kv_heads}")
    shapes = {"wq": (width, width), "wk": (kv, width), "wv": (kv, width), "wo": (width, width)}
    drawn = {
        name: torch.randn(shape, generator=g, dtype=torch.float64) / width**0.5
        for name, shape in shapes.items()
    }
    for name in ("x", "y"):
        n, s = _checks.count("sequences", sequences, 1), _checks.count("seq", seq, 1)
        drawn[name] = torch.randn((n, s, width), generator=g, dtype=torch.float64)
    return drawn


def one_process_gradients(
    sequences: int, seq: int, heads: int, kv_heads: int, head_dim: int, seed: int = 0
) -> dict[str, torch.Tensor]:
    """The block's loss and weight gradients on whole sequences in one process.

    Written out with plain matrix products and
    :func:`trainscale.workers.context.reference_attention` (full causal attention,
    no split, no ring, no reduction): the loss is the mean squared error over every
    sequence, token and feature. Keys ``"loss"`` and :data:`NAMES`.
    """
    drawn = block_inputs(sequences, seq, heads, kv_heads, head_dim, seed)
    w = {name: drawn[name].clone().requires_grad_(True) for name in NAMES}
    x, y = drawn["x"], drawn["y"]

    def split(t: torch.Tensor, n: int) -> torch.Tensor:  # (b, s, n d) -> (b, n, s, d)
        return t.reshape(t.shape[0], t.shape[1], n, head_dim).transpose(1, 2)

    q, k, v = (
        split(x @ w["wq"].T, heads),
        split(x @ w["wk"].T, kv_heads),
        split(x @ w["wv"].T, kv_heads),
    )
    out = reference_attention(q, k, v).transpose(1, 2).reshape(x.shape)
    loss = ((out @ w["wo"].T - y) ** 2).mean()
    loss.backward()
    return {"loss": loss.detach(), **{name: w[name].grad for name in NAMES}}


class AttentionBlock(torch.nn.Module):
    """One attention block on this rank's tokens, attention by ring over ``group``."""

    def __init__(self, weights: dict[str, torch.Tensor], heads: int, kv_heads: int, group):
        super().__init__()
        for name in NAMES:
            self.register_parameter(name, torch.nn.Parameter(weights[name].clone()))
        self.heads, self.kv_heads, self.group = heads, kv_heads, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: this rank's tokens, ``(sequences, local_seq, width)``, in zig-zag order."""
        d = x.shape[-1] // self.heads

        def split(t: torch.Tensor, n: int) -> torch.Tensor:
            return t.reshape(t.shape[0], t.shape[1], n, d).transpose(1, 2)

        q = split(x @ self.wq.T, self.heads)
        k, v = split(x @ self.wk.T, self.kv_heads), split(x @ self.wv.T, self.kv_heads)
        out = ring_attention(q, k, v, group=self.group, layout="zigzag")
        return out.transpose(1, 2).reshape(x.shape) @ self.wo.T


def _local_loss(block: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, share: int):
    """This rank's part of the mean squared error: its tokens' squared errors summed, over
    ``share`` times its own count of elements (``share`` = the ranks whose parts add up)."""
    return ((block(x) - y) ** 2).sum() / (x.numel() * share)


def gradients_worker(
    rank: int,
    world_size: int,
    dp: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    local_seq: int = 8,
    head_dim: int = 4,
    seed: int = 0,
) -> dict:
    """One backward of an attention block on a ``dp x cp`` mesh (``cp = world_size / dp``).

    Data-parallel rank ``i`` takes sequence ``i``; context-parallel rank ``j`` its
    zig-zag share of ``cp * local_seq`` tokens. Returns the weight gradients summed
    over the flattened ``dp x cp`` group (``"over dp x cp"``) and over ``dp`` alone
    (``"over dp"``), FSDP2's on the flattened mesh (``"fsdp"``, gathered whole), the
    share of each weight this rank holds under FSDP2, and its mesh coordinates.
    """
    from torch.distributed.fsdp import fully_shard

    n_dp = _checks.count("dp", dp, minimum=1)
    if world_size % n_dp:
        raise ValueError(f"dp must divide the {world_size} ranks, got {dp}")
    cp = world_size // n_dp
    mesh = init_device_mesh(device().type, (n_dp, cp), mesh_dim_names=("dp", "cp"))
    flat = mesh["dp", "cp"]._flatten("dp_cp")  # a private API, as torchtitan uses it
    i, j = mesh.get_local_rank("dp"), mesh.get_local_rank("cp")
    drawn = block_inputs(n_dp, cp * local_seq, heads, kv_heads, head_dim, seed)
    mine = token_positions(cp * local_seq, cp, j, "zigzag")
    x, y = (drawn[name][i : i + 1, mine].to(device()) for name in ("x", "y"))

    block = AttentionBlock({n: drawn[n] for n in NAMES}, heads, kv_heads, mesh.get_group("cp"))
    block.to(device())
    _local_loss(block, x, y, n_dp * cp).backward()
    reduced = {}
    for label, group in (("over dp x cp", flat.get_group()), ("over dp", mesh.get_group("dp"))):
        grads = {name: getattr(block, name).grad.clone() for name in NAMES}
        for grad in grads.values():
            dist.all_reduce(grad, group=group)
        reduced[label] = {name: g.cpu() for name, g in grads.items()}

    sharded = AttentionBlock({n: drawn[n] for n in NAMES}, heads, kv_heads, mesh.get_group("cp"))
    fully_shard(sharded.to(device()), mesh=flat)
    # FSDP2 averages over its n_dp x cp ranks: the local loss is the rank's mean.
    _local_loss(sharded, x, y, 1).backward()
    params = {name: getattr(sharded, name) for name in NAMES}
    fsdp = {name: p.grad.full_tensor().cpu() for name, p in params.items()}
    held = sum(p.to_local().numel() for p in params.values())
    whole = sum(p.numel() for p in params.values())
    print(f"mesh (dp {i}, cp {j}): holds {held:,} of {whole:,} weights under FSDP2")
    return {**reduced, "fsdp": fsdp, "held": held, "whole": whole, "dp": i, "cp": j}


def _hybrid_mesh(ulysses: int, ring: int) -> DeviceMesh:
    """``(ring, ulysses)``: each Ulysses group is ``ulysses`` consecutive ranks (one node)."""
    return init_device_mesh(device().type, (ring, ulysses), mesh_dim_names=("ring", "ulysses"))


def hybrid_positions(seq: int, ulysses: int, ring: int, rank: int) -> list[int]:
    """The positions of ``rank``'s tokens under USP's layout, ``rank = j U + u``.

    Ring rank ``j`` owns zig-zag chunks ``j`` and ``2R - 1 - j``
    (:func:`trainscale.context.token_positions`); Ulysses rank ``u`` of its group
    holds the ``u``-th of ``U`` consecutive slices of them.
    """
    owned = token_positions(seq, ring, rank // ulysses, "zigzag")
    local = len(owned) // ulysses
    u = rank % ulysses
    return owned[u * local : (u + 1) * local]


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mesh: DeviceMesh,
    a2a: Tally | None = None,
    ring: Tally | None = None,
) -> torch.Tensor:
    """Causal attention by all-to-alls over ``mesh["ulysses"]`` and a ring over ``mesh["ring"]``.

    ``q``: ``(batch, heads, local_seq, head_dim)`` of this rank's tokens in the
    order :func:`hybrid_positions` gives; ``k``, ``v`` with ``kv_heads`` heads. The
    key-value heads are copied as Ulysses copies them when there are fewer than
    its ranks; three all-to-alls give each rank its ring rank's tokens for
    ``heads / U`` query heads; ring attention (zig-zag) runs over the ring ranks;
    a fourth all-to-all returns the output. ``a2a`` and ``ring`` count each
    part's bytes. Differentiable.
    """
    ulysses_group, ring_group = mesh.get_group("ulysses"), mesh.get_group("ring")
    size = dist.get_world_size(ulysses_group)
    ulysses_heads_per_rank(q.shape[1], size)
    copies = ulysses_kv_replicas(k.shape[1], size)
    k, v = _expand(k, copies), _expand(v, copies)
    q_h, k_h, v_h = (_sequence_to_heads(t, ulysses_group, a2a) for t in (q, k, v))
    out = ring_attention(q_h, k_h, v_h, group=ring_group, layout="zigzag", tally=ring)
    return _heads_to_sequence(out, ulysses_group, a2a)


def hybrid_worker(
    rank: int,
    world_size: int,
    ulysses: int = 2,
    heads: int = 4,
    kv_heads: int = 1,
    local_seq: int = 8,
    head_dim: int = 8,
    seed: int = 0,
) -> dict:
    """Forward and backward of :func:`hybrid_attention` on ``world_size * local_seq`` tokens.

    ``ring = world_size / ulysses``. Returns this rank's output and ``dq``, ``dk``,
    ``dv`` (float64), the positions of its tokens, and the bytes each part's
    transfers delivered to it, forward and backward.
    """
    u = _checks.count("ulysses", ulysses, minimum=1)
    if world_size % u:
        raise ValueError(f"ulysses must divide the {world_size} ranks, got {ulysses}")
    ring = world_size // u
    mesh = _hybrid_mesh(u, ring)
    seq = world_size * _checks.count("local_seq", local_seq, minimum=1)
    *qkv, d_out = sequence_inputs(1, heads, seq, head_dim, seed, kv_heads)
    index = hybrid_positions(seq, u, ring, rank)
    q, k, v = (t[..., index, :].to(device()).clone().requires_grad_(True) for t in qkv)
    a2a, ring_tally = Tally(), Tally()
    out = hybrid_attention(q, k, v, mesh, a2a, ring_tally)
    out.backward(d_out[..., index, :].to(device()))
    received = {
        "all-to-all": dict(a2a.bytes_received),
        "ring": dict(ring_tally.bytes_received),
    }
    print(
        f"ring {rank // u}, ulysses {rank % u}: received {received['all-to-all']['forward']:,} B"
        f" by all-to-all and {received['ring']['forward']:,} B round the ring, forward"
    )
    plain = {"output": out.detach().cpu(), "dq": q.grad.cpu(), "dk": k.grad.cpu()}
    return {**plain, "dv": v.grad.cpu(), "positions": index, "bytes received": received}


def main(rank: int, world_size: int) -> None:
    """``torchrun`` entry: both runs; rank 0 compares them with one process."""
    got = gradients_worker(rank, world_size, dp=2)
    expected = one_process_gradients(2, world_size // 2 * 8, 4, 2, 4)
    for label in ("over dp x cp", "over dp", "fsdp"):
        same = all(torch.allclose(got[label][n], expected[n], rtol=0, atol=1e-12) for n in NAMES)
        if rank == 0:
            print(f"gradients {label} equal one process: {same}")
    hybrid = hybrid_worker(rank, world_size)
    *qkv, d_out = sequence_inputs(1, 4, world_size * 8, 8, 0, 1)
    q, k, v = (t.requires_grad_(True) for t in qkv)
    full = reference_attention(q, k, v)
    full.backward(d_out)
    index = hybrid["positions"]
    error = (hybrid["output"] - full.detach()[..., index, :]).abs().max().item()
    error = max(error, (hybrid["dq"] - q.grad[..., index, :]).abs().max().item())
    if rank == 0:
        print(f"Ulysses x ring: output and dq within 1e-12 of one process: {error < 1e-12}")


if __name__ == "__main__":
    torchrun_main(main)
