"""Expert parallelism on real processes (chapter 15).

:func:`worker` runs one mixture-of-experts layer (:class:`trainscale.experts.MoELayer`)
with its experts split over the ranks: rank ``r`` runs experts
``r * E/N ... (r + 1) * E/N - 1`` on its own ``1/N`` of the tokens; the router is
replicated, like the attention around it. (For simplicity every rank is handed all the
weights and uses only its experts'; a real run builds only those.) One forward and
backward pass:

1. *route*: each rank scores its tokens with the router, picks each token's
   top-k experts and applies the capacity to its own tokens;
2. *dispatch*: one ``all_to_all_single`` of the expert counts, so that every
   rank knows how many rows will arrive, then one of the rows themselves, each
   token's row sent to the rank of every expert that kept it;
3. *compute*: each rank runs its experts on the rows it received;
4. *combine*: the reverse all-to-all brings the results home, where each is
   weighted by its gate and added into its token's output.

Backward runs the two all-to-alls again, in reverse, with the send and receive
sizes swapped (an all-to-all's gradient is the opposite all-to-all). The
router's gradient is then summed over the ranks with ``all_reduce``, as data
parallelism does for every replicated weight; each expert's gradient stays on its rank.

The same file runs on a GPU node with NCCL, one process per GPU::

    torchrun --nproc-per-node=8 -m trainscale.workers.experts
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainscale import _checks
from trainscale.distributed import device, torchrun_main
from trainscale.experts import MoELayer, Routing, route, sample_tokens


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows, with autograd: backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        ctx.sizes = (send, receive)
        # NaN until written: the caller can check that every row arrived
        out = rows.new_full((sum(receive), *rows.shape[1:]), float("nan"))
        dist.all_to_all_single(
            out, rows.contiguous(), output_split_sizes=receive, input_split_sizes=send
        )
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send, receive = ctx.sizes
        out = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(
            out, grad.contiguous(), output_split_sizes=send, input_split_sizes=receive
        )
        return out, None, None


def all_to_all(rows: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
    """Send ``send[r]`` rows of ``rows`` (in order) to rank ``r``; return the rows received,
    ``receive[r]`` of them from rank ``r``, in rank order. Differentiable."""
    return _AllToAll.apply(rows, send, receive)


def loss_weights(tokens: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """Fixed float64 weights ``G``: the chapter's loss is ``(output * G).sum()``."""
    g = torch.Generator().manual_seed(_checks.count("seed", seed) + 2)
    return torch.randn(tokens, hidden, generator=g, dtype=torch.float64)


def _dispatch_order(routing: Routing) -> torch.Tensor:
    """The kept assignments as (token, slot) rows, sorted by expert (so by destination
    rank, ``expert // experts per rank``), then by preference and token order."""
    token, slot = torch.nonzero(routing.kept, as_tuple=True)
    expert = routing.experts[token, slot]
    order = torch.argsort(expert * routing.kept.numel() + slot * len(routing.kept) + token)
    return torch.stack([token[order], slot[order]], dim=1)


def _exchange_counts(routing: Routing, world_size: int) -> torch.Tensor:
    """(world_size, experts per rank): rows each rank will send me for each of my experts."""
    kept_per_expert = torch.bincount(
        routing.experts[routing.kept], minlength=routing.probabilities.shape[1]
    )
    received = torch.empty_like(kept_per_expert)
    dist.all_to_all_single(received, kept_per_expert)  # E/N counts to each rank
    return received.view(world_size, -1)


