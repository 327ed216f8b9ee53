"""Expert parallelism's traffic: all-to-all bytes, their time against the experts' compute,
and the network copies of a dispatch that sends each token once per node (chapter 11).

Expert parallelism (EP) puts the experts on different ranks; each token travels
to its experts' ranks and back, two all-to-alls per layer in forward and two in
backward. The bytes and their ratio to the experts' compute are here, on one kind
of link or on nodes whose GPUs share NVLink, and the network copies of a dispatch that
sends each token once per node (DeepSeek-V3's).
"""

from __future__ import annotations

import math
from fractions import Fraction

from trainscale import _checks

ALL_TO_ALLS_PER_LAYER = 4
"""All-to-alls per MoE layer and micro-batch: dispatch and combine in forward, and
the same two, reversed, for their gradients in backward."""


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
