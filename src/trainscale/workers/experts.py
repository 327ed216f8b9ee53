"""Expert parallelism on real processes (chapter 11).

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

:func:`folding_worker` puts that layer beside data parallelism as Megatron-Core folds
them: a dense weight and the router data-parallel over every rank, the experts
expert-parallel over ``ep`` ranks and expert-data-parallel over the rest, on two
DeviceMeshes; after backward each gradient is summed over its own group, and
:func:`folding_reference` computes the same step in one process.

The same file runs on a GPU node with NCCL, one process per GPU::

    torchrun --nproc-per-node=8 -m trainscale.workers.experts
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from trainscale import _checks
from trainscale.distributed import device, torchrun_main
from trainscale.experts import (
    MoELayer,
    Routing,
    expert_mlps,
    per_token_reference,
    route,
    sample_tokens,
)


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows, with autograd: backward is the reverse exchange."""

    @staticmethod
    def forward(
        ctx, rows: torch.Tensor, send: list[int], receive: list[int], group=None
    ) -> torch.Tensor:
        ctx.sizes, ctx.group = (send, receive), group
        # NaN until written: the caller can check that every row arrived
        out = rows.new_full((sum(receive), *rows.shape[1:]), float("nan"))
        dist.all_to_all_single(
            out, rows.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group
        )
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send, receive = ctx.sizes
        out = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(
            out,
            grad.contiguous(),
            output_split_sizes=send,
            input_split_sizes=receive,
            group=ctx.group,
        )
        return out, None, None, None


def all_to_all(rows: torch.Tensor, send: list[int], receive: list[int], group=None) -> torch.Tensor:
    """Send ``send[r]`` rows of ``rows`` (in order) to rank ``r`` of ``group`` (default: all
    ranks); return the rows received, ``receive[r]`` of them from rank ``r``, in rank order.
    Differentiable."""
    return _AllToAll.apply(rows, send, receive, group)


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


def _exchange_counts(routing: Routing, world_size: int, group=None) -> torch.Tensor:
    """(world_size, experts per rank): rows each rank of ``group`` (default: all ranks, of
    which there are ``world_size``) will send me for each of my experts."""
    kept_per_expert = torch.bincount(
        routing.experts[routing.kept], minlength=routing.probabilities.shape[1]
    )
    received = torch.empty_like(kept_per_expert)
    dist.all_to_all_single(received, kept_per_expert, group=group)  # E/N counts to each rank
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


# --- expert parallelism folded into data parallelism: which group reduces which gradient ----

FOLDING_WEIGHTS = ("w_dense", "router", "w_up", "w_down")
"""The weights of :func:`folding_worker`'s model: a dense matrix (attention's stand-in) and
the router, replicated; the experts' two matrices, split over the expert-parallel ranks."""


