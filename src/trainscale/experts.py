"""Mixture of experts and expert parallelism: routing, capacity, balance, traffic (chapter 15).

A mixture-of-experts (MoE) layer replaces one MLP with ``E`` of them, the
*experts*, and a *router*: a linear map from each token to ``E`` scores, a
softmax, and the ``k`` best experts per token (top-k). The token's output is the
sum of those ``k`` experts' outputs, each weighted by its *gate*. Two conventions
exist for the gates, and this module has both:

* not renormalised: the gate is the softmax probability itself (the Switch
  Transformer, ``k = 1``, whose one gate would otherwise always be 1);
* renormalised over the ``k`` chosen experts, so the gates sum to 1 (GShard's
  top-2, Mixtral's softmax over the top-2 logits, which is the same thing, and
  DeepSeek-V3, which normalises its sigmoid affinities among the chosen 8).

Each expert takes at most ``capacity`` tokens from each group of tokens (a
group is what one device routes: GShard's "groups", a rank's micro-batch under
expert parallelism), ``ceil(capacity_factor * tokens * k / E)``. Assignments are
served in order of preference (every token's first choice before any second
choice), then in token order; the rest are *dropped*: that expert adds nothing
to the token, whose value still reaches the next layer through the residual
connection. The Switch Transformer's auxiliary loss, ``E * sum_i f_i * P_i``,
pushes the router towards an even load.

Expert parallelism (EP) puts the experts on different ranks; each token travels
to its experts' ranks and back, two all-to-alls per layer in forward and two in
backward. The bytes and their ratio to the experts' compute are here too, on one kind
of link or on nodes whose GPUs share NVLink, and the network copies of a dispatch that
sends each token once per node (DeepSeek-V3's). :func:`per_token_reference` writes the
layer a second time, token by token and sharing no code with it, to check the
expert-parallel run against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import nn

from trainscale import _checks

# The all-to-all's bytes live with the other collectives, which the planner imports without
# torch; chapter 15 reads them here.
from trainscale.collectives import ALL_TO_ALLS_PER_LAYER
from trainscale.collectives import all_to_all_bytes_per_rank as all_to_all_bytes_per_rank

# --- capacity and drops ---------------------------------------------------------------------


def expert_capacity(tokens: int, experts: int, top_k: int = 1, capacity_factor: float = 1.0) -> int:
    """Tokens one expert takes from a group of ``tokens``: ``ceil(cf * tokens * k / E)``.

    The Switch Transformer's rule, ``(tokens per batch / experts) * capacity
    factor``, with the ``k`` assignments of every token counted (for ``k = 1``
    the two agree). A factor of 1 fits exactly an even load.
    """
    n = _checks.count("tokens", tokens, minimum=1)
    e = _checks.count("experts", experts, minimum=1)
    k = _checks.count("top_k", top_k, minimum=1)
    if k > e:
        raise ValueError(f"top_k must be <= experts = {e}, got {top_k}")
    factor = _checks.positive("capacity_factor", capacity_factor)
    # Round the product first: 1.25 * 64 * 2 / 8 is 20 exactly, not 20.000000000000004.
    return math.ceil(round(factor * n * k / e, 9))


def dropped_assignments(loads: list[int] | torch.Tensor, capacity: int) -> int:
    """Assignments beyond ``capacity`` when the experts receive ``loads`` (one group)."""
    cap = _checks.count("capacity", capacity)
    counts = [int(load) for load in loads]
    if any(load < 0 for load in counts):
        raise ValueError(f"loads must be counts >= 0, got {counts}")
    return sum(max(0, load - cap) for load in counts)


# --- routing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Routing:
    """Where the tokens of one forward pass go.

    ``probabilities``: (tokens, E), the router's softmax; ``experts``: (tokens, k)
    the chosen experts, best first; ``gates``: (tokens, k) their weights
    (differentiable); ``kept``: (tokens, k) whether the expert had room for the
    token; ``loads``: (E,) assignments each expert was offered, dropped ones included.
    """

    probabilities: torch.Tensor
    experts: torch.Tensor
    gates: torch.Tensor
    kept: torch.Tensor
    loads: torch.Tensor

    @property
    def dropped(self) -> int:
        """Assignments dropped for want of capacity."""
        return int((~self.kept).sum())


def _positions(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Each assignment's place in its expert's queue: first choices of every token
    first, in token order, then second choices, and so on (as GShard orders them)."""
    by_preference = experts.T.reshape(-1)  # (k * tokens,), choice-major
    one_hot = nn.functional.one_hot(by_preference, n_experts)
    place = (one_hot.cumsum(0) - 1).gather(1, by_preference[:, None])[:, 0]
    return place.reshape(experts.shape[1], experts.shape[0]).T


