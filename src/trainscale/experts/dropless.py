"""Dropless mixture of experts: permute, one grouped GEMM, unpermute (chapter 11).

A capacity-factor layer gives every expert a buffer of the same size and drops what
does not fit. A *dropless* layer (MegaBlocks, Gale et al. 2022, arXiv 2211.15841)
drops nothing: it sorts the ``T k`` assignments of its tokens by expert (the
*permute*), so that each expert's rows lie next to each other, runs every expert on
its own group of rows in one *grouped* GEMM whose groups have different sizes, and
brings each result back to its token, weighted by its gate (the *unpermute*).

Two costs replace the dropped tokens:

* **padding**: a kernel that works in tiles of ``tile`` rows (MegaBlocks' block-sparse
  kernels use 128 x 128 blocks, ``megablocks/layers/dmoe.py``) pads each expert's group
  to a multiple of ``tile`` rows (:func:`padded_rows`, :func:`padding_flops`);
* **the permutation's memory traffic**: every copy of a token is read and written
  once on the way to its expert and once on the way back, with no arithmetic to hide
  it (:func:`permute_bytes`, :func:`permute_to_compute`).

:func:`dropless_forward` is such a layer in torch, with the weights of
:class:`trainscale.experts.MoELayer`; it uses ``torch.nn.functional.grouped_mm`` where
torch can run it (float32, bfloat16, float16) and a loop over the experts of the
permuted buffer otherwise (float64).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from trainscale import _checks
from trainscale.experts.routing import route

GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""Dtypes ``torch.nn.functional.grouped_mm`` accepts in torch 2.13 (checked in
``tests/test_experts_dropless.py``): not float64."""


def _counts(counts: Sequence[int] | torch.Tensor) -> list[int]:
    values = [int(c) for c in counts]
    if not values or any(c < 0 for c in values):
        raise ValueError(f"counts must be one count >= 0 per expert, got {values}")
    return values


def padded_rows(counts: Sequence[int] | torch.Tensor, tile: int) -> int:
    """Rows a tiled grouped GEMM computes when the experts receive ``counts`` rows:
    each group rounded up to a multiple of ``tile``, ``sum_i ceil(c_i / tile) * tile``.

    An expert that receives nothing costs nothing; one that receives a single row
    costs a whole tile.
    """
    t = _checks.count("tile", tile, minimum=1)
    return sum(math.ceil(c / t) * t for c in _counts(counts))


def padding_flops(
    counts: Sequence[int] | torch.Tensor,
    tile: int,
    hidden: int,
    ffn: int,
    matrices_per_expert: int = 3,
) -> float:
    """FLOPs spent on padding rows, forward and backward: ``(padded - real rows) * 3 * 2
    * matrices * hidden * ffn`` (each row of an expert with ``matrices`` weight
    matrices of ``hidden x ffn`` costs ``2 * matrices * hidden * ffn`` FLOPs forward and
    twice that backward). 3 matrices: a SwiGLU expert; 2: a plain MLP."""
    h = _checks.count("hidden", hidden, minimum=1)
    f = _checks.count("ffn", ffn, minimum=1)
    m = _checks.count("matrices_per_expert", matrices_per_expert, minimum=1)
    waste = padded_rows(counts, tile) - sum(_counts(counts))
    return float(waste * 3 * 2 * m * h * f)


def permute_bytes(tokens: float, hidden: int, top_k: int, bytes_per_element: float = 2) -> float:
    """Bytes the permute and the unpermute move through memory in one forward pass.

    The permute reads each of the ``tokens * k`` copies of a token's ``hidden`` values
    and writes it to its expert's group (``2 T k d b``); the unpermute reads the ``T k``
    results and writes the ``T`` summed outputs (``(T k + T) d b``):

        bytes = (3 k + 1) * T * d * b.

    The gates (one value per copy) and the index arrays are left out.
    """
    n = _checks.non_negative("tokens", tokens)
    h = _checks.count("hidden", hidden, minimum=1)
    k = _checks.count("top_k", top_k, minimum=1)
    b = _checks.positive("bytes_per_element", bytes_per_element)
    return (3 * k + 1) * n * h * b


