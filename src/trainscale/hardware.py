"""Inside a GPU node: arithmetic intensity, the roofline and how a GEMM runs (the primer).

A kernel moves bytes between the GPU's memory (HBM) and its processors, and does
arithmetic on them. Which of the two sets its time depends on its *arithmetic
intensity*, FLOPs per byte moved (:func:`arithmetic_intensity`, :func:`gemm_intensity`,
:func:`elementwise_intensity`), against the machine's *balance*, peak FLOP/s over
bytes per second (:func:`machine_balance`): below it a kernel is memory-bound, above it
compute-bound. Its best time is the longer of the two (:func:`roofline_seconds`), its
best rate the lower of the two roofs (:func:`roofline_flops`): the roofline of Williams,
Waterman and Patterson (Communications of the ACM 52(4), 2009).

A matrix product (GEMM) runs as a grid of output tiles (:data:`TILE`,
:func:`gemm_tiles`), one per thread block, which the GPU's streaming multiprocessors
(SMs) take in waves (:func:`gemm_waves`); each tile also writes its output when its
main loop ends (:func:`tile_overhead_k`). :func:`gemm_seconds` puts the three together,
and :func:`gemm_peak_share` gives the share of the peak a GEMM of a given shape reaches.
The planner (:mod:`trainscale.planner.kernels`) times every GEMM of a layer with
:func:`gemm_seconds`.

Plain arithmetic on floats, no torch: the planner imports this module and runs under
Pyodide.
"""

from __future__ import annotations

import math

from trainscale import _checks

TILE = (256, 128)
"""Output tile of one thread block in a large cuBLAS bf16 GEMM, rows x columns (NVIDIA's
"Matrix Multiplication Background" user's guide, section 2.3, lists 256 x 128 as the
most efficient of its typical tiles)."""


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """FLOPs done per byte moved to or from memory, FLOP/B: ``flops / bytes_moved``."""
    return _checks.non_negative("flops", flops) / _checks.positive("bytes_moved", bytes_moved)


def machine_balance(peak_flops: float, bandwidth: float) -> float:
    """FLOP/B at which a kernel needs as long to move its bytes as to do its FLOPs:
    ``peak_flops / bandwidth`` (FLOP/s over B/s). Against the memory bandwidth it
    splits kernels into memory-bound and compute-bound; against a link's bandwidth it is
    the arithmetic each byte sent over that link must be hidden under."""
    return _checks.positive("peak_flops", peak_flops) / _checks.positive("bandwidth", bandwidth)


def gemm_flops(m: float, k: float, n: float) -> float:
    """FLOPs of one ``(m x k) @ (k x n)`` product: ``2 m k n`` (each of the ``m n``
    outputs takes ``k`` multiply-adds, two FLOPs each)."""
    for name, value in (("m", m), ("k", k), ("n", n)):
        _checks.positive(name, value)
    return 2 * m * k * n


def gemm_bytes(m: float, k: float, n: float, bytes_per_element: float = 2) -> float:
    """Bytes a GEMM ``(m x k) @ (k x n)`` moves at least: reads ``A`` and ``B`` once and
    writes ``C`` once, ``bytes_per_element x (m k + k n + m n)`` (2 for bf16)."""
    for name, value in (("m", m), ("k", k), ("n", n)):
        _checks.positive(name, value)
    return _checks.positive("bytes_per_element", bytes_per_element) * (m * k + k * n + m * n)


def gemm_intensity(m: float, k: float, n: float, bytes_per_element: float = 2) -> float:
    """FLOP/B of a GEMM that moves each operand and its result once:
    ``2 m k n / (bytes_per_element (m k + k n + m n))``. For ``m = k = n`` it is
    ``n / 3`` in bf16, so it grows with the size; a short side caps it (attention's
    ``Q K^T`` with head dimension ``k = 128`` stays below 128)."""
    return gemm_flops(m, k, n) / gemm_bytes(m, k, n, bytes_per_element)


def elementwise_intensity(
    flops_per_element: float = 1.0, operands: int = 2, bytes_per_element: float = 2
) -> float:
    """FLOP/B of an element-wise kernel that reads ``operands`` tensors and writes one:
    ``flops_per_element / ((operands + 1) bytes_per_element)``. Adding two bf16 tensors:
    1 FLOP per 6 bytes."""
    reads = _checks.count("operands", operands, minimum=1)
    size = _checks.positive("bytes_per_element", bytes_per_element)
    return _checks.non_negative("flops_per_element", flops_per_element) / ((reads + 1) * size)


