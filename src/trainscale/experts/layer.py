"""The mixture-of-experts layer, an independent reference to check it against, its inputs, and
the balancing loss at work (chapter 11).

:class:`MoELayer` is a router and ``E`` GELU MLPs, routed by
:func:`trainscale.experts.routing.route`. :func:`per_token_reference` writes the layer a
second time, token by token and sharing no code with it, to check the expert-parallel run
(and any other way of computing the layer) against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import nn

from trainscale import _checks
from trainscale.experts.routing import Routing, load_balancing_loss, route

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
