"""Unknowns: what no source pins down, the span each one takes, and how they move together.

A step-time model of a real run rests on a few quantities no paper publishes for it. The
planner names them here, gives each the span its sources allow, and builds every range it
prints from them (:func:`range_corners`), so that a range says what is not known rather than
what was tuned:

* ``traffic``, :data:`ELEMENTWISE_TRAFFIC`: bytes the element-wise kernels (norms, softmax,
  dropout, activations, residual adds) move per byte of activation a layer keeps, forward
  and backward together, 2 to 4;
* ``tile_overhead``, :data:`TILE_OVERHEAD`: how much of a GEMM tile's output write the
  kernel waits for, none (another tile's math hides it) to all of it;
* ``overlap``, :data:`OVERLAP`: the share of the communication that can hide under
  compute that does, where the software does not document it;
* ``attention``: the share of peak a fused attention kernel sustains, between the slowest
  and the fastest published kernel on the GPU (:attr:`trainscale.published.Gpu.attention_share`);
* ``peak``: for a power-limited GPU, its sustained peak, between the lowest its limit may
  hold it to and its datasheet's (:attr:`trainscale.published.Gpu.peak_flops_low`).

The GEMM share is not one of them. Korthikanti et al.'s Table 4 times one layer (19.6 ms,
forward and backward), and the planner reads off it the one share at which its roofline
takes that long *given* the traffic and the tile overhead (:func:`trainscale.planner.gemm_share`).
So the three move together: more element-wise traffic leaves less of the measured time to
the GEMMs, which must then run faster. At Table 4's own layer every corner of the range gives
the measured time; away from it the corners part, and the range widens with the distance.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from trainscale import _checks

ELEMENTWISE_TRAFFIC = {"low": 4.0, "point": 3.0, "high": 2.0}
"""Bytes the element-wise kernels (norms, softmax, dropout, GeLU, residual adds) move
per byte of activation a layer keeps for backward, over forward and backward
together, by band (pessimistic ``low``). Derivation: each kept activation is written
once forward and read once backward (2); the backward writes a gradient of each and
reads inputs it did not keep (up to 2 more). A fused stack's kernels are not public
op by op, so this is a span; an eager stack's are, and are counted instead
(:func:`trainscale.planner.memory.eager_layer_traffic_bytes`)."""

TILE_OVERHEAD = {"low": 1.0, "point": 1.0, "high": 0.0}
"""How much of each tile's output write (:func:`trainscale.planner.tile_overhead_k`) a GEMM
waits for, by band: all of it (a thread block that writes its tile before its SM starts the
next one, as a non-persistent kernel with one block per SM does), or none (CUTLASS's
persistent "ping-pong" kernels overlap one warp group's output with the other's math, and a
second resident block hides it too). The first-order write is the physical cost: 64 KB at
the SM's share of the memory bandwidth, about 3.5 microseconds on an A100."""

OVERLAP = {"low": 0.0, "point": 0.5, "high": 1.0}
"""Share of the communication that *can* hide under compute that does hide, by band
(where the software documents it, :meth:`trainscale.software.Software.overlap_shares`
replaces the band):
data-parallel traffic under the backward (and ZeRO-3's gathers under the forward),
and the backward's tensor-parallel collectives under the weight-gradient GEMMs
(Korthikanti et al. section 6.2 overlap them; their Table 5 runs do not overlap the
data-parallel all-reduce)."""

ENDS = ("low", "point", "high")
"""The bands of a span: its pessimistic end, its middle and its optimistic end."""


@dataclass(frozen=True)
class Unknowns:
    """One setting of the unknowns (see the module's docstring).

    ``traffic`` in bytes per kept byte, ``tile_overhead`` a multiple of the first-order
    tile write (0 to 1), ``overlap`` a share (0 to 1); ``attention`` and ``peak`` name the
    band of a GPU's measured span (:data:`ENDS`): the GPU gives the numbers.
    """

    traffic: float = ELEMENTWISE_TRAFFIC["point"]
    tile_overhead: float = TILE_OVERHEAD["point"]
    overlap: float = OVERLAP["point"]
    attention: str = "point"
    peak: str = "point"

    def __post_init__(self) -> None:
        _checks.positive("traffic", self.traffic)
        _checks.non_negative("tile_overhead", self.tile_overhead)
        _checks.fraction("overlap", self.overlap)
        for name in ("attention", "peak"):
            _checks.choice(name, getattr(self, name), ENDS)


CENTRAL = Unknowns()
"""The central estimate: every unknown at the middle of its span."""


def band_value(span: tuple[float, float] | None, band: str, default: float) -> float:
    """The value of a measured ``span`` (slowest, fastest) at ``band``: either end, or their
    geometric middle for ``"point"``; ``default`` where nothing is measured (``None``)."""
    _checks.choice("band", band, ENDS)
    if span is None:
        return default
    low, high = span
    return {"low": low, "point": math.sqrt(low * high), "high": high}[band]


def range_corners() -> tuple[tuple[Unknowns, ...], tuple[Unknowns, ...]]:
    """The settings a range is the slowest and the fastest of: ``(pessimistic, optimistic)``.

    Each side holds the unknowns that do not trade against each other at their own end
    (no overlap, the slowest attention kernel and the lowest peak; or the opposite), and
    every combination of the traffic and the tile overhead, because those two trade
    against the GEMM share Table 4 ties them to: which combination is slowest depends on
    the layout. The range's low end is the slowest of the first side, its high end the
    fastest of the second.
    """
    pairs = list(itertools.product(sorted(set(ELEMENTWISE_TRAFFIC.values())), (0.0, 1.0)))
    low = tuple(
        Unknowns(traffic, overhead, OVERLAP["low"], "low", "low") for traffic, overhead in pairs
    )
    high = tuple(
        Unknowns(traffic, overhead, OVERLAP["high"], "high", "high") for traffic, overhead in pairs
    )
    return low, high