def route(
    logits: torch.Tensor,
    top_k: int,
    capacity_factor: float | None = 1.0,
    *,
    renormalise: bool = True,
    groups: int = 1,
) -> Routing:
    """Route tokens from the router's ``logits`` (tokens, E): top-k, gates, capacity.

    ``capacity_factor=None`` drops nothing. The tokens are cut into ``groups``
    consecutive groups (``torch.tensor_split``), each with its own capacity, as
    each rank applies it to its own tokens under expert parallelism.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be (tokens, experts), got shape {tuple(logits.shape)}")
    n_tokens, n_experts = logits.shape
    k = _checks.count("top_k", top_k, minimum=1)
    if k > n_experts:
        raise ValueError(f"top_k must be <= experts = {n_experts}, got {top_k}")
    n_groups = _checks.count("groups", groups, minimum=1)
    if n_groups > max(n_tokens, 1):
        raise ValueError(f"groups must be <= tokens = {n_tokens}, got {groups}")
    _checks.boolean("renormalise", renormalise)
    probabilities = logits.softmax(dim=-1)
    top, experts = probabilities.topk(k, dim=-1)
    gates = top / top.sum(dim=-1, keepdim=True) if renormalise else top
    kept = torch.ones_like(experts, dtype=torch.bool)
    for rows in torch.tensor_split(torch.arange(n_tokens), n_groups):
        if capacity_factor is None or len(rows) == 0:
            continue
        capacity = expert_capacity(len(rows), n_experts, k, capacity_factor)
        kept[rows] = _positions(experts[rows], n_experts) < capacity
    loads = torch.bincount(experts.reshape(-1), minlength=n_experts)
    return Routing(probabilities, experts, gates, kept, loads)


def load_balancing_loss(probabilities: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The Switch Transformer's auxiliary loss, ``E * sum_i f_i * P_i`` (unitless).

    ``f_i``: the share of the ``tokens * k`` assignments that chose expert ``i``
    (counted, so no gradient flows through it); ``P_i``: the mean probability the
    router gives expert ``i`` (differentiable). An even router gives 1, whatever
    ``E`` and ``k``. Its largest value is ``E / k``: a token's ``k`` experts are
    distinct, so no ``f_i`` exceeds ``1 / k``, and the sum of the ``P_i`` is 1; it is
    reached when every token picks the same ``k`` experts and they hold all the
    probability (``E`` for the Switch Transformer's ``k = 1``). Training multiplies it
    by a small weight (0.01 in the Switch Transformer).
    """
    if probabilities.dim() != 2 or experts.dim() != 2:
        raise ValueError("probabilities must be (tokens, E) and experts (tokens, k)")
    n_experts = probabilities.shape[1]
    counts = torch.bincount(experts.reshape(-1), minlength=n_experts)
    share = counts.to(probabilities.dtype) / experts.numel()
    return n_experts * (share * probabilities.mean(dim=0)).sum()


# --- the layer ------------------------------------------------------------------------------


