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
backward. The bytes and their ratio to the experts' compute are here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from trainscale import _checks

ALL_TO_ALLS_PER_LAYER = 4
"""All-to-alls per MoE layer and micro-batch: dispatch and combine in forward, and
the same two, reversed, for their gradients in backward."""


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
    ``E`` and ``k``; all tokens on one expert, with all the probability, gives ``E``.
    Training multiplies it by a small weight (0.01 in the Switch Transformer).
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


# --- expert parallelism: traffic ------------------------------------------------------------


def all_to_all_bytes_per_rank(
    tokens: float, hidden: int, top_k: int, ep: int, bytes_per_element: float = 2
) -> float:
    """Bytes one rank sends in one all-to-all (dispatch or combine) under even routing.

    Each of the rank's ``tokens`` goes to ``top_k`` experts spread evenly over
    ``ep`` expert-parallel ranks, so a share ``(ep - 1) / ep`` of the
    ``tokens * top_k`` copies of ``hidden`` values leaves the rank:
    ``tokens * hidden * top_k * (ep - 1) / ep * bytes_per_element``. It receives as
    much; the combine sends the same amount back.
    """
    n = _checks.non_negative("tokens", tokens)
    h = _checks.count("hidden", hidden, minimum=1)
    k = _checks.count("top_k", top_k, minimum=1)
    ranks = _checks.count("ep", ep, minimum=1)
    size = _checks.positive("bytes_per_element", bytes_per_element)
    return n * h * k * (ranks - 1) / ranks * size


def ep_comm_to_compute(
    ffn: int,
    ep: int,
    peak_flops: float,
    mfu: float,
    bandwidth: float,
    bytes_per_element: float = 2,
    matrices_per_expert: int = 3,
) -> float:
    """Time of a MoE layer's four all-to-alls over its experts' compute time (a ratio).

    Per token and per chosen expert, forward and backward: the all-to-alls move
    ``4 * hidden * (ep - 1) / ep * bytes`` at ``bandwidth`` bytes/s; the expert does
    ``3 * 2 * matrices * hidden * ffn`` FLOPs at ``peak_flops * mfu``. The hidden
    size and ``k`` cancel:

        ratio = 2 * bytes * (ep - 1) / ep * peak * mfu / (3 * matrices * ffn * bandwidth).

    ``matrices_per_expert`` is 3 for a SwiGLU expert (DeepSeek-V3, Mixtral), 2 for
    a plain MLP. Attention's compute and the router are left out.
    """
    f = _checks.count("ffn", ffn, minimum=1)
    ranks = _checks.count("ep", ep, minimum=1)
    peak = _checks.positive("peak_flops", peak_flops)
    share = _checks.positive("mfu", mfu, maximum=1)
    link = _checks.positive("bandwidth", bandwidth)
    size = _checks.positive("bytes_per_element", bytes_per_element)
    m = _checks.count("matrices_per_expert", matrices_per_expert, minimum=1)
    comm_per_hidden = ALL_TO_ALLS_PER_LAYER * (ranks - 1) / ranks * size / link
    compute_per_hidden = 3 * 2 * m * f / (peak * share)
    return comm_per_hidden / compute_per_hidden


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