def permute_to_compute(
    top_k: int,
    ffn: int,
    peak_flops: float,
    mfu: float,
    memory_bandwidth: float,
    bytes_per_element: float = 2,
    matrices_per_expert: int = 3,
) -> float:
    """Time of the permute and unpermute (at ``memory_bandwidth`` bytes/s) over the time
    of the experts' forward compute (``2 * matrices * hidden * ffn`` FLOPs per copy at
    ``peak_flops * mfu``), a ratio. The tokens and the hidden size cancel:

        ratio = (3 k + 1) * b * peak * mfu / (2 * matrices * ffn * k * bandwidth).
    """
    k = _checks.count("top_k", top_k, minimum=1)
    f = _checks.count("ffn", ffn, minimum=1)
    peak = _checks.positive("peak_flops", peak_flops)
    share = _checks.positive("mfu", mfu, maximum=1)
    bandwidth = _checks.positive("memory_bandwidth", memory_bandwidth)
    m = _checks.count("matrices_per_expert", matrices_per_expert, minimum=1)
    memory_time = permute_bytes(1, 1, k, bytes_per_element) / bandwidth
    compute_time = 2 * m * f * k / (peak * share)
    return memory_time / compute_time


def can_group(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> bool:
    """Whether ``torch.nn.functional.grouped_mm`` takes these operands in torch 2.13: a
    dtype of :data:`GROUPED_MM_DTYPES`, all three the same, and rows whose byte length is a
    multiple of 16 (its stride rule)."""
    dtypes = {x.dtype, w_up.dtype, w_down.dtype}
    if len(dtypes) != 1 or x.dtype not in GROUPED_MM_DTYPES:
        return False
    width = x.element_size()
    return all((n * width) % 16 == 0 for n in (x.shape[1], w_up.shape[2], w_down.shape[2]))


def _grouped(rows: torch.Tensor, weights: torch.Tensor, counts: list[int], grouped: bool):
    """``rows`` (sorted by expert, ``counts[e]`` rows each) times each expert's matrix."""
    if grouped:
        ends = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
        return nn.functional.grouped_mm(rows, weights, offs=ends.to(rows.device))
    parts = [part @ weights[e] for e, part in enumerate(rows.split(counts))]
    return torch.cat(parts) if parts else rows.new_zeros((0, weights.shape[2]))


def expert_mlps(
    rows: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    counts: Sequence[int],
    grouped: bool | None = None,
) -> torch.Tensor:
    """Each expert's GELU MLP on its group of ``rows``: the first ``counts[0]`` rows
    through expert 0 (``GELU(rows W_up[0]) W_down[0]``), the next ``counts[1]`` through
    expert 1, and so on; two grouped GEMMs with a GELU between them.

    ``grouped=None`` uses ``torch.nn.functional.grouped_mm`` when :func:`can_group`
    allows, ``True`` insists on it, ``False`` loops over the groups.
    """
    sizes = _counts(counts)
    if len(sizes) != w_up.shape[0] or sum(sizes) != rows.shape[0]:
        raise ValueError(
            f"counts must give one group per expert ({w_up.shape[0]}) summing to the rows"
            f" ({rows.shape[0]}), got {sizes}"
        )
    use_grouped = can_group(rows, w_up, w_down) if grouped is None else grouped
    if use_grouped and not can_group(rows, w_up, w_down):
        raise ValueError(f"grouped=True needs what can_group allows, got dtype {rows.dtype}")
    hidden = nn.functional.gelu(_grouped(rows, w_up, sizes, use_grouped))
    return _grouped(hidden, w_down, sizes, use_grouped)


def dropless_forward(
    x: torch.Tensor,
    router: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    *,
    renormalise: bool = True,
    grouped: bool | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """The MoE layer without a capacity: route, permute, grouped GEMMs, unpermute.

    ``x`` (tokens, hidden); ``router`` (E, hidden); ``w_up`` (E, hidden, ffn); ``w_down``
    (E, ffn, hidden): :class:`trainscale.experts.MoELayer`'s weights, GELU between the two
    GEMMs. The ``tokens * k`` assignments are sorted by expert (a stable sort, so each
    group keeps token order), the rows gathered in that order, each expert run on its
    group, and each result weighted by its gate and added into its token's row.
    ``grouped``: as in :func:`expert_mlps`. Returns the output (tokens, hidden) and the
    rows each expert received. Differentiable.
    """
    if x.dim() != 2 or router.dim() != 2 or x.shape[1] != router.shape[1]:
        raise ValueError(
            f"x must be (tokens, hidden) and router (E, hidden), got {tuple(x.shape)}"
            f" and {tuple(router.shape)}"
        )
    routing = route(x @ router.T, top_k, None, renormalise=renormalise)
    n_experts = router.shape[0]
    flat_expert = routing.experts.reshape(-1)  # token-major: token t's k choices in a row
    order = torch.argsort(flat_expert, stable=True)
    token = order // routing.experts.shape[1]
    counts = torch.bincount(flat_expert, minlength=n_experts).tolist()
    permuted = x[token]  # the permute: each copy of a token, grouped by expert
    result = expert_mlps(permuted, w_up, w_down, counts, grouped)
    weighted = result * routing.gates.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add(0, token, weighted), counts  # the unpermute