def roofline_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The best FLOP/s a kernel of ``intensity`` FLOP/B can reach: the lower of the
    compute roof, ``peak_flops``, and the memory roof, ``intensity x bandwidth``."""
    rate = _checks.non_negative("intensity", intensity) * _checks.positive("bandwidth", bandwidth)
    return min(_checks.positive("peak_flops", peak_flops), rate)


def roofline_seconds(
    flops: float, bytes_moved: float, peak_flops: float, bandwidth: float
) -> float:
    """The best time in seconds of a kernel that does ``flops`` and moves ``bytes_moved``:
    the longer of its FLOPs at ``peak_flops`` and its bytes at ``bandwidth`` (the two
    overlap at best, so the slower one sets the time)."""
    compute = _checks.non_negative("flops", flops) / _checks.positive("peak_flops", peak_flops)
    memory = _checks.non_negative("bytes_moved", bytes_moved) / _checks.positive(
        "bandwidth", bandwidth
    )
    return max(compute, memory)


def gemm_tiles(m: float, n: float, batch: float = 1) -> int:
    """Output tiles of ``batch`` GEMMs with an ``m x n`` output, one per thread block:
    ``ceil(m / 256) x ceil(n / 128) x ceil(batch)`` (:data:`TILE`; a partial tile at an
    edge costs a whole one)."""
    for name, value in (("m", m), ("n", n), ("batch", batch)):
        _checks.positive(name, value)
    rows, cols = TILE
    return math.ceil(m / rows) * math.ceil(n / cols) * math.ceil(batch)


def gemm_waves(tiles: int, multiprocessors: int) -> int:
    """Waves in which ``multiprocessors`` SMs run ``tiles`` tiles, one tile per SM at a
    time: ``ceil(tiles / multiprocessors)``. A partly filled last wave takes as long as a
    full one (wave quantisation)."""
    count = _checks.count("tiles", tiles, minimum=1)
    return math.ceil(count / _checks.count("multiprocessors", multiprocessors, minimum=1))


def tile_overhead_k(share: float, peak_flops: float, bandwidth: float) -> float:
    """A tile's fixed cost, first order, in steps of its main loop counted in units of ``k``.

    After its last multiply a tile writes its ``2 x 256 x 128`` bytes of 16-bit output
    at its SM's share of the memory bandwidth; its main loop does ``2 x 256 x 128``
    FLOPs per unit of ``k`` at its SM's share of ``share x peak_flops``. Both shares are
    the SM's, so the write lasts ``share x peak_flops / bandwidth`` units of ``k``: the
    machine's balance point, FLOPs per byte (2 bytes per output element, 2 FLOPs per
    multiply-add). About 103 on an A100 at the central share, 0.67. So a GEMM whose
    ``k`` is short (tensor parallelism cuts the output projection's ``k`` to ``h / TP``)
    runs further below its share than a wide one. Not counted: the wait for the first
    slice of A and B before the first multiply (CUTLASS's multistage main loop waits for
    one stage, one memory latency). A second tile resident on the SM, or a persistent
    kernel, hides the output write (CUTLASS's "Efficient GEMM" notes: Hopper's
    persistent ping-pong kernel overlaps one warp group's output with the other's math);
    :data:`trainscale.planner.unknowns.TILE_OVERHEAD` gives the span the range allows.
    """
    rate = _checks.positive("share", share, maximum=1.0) * _checks.positive(
        "peak_flops", peak_flops
    )
    return rate / _checks.positive("bandwidth", bandwidth)


def gemm_seconds(
    m: float,
    k: float,
    n: float,
    peak_flops: float,
    bandwidth: float,
    share: float,
    batch: float = 1,
    multiprocessors: int = 132,
    tile_overhead: float = 1.0,
) -> float:
    """Time in seconds of ``batch`` bf16 GEMMs ``(m x k) @ (k x n)``, launched as one kernel.

    Compute: the output is cut into :data:`TILE` tiles, one per thread block
    (:func:`gemm_tiles`), and the ``multiprocessors`` SMs run them in waves
    (:func:`gemm_waves`); a partly filled last wave takes as long
    as a full one (wave quantisation, section 3.2 of NVIDIA's "Matrix Multiplication
    Background" user's guide). Each wave does ``multiprocessors x 2 x 256 x 128 x k``
    FLOPs at ``share x peak_flops``, and each of its tiles also pays a fixed cost worth
    ``tile_overhead x`` :func:`tile_overhead_k` more of ``k`` (writing its output;
    ``tile_overhead`` 0 when something hides it). Memory: the 16-bit
    operands and results, ``2 (m k + k n + m n)`` bytes per GEMM (:func:`gemm_bytes`), at
    ``bandwidth``. The kernel takes the longer of the two (the roofline of Williams et
    al. 2009). So a GEMM's efficiency is a function of its shape: one with a short side
    (attention's ``Q K^T`` has the head dimension, 128) has few FLOPs per byte, one with
    few tiles wastes most of its last wave, and one with a short ``k`` spends a larger
    share of each tile's time on the tile's fixed cost.

    Left out: launch latency, the L2 cache (operands re-read by several tiles are counted
    once), the wait for a tile's first operands, and a clock that drops under load:
    ``share`` carries all the main loop loses.
    """
    for name, value in (("m", m), ("k", k), ("n", n), ("batch", batch)):
        _checks.positive(name, value)
    peak = _checks.positive("peak_flops", peak_flops)
    bw = _checks.positive("bandwidth", bandwidth)
    rate = peak * _checks.positive("share", share, maximum=1.0)
    sms = _checks.count("multiprocessors", multiprocessors, minimum=1)
    overhead = _checks.non_negative("tile_overhead", tile_overhead)
    rows, cols = TILE
    waves = gemm_waves(gemm_tiles(m, n, batch), sms)
    depth = k + overhead * tile_overhead_k(share, peak, bw)
    compute = waves * sms * 2 * rows * cols * depth / rate
    return max(compute, batch * gemm_bytes(m, k, n) / bw)


def gemm_peak_share(
    m: float,
    k: float,
    n: float,
    peak_flops: float,
    bandwidth: float,
    share: float,
    multiprocessors: int,
    tile_overhead: float = 1.0,
) -> float:
    """The share of ``peak_flops`` one GEMM ``(m x k) @ (k x n)`` reaches in
    :func:`gemm_seconds`: its ``2 m k n`` FLOPs over its time, over the peak. Below
    ``share`` always; far below it for a small or memory-bound GEMM."""
    seconds = gemm_seconds(m, k, n, peak_flops, bandwidth, share, 1, multiprocessors, tile_overhead)
    return gemm_flops(m, k, n) / seconds / peak_flops