def folding_state(hidden: int, ffn: int, n_experts: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights for :func:`folding_worker`: :class:`MoELayer`'s (``router``, ``w_up``,
    ``w_down``, from ``seed``) and a dense ``w_dense`` (hidden, hidden), float64."""
    layer = MoELayer(hidden, ffn, n_experts, 1, None, seed=seed)
    g = torch.Generator().manual_seed(_checks.count("seed", seed) + 3)
    dense = torch.randn(hidden, hidden, generator=g, dtype=torch.float64) / hidden**0.5
    return {"w_dense": dense, **{name: p.detach() for name, p in layer.named_parameters()}}


def _local_experts(
    rows: torch.Tensor, counts: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor
) -> torch.Tensor:
    """My experts on the rows received (grouped by source rank, then by expert): permute
    them into one group per expert, run the groups (:func:`expert_mlps`), put them back."""
    local = torch.arange(counts.shape[1]).repeat(counts.shape[0])
    which = torch.repeat_interleave(local, counts.reshape(-1))
    order = torch.argsort(which, stable=True)
    sizes = torch.bincount(which, minlength=counts.shape[1]).tolist()
    computed = expert_mlps(rows[order], w_up, w_down, sizes)
    return torch.zeros_like(computed).index_copy(0, order, computed)


def folding_worker(
    rank: int,
    world_size: int,
    state: dict[str, torch.Tensor],
    tokens: int,
    top_k: int,
    ep: int,
    seed: int = 0,
    skew: float = 0.0,
    learning_rate: float = 0.5,
) -> dict:
    """One training step (SGD) of a dense layer and a dropless MoE layer, with the dense
    weights data-parallel over every rank and the experts expert-parallel over ``ep`` ranks
    and expert-data-parallel over the other ``world_size / ep``.

    Two :class:`~torch.distributed.device_mesh.DeviceMesh` es over the same ranks, as
    Megatron-Core's folding builds two grids: ``("dp",)`` of ``world_size`` for the dense
    weights, ``("edp", "ep")`` of ``(world_size / ep, ep)`` for the experts (so the ``ep``
    ranks of an expert-parallel group are consecutive, as in Megatron-Core's order
    ``tp-cp-ep-dp-pp``). Rank ``r`` takes the ``r``-th slice of ``tokens`` tokens
    (:func:`trainscale.experts.sample_tokens` with ``seed`` and ``skew``) and holds experts
    ``ep_rank * E/ep`` to ``(ep_rank + 1) * E/ep - 1``. Forward: ``h = x w_dense``, the MoE
    layer on ``h`` (routed with ``router``, nothing dropped, dispatched and combined with
    all-to-alls inside the expert-parallel group), the loss ``sum(out * G) / tokens`` (a
    mean over the whole batch, ``G`` from :func:`loss_weights`). After backward, the dense
    weights' gradients are summed over ``dp`` and the experts' over ``edp``; then every
    weight takes one SGD step of ``learning_rate``.

    Returns this rank's gradients (reduced, and its own before the reduction) and updated
    weights (its experts only), its place in both meshes, and the rank lists of each group.
    """
    missing = [name for name in FOLDING_WEIGHTS if name not in state]
    if missing:
        raise ValueError(f"state must hold {FOLDING_WEIGHTS}, missing {missing}")
    n_experts, hidden = state["router"].shape
    experts_per_rank = _checks.count("ep", ep, minimum=1)
    if world_size % experts_per_rank or n_experts % experts_per_rank:
        raise ValueError(
            f"ep must divide world_size = {world_size} and the experts = {n_experts}, got {ep}"
        )
    n_tokens = _checks.count("tokens", tokens, minimum=1)
    if n_tokens % world_size:
        raise ValueError(f"tokens must be divisible by world_size = {world_size}, got {tokens}")
    lr = _checks.positive("learning_rate", learning_rate)
    dev = device()
    dense_mesh = init_device_mesh(dev.type, (world_size,), mesh_dim_names=("dp",))
    moe_mesh = init_device_mesh(dev.type, (world_size // ep, ep), mesh_dim_names=("edp", "ep"))
    ep_group = moe_mesh.get_group("ep")
    ep_rank, per_rank = moe_mesh.get_local_rank("ep"), n_experts // ep
    mine = slice(ep_rank * per_rank, (ep_rank + 1) * per_rank)
    weights = {
        name: (value[mine] if name in ("w_up", "w_down") else value)
        .clone()
        .to(dev)
        .requires_grad_(True)
        for name, value in state.items()
        if name in FOLDING_WEIGHTS
    }
    x = sample_tokens(n_tokens, hidden, seed, skew).chunk(world_size)[rank].to(dev)
    g = loss_weights(n_tokens, hidden, seed).chunk(world_size)[rank].to(dev)

    h = x @ weights["w_dense"]
    routing = route(h @ weights["router"].T, top_k, None)
    order = _dispatch_order(routing)
    token, slot = order[:, 0], order[:, 1]
    send = torch.bincount(routing.experts[token, slot] // per_rank, minlength=ep).tolist()
    counts = _exchange_counts(routing, ep, ep_group)
    receive = counts.sum(dim=1).tolist()
    arrived = all_to_all(h[token], send, receive, ep_group)  # dispatch, inside the EP group
    computed = _local_experts(arrived, counts, weights["w_up"], weights["w_down"])
    returned = all_to_all(computed, receive, send, ep_group)  # combine
    out = torch.zeros_like(h).index_add(0, token, returned * routing.gates[token, slot, None])
    ((out * g).sum() / n_tokens).backward()

    reduced_over = {"w_dense": "dp", "router": "dp", "w_up": "edp", "w_down": "edp"}
    meshes = {"dp": dense_mesh, "edp": moe_mesh}
    gradients, local = {}, {}
    for name, param in weights.items():
        dim = reduced_over[name]
        local[name] = param.grad.detach().cpu().clone()
        dist.all_reduce(param.grad, group=meshes[dim].get_group(dim))  # sum: loss is a mean
        gradients[name] = param.grad.detach().cpu().clone()
        with torch.no_grad():
            param -= lr * param.grad  # SGD, written out
    grid = moe_mesh.mesh
    return {
        "gradients": gradients,
        "local gradients": local,
        "weights": {name: p.detach().cpu().clone() for name, p in weights.items()},
        "reduced over": reduced_over,
        "ep rank": ep_rank,
        "edp rank": moe_mesh.get_local_rank("edp"),
        "experts": (mine.start, mine.stop - 1),
        "groups": {
            "dp": dense_mesh.mesh.tolist(),
            "ep": grid.tolist(),
            "edp": grid.T.tolist(),
        },
    }


def folding_reference(
    state: dict[str, torch.Tensor],
    tokens: int,
    top_k: int,
    seed: int = 0,
    skew: float = 0.0,
    learning_rate: float = 0.5,
) -> dict[str, dict[str, torch.Tensor]]:
    """:func:`folding_worker`'s step computed in one process, in float64, from the
    independent per-token layer (:func:`trainscale.experts.per_token_reference`, no
    capacity) and autograd: the gradients of ``sum(out * G) / tokens`` over all
    ``tokens`` tokens, and every weight after one SGD step of ``learning_rate``."""
    hidden = state["router"].shape[1]
    leaves = {name: state[name].detach().clone().requires_grad_(True) for name in FOLDING_WEIGHTS}
    x = sample_tokens(tokens, hidden, seed, skew)
    h = x @ leaves["w_dense"]
    out = per_token_reference(h, leaves["router"], leaves["w_up"], leaves["w_down"], top_k).output
    loss = (out * loss_weights(tokens, hidden, seed)).sum() / tokens
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))
    return {
        "gradients": grads,
        "weights": {name: (leaves[name] - learning_rate * grads[name]).detach() for name in leaves},
    }


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
