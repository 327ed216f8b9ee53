"""Context parallelism on real processes (chapter 10).

Two ways to run causal attention on a sequence split over the ranks of a process
group, each a differentiable function of tensors shaped
``(batch, heads, local_seq, head_dim)``:

* :func:`ring_attention`: each rank keeps its queries; the keys and values travel
  round a ring (``batch_isend_irecv`` to the next rank, from the previous one),
  and the partial results are merged with the online softmax (a running maximum
  and sum per query, kept as a log-sum-exp). Backward passes the keys and
  values round again together with their gradients, which take one step more to
  reach the rank that owns them (Liu et al. 2023, "Ring Attention"). With
  ``layout="zigzag"`` each rank holds chunks ``r`` and ``2N - 1 - r`` of the
  sequence and skips the parts of each block the causal mask hides, so every rank
  does the same work;
* :func:`ulysses_attention`: all-to-alls trade the sequence split for a head
  split, each rank attends over the whole sequence for ``heads / N`` query
  heads, and the output goes back (Jacobs et al. 2023, "DeepSpeed-Ulysses").
  With grouped-query attention and fewer key-value heads than ranks, each
  key-value head is first copied ``N / kv_heads`` times, as DeepSpeed's
  ``UlyssesSPAttentionHF`` does, so that every rank gets the one its query
  heads share.

Both take grouped-query attention (keys and values with fewer heads than the
queries, query head ``i`` using key-value head ``i // (heads / kv_heads)``),
and both can count what they do in a :class:`Tally`: bytes handed to the
transport, bytes it delivered (counted in the receive buffers, which start as
NaN: an element counts once the transport has overwritten it), blocks of
attention computed, visible query-key pairs. :func:`worker` runs both, forward and
backward, on a sequence drawn from a seed, and tries PyTorch's own
``context_parallel``. The same file runs on a GPU node, one process per GPU::

    torchrun --nproc-per-node=8 -m trainscale.workers.context
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn import functional as F

from trainscale import _checks
from trainscale.context import token_positions, ulysses_heads_per_rank, ulysses_kv_replicas
from trainscale.distributed import device, torchrun_main


@dataclass
class Tally:
    """What one rank did: bytes it sent and received, and attention work, per pass.

    ``bytes_sent`` adds up the tensors handed to the send calls (for an
    all-to-all, the slices bound for other ranks); ``bytes_received`` counts
    what arrived from other ranks: the receive buffers start as NaN, and an
    element counts once the transport has overwritten it (the inputs hold no
    NaN); ``received_per_call`` lists what each transfer brought, in order (in
    Ulysses' forward: the queries, the keys, the values, then the output).
    ``blocks`` counts computed scores in units of one rank's queries against one
    rank's keys (``L x L``); ``pairs`` counts the visible (query, key) pairs.
    """

    bytes_sent: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    bytes_received: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    received_per_call: list[int] = field(default_factory=list)
    blocks: float = 0.0
    pairs: int = 0


Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""A block's rows (queries) and columns (keys) that hold a visible score, and the mask on them."""


def _group_ranks(group: dist.ProcessGroup | None) -> tuple[int, int, int, int]:
    """``(rank, size, global next, global previous)`` in ``group``'s ring."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    members = dist.get_process_group_ranks(group or dist.group.WORLD)
    return rank, size, members[(rank + 1) % size], members[(rank - 1) % size]


def _receive_buffer(like: torch.Tensor, tally: Tally | None) -> torch.Tensor:
    """A contiguous buffer shaped as ``like``; all NaN when counting, so unfilled elements show.

    Contiguous whatever ``like``'s strides: the transport fills the storage in order.
    """
    if tally is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    return torch.full_like(like, float("nan"), memory_format=torch.contiguous_format)


def _delivered(received: torch.Tensor) -> int:
    """Bytes of ``received`` that the transport filled: its elements that are no longer NaN."""
    return int(received.numel() - received.isnan().sum().item()) * received.element_size()


def _start_rotation(
    tensor: torch.Tensor, after: int, before: int, tally: Tally | None, phase: str
) -> tuple[torch.Tensor, list]:
    """Send ``tensor`` to rank ``after`` and receive its twin from ``before``, without waiting."""
    incoming = _receive_buffer(tensor, tally)
    ops = [dist.P2POp(dist.isend, tensor, after), dist.P2POp(dist.irecv, incoming, before)]
    if tally is not None:
        tally.bytes_sent[phase] += tensor.numel() * tensor.element_size()
    return incoming, dist.batch_isend_irecv(ops)


def _finish(
    requests: list, incoming: torch.Tensor, tally: Tally | None = None, phase: str = "forward"
) -> None:
    """Wait for a rotation; with ``tally``, count the bytes that arrived in ``incoming``."""
    for request in requests:
        request.wait()
    if tally is not None:
        tally.bytes_received[phase] += _delivered(incoming)
        tally.received_per_call.append(_delivered(incoming))


def _expand(t: torch.Tensor, groups: int) -> torch.Tensor:
    """Each key-value head repeated ``groups`` times: copy ``i`` is head ``i // groups``."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of :func:`_expand` for gradients: the sum over each key-value head's copies."""
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.reshape(b, h // groups, groups, s, d).sum(dim=2)


def _visible_parts(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool) -> Part | None:
    """Rows and columns of a block that hold a visible score, and the mask on them.

    ``None`` if the causal mask hides the whole block.
    """
    if not causal:
        rows, cols = torch.arange(len(q_pos)), torch.arange(len(k_pos))
        return rows, cols, torch.ones(len(q_pos), len(k_pos), dtype=torch.bool)
    visible = q_pos[:, None] >= k_pos[None, :]
    rows = visible.any(dim=1).nonzero().flatten()
    cols = visible.any(dim=0).nonzero().flatten()
    if len(rows) == 0:
        return None
    return rows, cols, visible[rows][:, cols]


def _count_work(tally: Tally | None, part: Part | None, local: int) -> None:
    """Add a block's computed scores (in ``L x L`` blocks) and its visible pairs to ``tally``."""
    if tally is not None and part is not None:
        rows, cols, mask = part
        tally.blocks += len(rows) * len(cols) / (local * local)
        tally.pairs += int(mask.sum())


def _scores(q: torch.Tensor, k: torch.Tensor, part: Part, scale: float) -> torch.Tensor:
    """Scaled scores of the selected rows and columns, hidden ones at ``-inf``."""
    rows, cols, mask = part
    s = torch.matmul(q[..., rows, :], k[..., cols, :].transpose(-1, -2)) * scale
    return s.masked_fill(~mask.to(s.device), float("-inf"))


def _merge_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    part: Part,
    scale: float,
    out: torch.Tensor,
    row_max: torch.Tensor,
    row_sum: torch.Tensor,
) -> None:
    """The online softmax: fold one block of keys and values into ``out`` (in place).

    ``out`` holds the unnormalised output, ``row_max`` the largest score so far
    and ``row_sum`` the sum of ``exp(score - row_max)`` of every query.
    """
    rows, cols, _ = part
    s = _scores(q, k, part, scale)
    new_max = torch.maximum(row_max[..., rows], s.amax(dim=-1))
    rescale = torch.exp(row_max[..., rows] - new_max)
    p = torch.exp(s - new_max[..., None])
    out[..., rows, :] = out[..., rows, :] * rescale[..., None] + p @ v[..., cols, :]
    row_sum[..., rows] = row_sum[..., rows] * rescale + p.sum(dim=-1)
    row_max[..., rows] = new_max


def _block_gradients(
    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    part: Part,
    scale: float,
    saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> None:
    """Add one block's share of the query, key and value gradients (in place).

    ``saved`` is ``(lse, d_out, delta)``: the log-sum-exp of each query's scores
    from forward, the output gradient, and ``rowsum(d_out * out)``; ``grads`` is
    ``(dq, dk, dv)``. With ``p`` rebuilt from ``lse``: ``dv += p^T d_out``,
    ``ds = p (d_out v^T - delta)``, ``dq += ds k``, ``dk += ds^T q`` (times the scale).
    """
    q, k, v = qkv
    lse, d_out, delta = saved
    dq, dk, dv = grads
    rows, cols, _ = part
    p = torch.exp(_scores(q, k, part, scale) - lse[..., rows, None])
    g = d_out[..., rows, :]
    dv[..., cols, :] += p.transpose(-1, -2) @ g
    ds = p * (g @ v[..., cols, :].transpose(-1, -2) - delta[..., rows, None])
    dq[..., rows, :] += ds @ k[..., cols, :] * scale
    dk[..., cols, :] += ds.transpose(-1, -2) @ q[..., rows, :] * scale


Layout = str | Callable[[int, int, int], Sequence[int]]
"""A layout's name, or a function ``(seq_len, ranks, rank) -> positions`` (chapter 10's
exercise: the reader's own zig-zag split)."""


def _positions(rank: int, size: int, local: int, layout: Layout, dev: torch.device) -> torch.Tensor:
    """Positions in the whole sequence of ``rank``'s tokens, as a tensor on ``dev``."""
    if callable(layout):
        held = [int(p) for p in layout(local * size, size, rank)]
    else:
        held = token_positions(local * size, size, rank, layout)
    return torch.tensor(held, dtype=torch.long, device=dev)


class RingAttention(torch.autograd.Function):
    """Ring attention as an autograd function; call it through :func:`ring_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, layout, tally):
        rank, size, after, before = _group_ranks(group)
        local, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
        my_pos = _positions(rank, size, local, layout, q.device)
        out = torch.zeros_like(q)
        row_max = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        row_sum = torch.zeros(q.shape[:-1], dtype=q.dtype, device=q.device)
        groups = q.shape[1] // k.shape[1]
        kv = torch.stack([k, v]).contiguous()
        for step in range(size):
            if step < size - 1:  # start passing the block on before computing with it
                incoming, requests = _start_rotation(kv, after, before, tally, "forward")
            source = (rank - step) % size
            part = _visible_parts(my_pos, _positions(source, size, local, layout, q.device), causal)
            if part is not None:
                k_all, v_all = _expand(kv[0], groups), _expand(kv[1], groups)
                _merge_block(q, k_all, v_all, part, scale, out, row_max, row_sum)
            _count_work(tally, part, local)
            if step < size - 1:
                _finish(requests, incoming, tally, "forward")
                kv = incoming
        out = out / row_sum[..., None]
        lse = row_max + torch.log(row_sum)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.settings = (group, causal, layout, tally)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, layout, tally = ctx.settings
        rank, size, after, before = _group_ranks(group)
        local, scale = q.shape[-2], 1.0 / math.sqrt(q.shape[-1])
        my_pos = _positions(rank, size, local, layout, q.device)
        delta = (d_out * out).sum(dim=-1)  # D = rowsum(dO * O), as in FlashAttention-2
        dq = torch.zeros_like(q)
        groups = q.shape[1] // k.shape[1]
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros_like(kv)
        for step in range(size):
            source = (rank - step) % size
            part = _visible_parts(my_pos, _positions(source, size, local, layout, q.device), causal)
            if part is not None:
                k_all, v_all = _expand(kv[0], groups), _expand(kv[1], groups)
                dk_all, dv_all = torch.zeros_like(k_all), torch.zeros_like(v_all)
                grads = (dq, dk_all, dv_all)
                _block_gradients((q, k_all, v_all), part, scale, (lse, d_out, delta), grads)
                dkv[0] += _fold(dk_all, groups)
                dkv[1] += _fold(dv_all, groups)
            # No overlap here: each transfer is waited for before the next block's work.
            if step < size - 1:  # keys, values and their gradients move on together
                incoming, requests = _start_rotation(kv, after, before, tally, "backward")
                _finish(requests, incoming, tally, "backward")
                kv = incoming
            incoming, requests = _start_rotation(dkv, after, before, tally, "backward")
            _finish(requests, incoming, tally, "backward")
            dkv = incoming  # after the last step, this brings each rank its own dK, dV
        return dq, dkv[0], dkv[1], None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    *,
    layout: Layout = "contiguous",
    tally: Tally | None = None,
) -> torch.Tensor:
    """Attention over a sequence split across ``group``, keys and values passed round a ring.

    ``q``: this rank's tokens, ``(batch, heads, local_seq, head_dim)``, the same
    ``local_seq`` on every rank; ``k``, ``v``: ``(batch, kv_heads, local_seq,
    head_dim)``, ``kv_heads`` dividing ``heads`` (grouped-query attention; the
    ring passes only these); in the order :func:`trainscale.context.token_positions`
    gives for ``layout`` (``"contiguous"``: rank ``r`` holds tokens
    ``r L .. (r+1) L - 1``; ``"zigzag"``: chunks ``r`` and ``2N - 1 - r`` of ``2N``), or
    in the order a function ``layout(seq_len, ranks, rank)`` gives (a list of
    ``local_seq`` positions per rank, each position on exactly one rank).
    Returns this rank's rows of ``softmax(q k^T / sqrt(head_dim)) v``, causal if
    ``causal``; differentiable in ``q``, ``k`` and ``v``. ``tally``, if given,
    counts bytes sent and work done.
    """
    _check_qkv(q, k, v)
    _checks.boolean("causal", causal)
    if not callable(layout):
        _checks.choice("layout", layout, ("contiguous", "zigzag"))
    return RingAttention.apply(q, k, v, group, causal, layout, tally)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``q`` is ``(batch, heads, local_seq, head_dim)``; ``k`` and ``v`` share a shape with
    ``kv_heads`` dividing ``heads`` in place of ``heads`` (grouped-query attention)."""
    shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            "q, k and v must be (batch, heads, local_seq, head_dim), k and v of one shape,"
            f" got {shapes}"
        )
    same = (q.shape[0], q.shape[2], q.shape[3]) == (k.shape[0], k.shape[2], k.shape[3])
    if not same or q.shape[1] % k.shape[1]:
        raise ValueError(
            "k and v must match q but for their heads, which must divide q's"
            f" (grouped-query attention), got {shapes}"
        )


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` along dim 0, whose backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, tally, phase):
        ctx.settings = (group, tally)
        return _all_to_all(x, group, tally, phase)

    @staticmethod
    def backward(ctx, grad):
        group, tally = ctx.settings
        return _all_to_all(grad.contiguous(), group, tally, "backward"), None, None, None


def _all_to_all(
    x: torch.Tensor, group: dist.ProcessGroup | None, tally: Tally | None, phase: str
) -> torch.Tensor:
    """Send the ``i``-th slice of ``x`` along dim 0 to rank ``i``; stack what arrives."""
    received = _receive_buffer(x, tally)
    dist.all_to_all_single(received, x.contiguous(), group=group)
    if tally is not None:
        me = dist.get_rank(group)
        others = [i for i in range(x.shape[0]) if i != me]
        tally.bytes_sent[phase] += sum(x[i].numel() for i in others) * x.element_size()
        arrived = sum(_delivered(received[i]) for i in others)
        tally.bytes_received[phase] += arrived
        tally.received_per_call.append(arrived)
    return received


def _sequence_to_heads(
    x: torch.Tensor, group: dist.ProcessGroup | None, tally: Tally | None
) -> torch.Tensor:
    """``(b, H, L, d)`` split by sequence -> ``(b, H/N, N L, d)`` split by heads."""
    size = dist.get_world_size(group)
    b, h, local, d = x.shape
    chunks = x.reshape(b, size, h // size, local, d).transpose(0, 1)  # head group first
    received = _AllToAll.apply(chunks, group, tally, "forward")  # now: sequence chunk first
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * local, d)


def _heads_to_sequence(
    x: torch.Tensor, group: dist.ProcessGroup | None, tally: Tally | None
) -> torch.Tensor:
    """The inverse of :func:`_sequence_to_heads`."""
    size = dist.get_world_size(group)
    b, h_local, seq, d = x.shape
    chunks = x.reshape(b, h_local, size, seq // size, d).permute(2, 0, 1, 3, 4)
    received = _AllToAll.apply(chunks, group, tally, "forward")  # head group first
    return received.transpose(0, 1).reshape(b, size * h_local, seq // size, d)


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    causal: bool = True,
    *,
    tally: Tally | None = None,
) -> torch.Tensor:
    """Attention over a sequence split across ``group``, by swapping the split to the heads.

    ``q``: this rank's contiguous slice of the sequence, ``(batch, heads,
    local_seq, head_dim)``; ``k``, ``v``: the same with ``kv_heads`` dividing
    ``heads`` (grouped-query attention). Three all-to-alls give each rank the
    whole sequence for ``heads / N`` query heads and the key-value heads they
    share; it attends; a fourth returns its slice of the output. ``heads`` must
    be divisible by the group's size ``N``; ``kv_heads`` divisible by ``N`` or
    dividing it (:func:`trainscale.context.ulysses_kv_replicas`: fewer
    key-value heads than ranks are copied ``N / kv_heads`` times before the
    all-to-all, and their gradients summed back in backward). ``ValueError``
    otherwise, before any communication. Differentiable.
    """
    _check_qkv(q, k, v)
    size = dist.get_world_size(group)
    ulysses_heads_per_rank(q.shape[1], size)
    replicas = ulysses_kv_replicas(k.shape[1], size)
    k, v = _expand(k, replicas), _expand(v, replicas)
    q_h, k_h, v_h = (_sequence_to_heads(t, group, tally) for t in (q, k, v))
    groups = q_h.shape[1] // k_h.shape[1]  # query heads per key-value head on this rank
    causal = _checks.boolean("causal", causal)
    out = F.scaled_dot_product_attention(
        q_h, _expand(k_h, groups), _expand(v_h, groups), is_causal=causal
    )
    return _heads_to_sequence(out, group, tally)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True):
    """Plain attention on the whole sequence in one process, written out in full.

    With fewer key-value heads than query heads (grouped-query attention), query
    head ``i`` attends with key-value head ``i // (heads / kv_heads)``.
    """
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        seq = q.shape[-2]
        hidden = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def sequence_inputs(
    batch: int = 1,
    heads: int = 2,
    seq: int = 64,
    head_dim: int = 8,
    seed: int = 0,
    kv_heads: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Queries, keys, values and an output gradient for the whole sequence, float64.

    Drawn in float64 from ``seed``, the same on every rank and every CPU. Keys and
    values have ``kv_heads`` heads (default ``heads``), which must divide ``heads``.
    """
    g = torch.Generator().manual_seed(_checks.count("seed", seed))
    shape = (
        _checks.count("batch", batch, minimum=1),
        _checks.count("heads", heads, minimum=1),
        _checks.count("seq", seq, minimum=1),
        _checks.count("head_dim", head_dim, minimum=1),
    )
    kv = heads if kv_heads is None else _checks.count("kv_heads", kv_heads, minimum=1)
    if heads % kv:
        raise ValueError(f"kv_heads must divide heads = {heads}, got {kv_heads}")
    kv_shape = (shape[0], kv, *shape[2:])
    return tuple(
        torch.randn(size, generator=g, dtype=torch.float64)
        for size in (shape, kv_shape, kv_shape, shape)
    )


def _my_tokens(
    tensors: Sequence[torch.Tensor], rank: int, size: int, layout: str, dev: torch.device
) -> list[torch.Tensor]:
    """Each tensor's tokens that ``rank`` holds, as leaves that collect gradients."""
    index = _positions(rank, size, tensors[0].shape[-2] // size, layout, torch.device("cpu"))
    return [t[..., index, :].to(dev).clone().requires_grad_(True) for t in tensors]


def _run(
    attention: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    d_out: torch.Tensor,
    rank: int,
    size: int,
    split: str,
    **kwargs: object,
) -> dict:
    """Forward and backward of one variant on this rank's tokens: output, gradients, tally."""
    dev = device()
    q, k, v = _my_tokens(inputs, rank, size, split, dev)
    (my_d_out,) = _my_tokens([d_out], rank, size, split, dev)
    tally = Tally()
    out = attention(q, k, v, tally=tally, **kwargs)
    out.backward(my_d_out.detach())
    plain = {name: t.detach().cpu() for name, t in (("output", out), ("dq", q.grad))}
    plain |= {"dk": k.grad.cpu(), "dv": v.grad.cpu()}
    return {
        **plain,
        "positions": token_positions(d_out.shape[-2], size, rank, split),
        "bytes sent": dict(tally.bytes_sent),
        "bytes received": dict(tally.bytes_received),
        "received per call": list(tally.received_per_call),
        "blocks": tally.blocks,
        "pairs": tally.pairs,
    }


def _torch_context_parallel(inputs: Sequence[torch.Tensor], size: int) -> dict:
    """PyTorch's own ``context_parallel`` on this rank's process group: output, or the error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard

    dev = device()
    q, k, v = (t.to(dev).clone() for t in inputs[:3])
    try:
        mesh = init_device_mesh(dev.type, (size,))
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            (whole,) = context_parallel_unshard(mesh, [out], [2])
        return {"output": whole.detach().cpu(), "error": None}
    except Exception as error:  # whatever PyTorch raises, the chapter reports it
        return {"output": None, "error": f"{type(error).__name__}: {error}".split("\n")[0]}


def worker(
    rank: int,
    world_size: int,
    batch: int = 1,
    heads: int = 2,
    local_seq: int = 16,
    head_dim: int = 8,
    seed: int = 0,
    try_torch: bool = True,
    causal: bool = True,
    kv_heads: int | None = None,
) -> dict:
    """Attention on ``world_size * local_seq`` tokens, three ways, forward and backward.

    ``kv_heads`` (default ``heads``): the keys' and values' heads, grouped-query
    attention when fewer. Returns, per variant (``"ring"``, ``"ring zigzag"``,
    ``"ulysses"``), this rank's output and gradients (float64), the positions of
    its tokens, the bytes it sent and received per pass, and the attention work
    it did; and, with ``try_torch``, what PyTorch's ``context_parallel`` gave
    (``"torch"``: output or error).
    """
    _checks.count("local_seq", local_seq, minimum=2)
    if local_seq % 2:
        raise ValueError(f"local_seq must be even (zig-zag halves it), got {local_seq}")
    ulysses_heads_per_rank(heads, world_size)
    ulysses_kv_replicas(heads if kv_heads is None else kv_heads, world_size)
    inputs = sequence_inputs(batch, heads, world_size * local_seq, head_dim, seed, kv_heads)
    q_k_v, d_out = inputs[:3], inputs[3]
    mask = {"causal": _checks.boolean("causal", causal)}
    result = {
        "ring": _run(ring_attention, q_k_v, d_out, rank, world_size, "contiguous", **mask),
        "ring zigzag": _run(
            ring_attention, q_k_v, d_out, rank, world_size, "zigzag", layout="zigzag", **mask
        ),
        "ulysses": _run(ulysses_attention, q_k_v, d_out, rank, world_size, "contiguous", **mask),
    }
    if try_torch:
        result["torch"] = _torch_context_parallel(q_k_v, world_size)
    ring, zigzag = result["ring"], result["ring zigzag"]
    print(
        f"blocks of attention: ring {ring['blocks']:g}, zig-zag {zigzag['blocks']:g};"
        f" received {ring['bytes received']['forward']:,} B forward,"
        f" {ring['bytes received']['backward']:,} B backward"
    )
    return result


def main(rank: int, world_size: int) -> None:
    """``torchrun`` entry: run :func:`worker`; rank 0 compares with one-process attention.

    Grouped-query attention with one key-value head for ``2 N`` query heads: the
    case where Ulysses copies the key-value head to every rank.
    """
    heads, kv_heads = 2 * world_size, 1
    got = worker(rank, world_size, heads=heads, try_torch=False, kv_heads=kv_heads)
    if rank != 0:
        return
    *q_k_v, d_out = sequence_inputs(heads=heads, seq=16 * world_size, kv_heads=kv_heads)
    q, k, v = (t.requires_grad_(True) for t in q_k_v)
    expected = reference_attention(q, k, v)
    expected.backward(d_out)
    for name, result in got.items():
        index = result["positions"]
        error = max(
            (result["output"] - expected.detach()[..., index, :]).abs().max().item(),
            (result["dq"] - q.grad[..., index, :]).abs().max().item(),
        )
        print(f"{name}: rank 0's output and dq within 1e-12 of one process: {error < 1e-12}")


if __name__ == "__main__":
    torchrun_main(main)