class MoELayer(nn.Module):
    """A mixture-of-experts MLP: a router and ``experts`` GELU MLPs (hidden -> ffn -> hidden).

    Weights are drawn in float64 from ``seed`` (the global random state is left
    alone) and kept in ``dtype``, so the same layer comes out on every CPU.
    ``forward(x)`` takes (tokens, hidden) and returns (tokens, hidden); the routing
    of the last call is kept in ``last_routing``.
    """

    def __init__(
        self,
        hidden: int,
        ffn: int,
        experts: int,
        top_k: int = 2,
        capacity_factor: float | None = 1.0,
        *,
        renormalise: bool = True,
        groups: int = 1,
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        super().__init__()
        self.hidden = _checks.count("hidden", hidden, minimum=1)
        self.ffn = _checks.count("ffn", ffn, minimum=1)
        self.n_experts = _checks.count("experts", experts, minimum=1)
        self.top_k = _checks.count("top_k", top_k, minimum=1)
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k must be <= experts = {self.n_experts}, got {top_k}")
        if capacity_factor is not None:
            _checks.positive("capacity_factor", capacity_factor)
        self.capacity_factor = capacity_factor
        self.renormalise = _checks.boolean("renormalise", renormalise)
        self.groups = _checks.count("groups", groups, minimum=1)
        g = torch.Generator().manual_seed(_checks.count("seed", seed))

        def draw(*shape: int, fan_in: int) -> nn.Parameter:
            values = torch.randn(*shape, generator=g, dtype=torch.float64) / fan_in**0.5
            return nn.Parameter(values.to(dtype))

        self.router = draw(self.n_experts, self.hidden, fan_in=self.hidden)
        self.w_up = draw(self.n_experts, self.hidden, self.ffn, fan_in=self.hidden)
        self.w_down = draw(self.n_experts, self.ffn, self.hidden, fan_in=self.ffn)
        self.last_routing: Routing | None = None

    def route(self, x: torch.Tensor) -> Routing:
        """Where the tokens ``x`` (tokens, hidden) go under this layer's settings."""
        return route(
            x @ self.router.T,
            self.top_k,
            self.capacity_factor,
            renormalise=self.renormalise,
            groups=self.groups,
        )

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``index`` applied to the rows ``x``: ``GELU(x W_up) W_down``."""
        return nn.functional.gelu(x @ self.w_up[index]) @ self.w_down[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be (tokens, {self.hidden}), got shape {tuple(x.shape)}")
        routing = self.route(x)
        self.last_routing = routing
        out = torch.zeros_like(x)
        for e in range(self.n_experts):
            token, slot = torch.nonzero((routing.experts == e) & routing.kept, as_tuple=True)
            if len(token):
                weighted = self.expert(e, x[token]) * routing.gates[token, slot, None]
                out = out.index_add(0, token, weighted)
        return out

    def parameter_counts(self) -> dict[str, int]:
        """Weights in the layer, and those one token uses (router plus its k experts)."""
        per_expert = 2 * self.hidden * self.ffn
        router = self.n_experts * self.hidden
        return {
            "total": router + self.n_experts * per_expert,
            "per token": router + self.top_k * per_expert,
        }


# --- an independent reference ---------------------------------------------------------------


@dataclass(frozen=True)
class ReferenceRun:
    """What :func:`per_token_reference` computed: ``output`` (tokens, hidden), differentiable
    in every input; ``kept``: the (token, expert) assignments served, every first choice
    before any second one, then in token order; ``dropped``: how many were not."""

    output: torch.Tensor
    kept: list[tuple[int, int]]
    dropped: int


def per_token_reference(
    x: torch.Tensor,
    router: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    capacity_factor: float | None = None,
    *,
    groups: int = 1,
    renormalise: bool = True,
) -> ReferenceRun:
    """The MoE layer written a second time, token by token, to check the first against.

    Shares no code with :func:`route` or :class:`MoELayer`: for each token, its own
    softmax of ``router @ x``, the ``top_k`` experts by sorting the probabilities in
    Python, the gates (renormalised over the chosen ones unless ``renormalise`` is
    false); then, in each of ``groups`` consecutive groups of tokens (the first
    ``tokens % groups`` groups one token larger), places handed out choice by choice
    and token by token up to ``ceil(capacity_factor * group * k / E)`` per expert
    (computed in fractions); then each kept expert as ``GELU(x W_up) W_down``, with
    GELU written out with ``erf``. Slow (a Python loop), and meant to be.
    """
    n_tokens, n_experts = x.shape[0], router.shape[0]
    k = _checks.count("top_k", top_k, minimum=1)
    n_groups = _checks.count("groups", groups, minimum=1)
    chosen, gates = [], []
    for t in range(n_tokens):
        logits = router @ x[t]
        exp = torch.exp(logits - logits.max())
        p = exp / exp.sum()
        values = p.tolist()
        best = sorted(range(n_experts), key=lambda e: -values[e])[:k]
        top = torch.stack([p[e] for e in best])
        gates.append(top / top.sum() if renormalise else top)
        chosen.append(best)
    keep = [[True] * k for _ in range(n_tokens)]
    if capacity_factor is not None:
        size, extra = divmod(n_tokens, n_groups)
        start = 0
        for g in range(n_groups):
            members = range(start, start + size + (1 if g < extra else 0))
            start = members.stop
            places = math.ceil(Fraction(str(capacity_factor)) * len(members) * k / n_experts)
            taken = [0] * n_experts
            for slot in range(k):
                for t in members:
                    e = chosen[t][slot]
                    keep[t][slot] = taken[e] < places
                    taken[e] += 1
    served = sorted(
        ((slot, t) for t in range(n_tokens) for slot in range(k) if keep[t][slot]),
    )
    rows = []
    for t in range(n_tokens):
        total = torch.zeros_like(x[t])
        for slot in range(k):
            if keep[t][slot]:
                e = chosen[t][slot]
                z = x[t] @ w_up[e]
                total = total + gates[t][slot] * (
                    (0.5 * z * (1 + torch.erf(z / 2**0.5))) @ w_down[e]
                )
        rows.append(total)
    return ReferenceRun(
        output=torch.stack(rows),
        kept=[(t, chosen[t][slot]) for slot, t in served],
        dropped=sum(not kept for row in keep for kept in row),
    )


# --- expert parallelism: traffic ------------------------------------------------------------


def link_comm_to_compute(
    copies: float,
    top_k: int,
    ffn: int,
    peak_flops: float,
    mfu: float,
    bandwidth: float,
    bytes_per_element: float = 2,
    matrices_per_expert: int = 3,
) -> float:
    """Time of the four all-to-alls on one kind of link over the experts' compute (a ratio).

    Each token sends ``copies`` copies of its ``hidden`` values over a link of
    ``bandwidth`` bytes/s, in each of the four all-to-alls (dispatch and combine,
    forward and backward), and its ``top_k`` experts do ``3 * 2 * matrices * hidden
    * ffn`` FLOPs each (forward and backward) at ``peak_flops * mfu``. The hidden
    size cancels:

        ratio = (copies / k) * 2 * bytes * peak * mfu / (3 * matrices * ffn * bandwidth).

    ``bytes_per_element`` is the mean over the four all-to-alls (DeepSeek-V3 sends
    two of them in FP8 and two in BF16: 1.5). ``matrices_per_expert`` is 3 for a
    SwiGLU expert (DeepSeek-V3, Mixtral), 2 for a plain MLP. Attention's compute and
    the router are left out.
    """
    c = _checks.non_negative("copies", copies)
    k = _checks.count("top_k", top_k, minimum=1)
    f = _checks.count("ffn", ffn, minimum=1)
    peak = _checks.positive("peak_flops", peak_flops)
    share = _checks.positive("mfu", mfu, maximum=1)
    link = _checks.positive("bandwidth", bandwidth)
    size = _checks.positive("bytes_per_element", bytes_per_element)
    m = _checks.count("matrices_per_expert", matrices_per_expert, minimum=1)
    comm_per_hidden = ALL_TO_ALLS_PER_LAYER * c * size / link
    compute_per_hidden = 3 * 2 * m * f * k / (peak * share)
    return comm_per_hidden / compute_per_hidden


def ep_comm_to_compute(
    ffn: int,
    ep: int,
    peak_flops: float,
    mfu: float,
    bandwidth: float,
    bytes_per_element: float = 2,
    matrices_per_expert: int = 3,
    *,
    gpus_per_node: int | None = None,
    nvlink_bandwidth: float | None = None,
) -> float:
    """Time of a MoE layer's four all-to-alls over its experts' compute time (a ratio),
    under even routing, each copy of a token sent to its expert's rank by itself.

    With ``gpus_per_node=None`` all ``ep`` ranks share one kind of link of
    ``bandwidth`` bytes/s, and the share ``(ep - 1) / ep`` of the copies that leaves
    the rank crosses it (:func:`link_comm_to_compute`; the hidden size and ``k``
    cancel):

        ratio = 2 * bytes * (ep - 1) / ep * peak * mfu / (3 * matrices * ffn * bandwidth).

    With ``gpus_per_node=g`` the ranks fill nodes of ``g`` GPUs: the share
    ``(ep - g) / ep`` of the copies goes to other nodes at ``bandwidth`` (the
    network), the share ``(g - 1) / ep`` to the other GPUs of the same node at
    ``nvlink_bandwidth``. The two kinds of link carry their copies at the same time,
    so the all-to-alls last as long as the slower of the two: the larger ratio.
    """
    ranks = _checks.count("ep", ep, minimum=1)
    if gpus_per_node is None:
        if nvlink_bandwidth is not None:
            raise ValueError("nvlink_bandwidth needs gpus_per_node, got gpus_per_node=None")
        return link_comm_to_compute(
            (ranks - 1) / ranks,
            1,
            ffn,
            peak_flops,
            mfu,
            bandwidth,
            bytes_per_element,
            matrices_per_expert,
        )
    g = _checks.count("gpus_per_node", gpus_per_node, minimum=1)
    if ranks % g:
        raise ValueError(f"ep must be a multiple of gpus_per_node = {g}, got {ep}")
    if nvlink_bandwidth is None:
        raise ValueError("nvlink_bandwidth must be given with gpus_per_node")
    args = (1, ffn, peak_flops, mfu)
    network = link_comm_to_compute(
        (ranks - g) / ranks, *args, bandwidth, bytes_per_element, matrices_per_expert
    )
    nvlink = link_comm_to_compute(
        (g - 1) / ranks, *args, nvlink_bandwidth, bytes_per_element, matrices_per_expert
    )
    return max(network, nvlink)


def remote_nodes(experts: int, top_k: int, nodes: int) -> float:
    """Expected number of nodes other than the sender's that hold at least one of a
    token's ``top_k`` experts, the ``k`` distinct experts drawn uniformly at random
    from ``experts`` spread evenly over ``nodes`` nodes.

    A dispatch that sends each token once per node it needs (and forwards it inside
    that node over NVLink, as DeepSeek-V3's does) crosses the network this many times
    per token. A node of ``E / nodes`` experts holds none of the ``k`` with
    probability ``C(E - E/nodes, k) / C(E, k)``, so the answer is exactly

        (nodes - 1) * (1 - C(E - E/nodes, k) / C(E, k)).
    """
    e = _checks.count("experts", experts, minimum=1)
    k = _checks.count("top_k", top_k, minimum=1)
    n = _checks.count("nodes", nodes, minimum=1)
    if k > e:
        raise ValueError(f"top_k must be <= experts = {e}, got {top_k}")
    if e % n:
        raise ValueError(f"experts must be divisible by nodes = {n}, got {experts}")
    none_there = Fraction(math.comb(e - e // n, k), math.comb(e, k))
    return float((n - 1) * (1 - none_there))


# --- inputs and the balancing loss at work ----------------------------------------------------


def sample_tokens(tokens: int, hidden: int, seed: int = 0, skew: float = 0.0) -> torch.Tensor:
    """``tokens`` activations of width ``hidden``, float64, drawn from ``seed``.

    ``skew`` adds the same random direction (of length ``skew``) to every token, as
    real activations share a mean: a router then favours some experts for all of
    them, and the load is uneven.
    """
    n = _checks.count("tokens", tokens, minimum=1)
    h = _checks.count("hidden", hidden, minimum=1)
    shift = _checks.non_negative("skew", skew)
    g = torch.Generator().manual_seed(_checks.count("seed", seed) + 1)
    direction = torch.randn(h, generator=g, dtype=torch.float64)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    return x + shift * direction / direction.norm()


def balance_router(
    layer: MoELayer, x: torch.Tensor, steps: int, learning_rate: float = 0.5
) -> list[float]:
    """Train ``layer``'s router alone on the load-balancing loss with plain SGD, in place.

    Returns the loss before each step and after the last (``steps + 1`` values).
    The experts are not touched: only where the tokens go changes.
    """
    n_steps = _checks.count("steps", steps)
    lr = _checks.positive("learning_rate", learning_rate)
    losses = []
    for _ in range(n_steps + 1):
        routing = layer.route(x)
        loss = load_balancing_loss(routing.probabilities, routing.experts)
        losses.append(loss.item())
        if len(losses) > n_steps:
            break
        (gradient,) = torch.autograd.grad(loss, [layer.router])
        with torch.no_grad():
            layer.router -= lr * gradient  # SGD, written out (torch.optim loads much more)
    return losses