def _experts_on_rows(
    layer: MoELayer, first: int, rows: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Run my experts (``first``, ``first + 1``, ...) on the rows received, in place order."""
    local = torch.arange(counts.shape[1]).repeat(counts.shape[0])
    which = torch.repeat_interleave(local, counts.reshape(-1))
    out = torch.zeros_like(rows)
    for e in range(counts.shape[1]):
        index = torch.nonzero(which == e)[:, 0]
        if len(index):
            out = out.index_copy(0, index, layer.expert(first + e, rows[index]))
    return out


def _moe_forward_backward(
    layer: MoELayer,
    rank: int,
    world_size: int,
    x: torch.Tensor,
    weights: torch.Tensor,
    capacity_factor: float | None,
) -> dict:
    """One forward and backward pass of the expert-parallel layer on my tokens ``x``."""
    per_rank = layer.n_experts // world_size
    x = x.clone().requires_grad_(True)
    routing = route(x @ layer.router.T, layer.top_k, capacity_factor, renormalise=layer.renormalise)
    order = _dispatch_order(routing)
    token, slot = order[:, 0], order[:, 1]
    destination = routing.experts[token, slot] // per_rank
    send = torch.bincount(destination, minlength=world_size).tolist()
    counts = _exchange_counts(routing, world_size)
    receive = counts.sum(dim=1).tolist()

    arrived = all_to_all(x[token], send, receive)  # dispatch
    computed = _experts_on_rows(layer, rank * per_rank, arrived, counts)
    returned = all_to_all(computed, receive, send)  # combine
    complete = bool(arrived.isfinite().all() and returned.isfinite().all())
    weighted = returned * routing.gates[token, slot, None]
    out = torch.zeros_like(x).index_add(0, token, weighted)
    (out * weights).sum().backward()

    router_gradient = layer.router.grad.clone()
    dist.all_reduce(router_gradient)  # replicated weight: summed over ranks, as in DP
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return {
        "output": out.detach(),
        "input gradient": x.grad.clone(),
        "router gradient": router_gradient,
        "expert gradients": {
            "w_up": layer.w_up.grad[mine].clone(),
            "w_down": layer.w_down.grad[mine].clone(),
        },
        "dropped": routing.dropped,
        "rows sent": send,
        "bytes received": {
            "dispatch": _bytes_by_source(arrived, receive),
            "combine": _bytes_by_source(returned, send),
        },
        "all rows arrived": complete,
    }


def _bytes_by_source(received: torch.Tensor, sizes: list[int]) -> list[int]:
    """Bytes of the tensor ``all_to_all_single`` filled, cut into what came from each rank."""
    return [part.numel() * part.element_size() for part in received.detach().split(sizes)]


def worker(
    rank: int,
    world_size: int,
    states: tuple[dict[str, torch.Tensor], ...],
    tokens: int,
    top_k: int,
    capacity_factors: tuple[float | None, ...],
    seed: int = 0,
    skew: float = 0.0,
    renormalise: bool = True,
) -> list[list[dict]]:
    """Run the layer with each of the weights ``states`` (``router``, ``w_up``,
    ``w_down``, as :class:`MoELayer` holds them) expert-parallel, once per capacity
    factor: ``result[state][factor]``.

    ``tokens`` (divisible by ``world_size``) come from
    :func:`trainscale.experts.sample_tokens` (``seed``, ``skew``); rank ``r`` takes
    the ``r``-th consecutive slice. The experts must divide evenly over the ranks.
    ``renormalise``: whether the gates are renormalised over the chosen experts.
    Each result (capacity factor ``None``: no capacity) is a dict of this rank's
    output rows, input gradient, the summed router gradient, its experts'
    gradients, the assignments it dropped, the rows it handed to ``all_to_all_single``
    for each rank, the bytes of the tensors that call filled, from each rank, in the
    dispatch and in the combine, and whether every received row was written (the
    buffers start as NaN).
    """
    if not states:
        raise ValueError("states must hold at least one set of weights, got none")
    n_experts, hidden = states[0]["router"].shape
    if n_experts % world_size:
        raise ValueError(f"experts must be divisible by world_size = {world_size}, got {n_experts}")
    n_tokens = _checks.count("tokens", tokens, minimum=1)
    if n_tokens % world_size:
        raise ValueError(f"tokens must be divisible by world_size = {world_size}, got {tokens}")
    dev = device()
    x = sample_tokens(n_tokens, hidden, seed, skew).chunk(world_size)[rank].to(dev)
    weights = loss_weights(n_tokens, hidden, seed).chunk(world_size)[rank].to(dev)
    results = []
    for state in states:
        results.append([])
        for factor in capacity_factors:
            layer = _layer_from(state, top_k, factor, renormalise).to(dev)
            result = _moe_forward_backward(layer, rank, world_size, x, weights, factor)
            results[-1].append(_to_cpu(result))
    first, last = rank * n_experts // world_size, (rank + 1) * n_experts // world_size - 1
    print(f"holds experts {first}-{last} and tokens {rank * n_tokens // world_size}-", end="")
    print(f"{(rank + 1) * n_tokens // world_size - 1}")
    return results


def _layer_from(
    state: dict[str, torch.Tensor], top_k: int, factor: float | None, renormalise: bool
) -> MoELayer:
    """A :class:`MoELayer` holding the weights ``state``."""
    n_experts, hidden = state["router"].shape
    ffn = state["w_up"].shape[2]
    layer = MoELayer(hidden, ffn, n_experts, top_k, factor, renormalise=renormalise)
    with torch.no_grad():
        for name, value in state.items():
            getattr(layer, name).copy_(value)
    return layer


def _to_cpu(value):
    """Tensors (also inside dicts) moved to the CPU; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def main(rank: int, world_size: int) -> None:
    """``torchrun`` entry: run :func:`worker`; rank 0 compares with the one-process layer."""
    experts, tokens = 2 * world_size, 16 * world_size
    layer = MoELayer(8, 16, experts, 2, 1.0, groups=world_size)
    state = {name: p.detach() for name, p in layer.named_parameters()}
    got = worker(rank, world_size, (state,), tokens, 2, (1.0,))[0][0]
    if rank != 0:
        return
    x = sample_tokens(tokens, 8).requires_grad_(True)
    (layer(x) * loss_weights(tokens, 8)).sum().backward()
    mine = slice(0, tokens // world_size)
    error = (got["output"] - layer(x).detach()[mine]).abs().max().item()
    grad_error = (got["input gradient"] - x.grad[mine]).abs().max().item()
    router_error = (got["router gradient"] - layer.router.grad).abs().max().item()
    print(f"rank 0: output {error:.1e}, input gradient {grad_error:.1e},", end=" ")
    print(f"router gradient {router_error:.1e} from the one-process layer")
    received = got["bytes received"]["dispatch"]
    print(f"rank 0 dropped {got['dropped']} assignments, received {received} bytes by source")


if __name__ == "__main__":
    torchrun_main(main)
