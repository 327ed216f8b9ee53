"""Routing a mixture of experts: top-k, gates, capacity, drops and the balancing loss (chapter 11).

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from trainscale import _checks

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


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss, ``(1/T) sum_t (log sum_i exp(x_ti))^2`` (Zoph et al. 2022,
    arXiv 2202.08906, eq. 5), of the router's ``logits`` (tokens, E); unitless.

    The softmax cannot see a constant added to a token's logits; this loss can: it
    penalises the *size* of the logits (their log-sum-exp), so training keeps them small,
    where rounding to a low-precision format moves a probability least. Its gradient with
    respect to token ``t``'s logits is ``2 * lse_t * softmax(x_t) / T``: when ``lse_t > 0``
    every logit is pushed down in proportion to its probability. ST-MoE adds it with
    weight ``c_z = 0.001``. It is 0 when ``lse_t = 0`` for every token (e.g. ``E`` equal
    logits of ``-log E``); for ``E`` equal logits ``c`` it is ``(c + log E)^2``.
    """
    if logits.dim() != 2 or logits.shape[0] == 0 or logits.shape[1] == 0:
        raise ValueError(f"logits must be (tokens, experts), got shape {tuple(logits.shape)}")
    return (torch.logsumexp(logits, dim=-1) ** 2).mean()


def rounding_drift(logits: torch.Tensor, top_k: int, dtype: torch.dtype) -> tuple[int, float]:
    """What rounding the router's ``logits`` (tokens, E) to ``dtype`` before the softmax
    does to the routing: how many tokens can no longer tell their ``top_k``-th expert from
    the next (the two rounded logits are equal, where the exact ones differ), and the
    largest change of a gate of the experts the exact logits chose (renormalised over the
    ``top_k``, computed in float64 from the rounded logits).

    Rounding keeps the order of the logits or makes two of them equal; it never swaps
    them, so a token's choice can only become a tie, which ``topk`` then breaks by
    position. Large logits round coarsely: a constant added to every logit of a token
    changes nothing in exact arithmetic, but can, once the logits are rounded.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    exact = route(logits.double(), top_k, None)
    rounded = logits.to(dtype).double()
    tied = torch.zeros(len(logits), dtype=torch.bool)
    if top_k < logits.shape[1]:
        ranked = rounded.sort(dim=1, descending=True).values
        distinct = logits.double().sort(dim=1, descending=True).values
        tied = (ranked[:, top_k - 1] == ranked[:, top_k]) & (
            distinct[:, top_k - 1] != distinct[:, top_k]
        )
    gates = rounded.softmax(dim=-1).gather(1, exact.experts)
    gates = gates / gates.sum(dim=-1, keepdim=True)
    return int(tied.sum()), float((gates - exact.gates).abs().max())
