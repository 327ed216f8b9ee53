"""hardware: arithmetic intensity, the roofline and a GEMM's tiles and waves, by hand."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainscale import hardware as hw
from trainscale import planner
from trainscale.planner import kernels

H100_PEAK, H100_HBM = 989e12, 3.35e12  # FLOP/s dense bf16, B/s HBM3 (datasheet)

sizes = st.integers(min_value=1, max_value=50_000)


def test_intensity_and_balance_by_hand():
    assert hw.arithmetic_intensity(10, 4) == 2.5
    assert hw.arithmetic_intensity(0, 4) == 0.0
    # 989e12 / 3.35e12 = 295.2 FLOP/B; an A100's 312e12 / 2.039e12 = 153.0.
    assert hw.machine_balance(H100_PEAK, H100_HBM) == pytest.approx(295.22, abs=0.01)
    assert hw.machine_balance(312e12, 2.039e12) == pytest.approx(153.02, abs=0.01)
    # Against a 50e9 B/s network card: 19,780 FLOPs per byte sent.
    assert hw.machine_balance(H100_PEAK, 50e9) == pytest.approx(19_780)
    with pytest.raises(ValueError, match="bytes_moved"):
        hw.arithmetic_intensity(1, 0)
    with pytest.raises(ValueError, match="bandwidth"):
        hw.machine_balance(1e12, -1)


def test_gemm_counts_by_hand():
    # 4096^3: 2 x 4096^3 = 137,438,953,472 FLOPs; 2 bytes x 3 x 4096^2 = 100,663,296 B;
    # so 4096 / 3 = 1,365.3 FLOP/B.
    assert hw.gemm_flops(4096, 4096, 4096) == 137_438_953_472
    assert hw.gemm_bytes(4096, 4096, 4096) == 100_663_296
    assert hw.gemm_intensity(4096, 4096, 4096) == pytest.approx(1365.33, abs=0.01)
    # Q K^T of one head, 8,192 tokens, head dimension 128: 2 x 8192 x 128 x 8192 FLOPs
    # over 2 (2 x 8192 x 128 + 8192^2) bytes = 128 x 8192 / 8448 = 124.1 FLOP/B.
    assert hw.gemm_intensity(8192, 128, 8192) == pytest.approx(124.12, abs=0.01)
    # fp32 operands halve it.
    assert hw.gemm_intensity(8192, 128, 8192, 4) == pytest.approx(62.06, abs=0.01)
    with pytest.raises(ValueError, match="k"):
        hw.gemm_flops(1, 0, 1)
    with pytest.raises(ValueError, match="bytes_per_element"):
        hw.gemm_bytes(1, 1, 1, 0)


def test_elementwise_intensity_by_hand():
    # Adding two bf16 tensors: 1 FLOP per element, read 2 x 2 bytes, write 2: 1/6.
    assert hw.elementwise_intensity() == pytest.approx(1 / 6)
    # The same in fp32: 1/12; a one-operand op with 8 FLOPs per bf16 element: 8/4 = 2.
    assert hw.elementwise_intensity(1, 2, 4) == pytest.approx(1 / 12)
    assert hw.elementwise_intensity(8, 1, 2) == 2.0
    with pytest.raises(ValueError, match="operands"):
        hw.elementwise_intensity(1, 0)


def test_roofline_by_hand():
    # At 100 FLOP/B an H100 is memory-bound: 100 x 3.35e12 = 3.35e14 FLOP/s; at 1,000
    # FLOP/B the compute roof, 989e12.
    assert hw.roofline_flops(100, H100_PEAK, H100_HBM) == pytest.approx(3.35e14)
    assert hw.roofline_flops(1000, H100_PEAK, H100_HBM) == H100_PEAK
    # 1e12 FLOPs and 1e9 bytes: 1.011 ms of compute, 0.299 ms of memory.
    seconds = hw.roofline_seconds(1e12, 1e9, H100_PEAK, H100_HBM)
    assert seconds == pytest.approx(1e12 / 989e12)
    assert hw.roofline_seconds(1e9, 1e9, H100_PEAK, H100_HBM) == pytest.approx(1e9 / 3.35e12)
    with pytest.raises(ValueError, match="peak_flops"):
        hw.roofline_flops(1, 0, 1)
    with pytest.raises(ValueError, match="flops"):
        hw.roofline_seconds(-1, 1, 1, 1)


def test_tiles_and_waves_by_hand():
    # 8192 x 8192: 32 x 64 = 2,048 tiles of 256 x 128; on 132 SMs 15.5 waves, so 16.
    assert hw.gemm_tiles(8192, 8192) == 2048
    assert hw.gemm_waves(2048, 132) == 16
    # One row or column more costs a whole tile: 257 x 129 takes 2 x 2.
    assert hw.gemm_tiles(257, 129) == 4
    assert hw.gemm_tiles(256, 128, batch=2.5) == 3
    assert (hw.gemm_waves(132, 132), hw.gemm_waves(133, 132)) == (1, 2)
    with pytest.raises(ValueError, match="multiprocessors"):
        hw.gemm_waves(1, 0)
    with pytest.raises(ValueError, match="batch"):
        hw.gemm_tiles(1, 1, 0)


def test_peak_share_by_hand():
    # 8192^3 on 128 SMs (16 full waves) at a main-loop share of 0.5, peak 1e15, 3.35e12 B/s:
    # each tile's write adds 0.5e15 / 3.35e12 = 149.25 of k, so 0.5 x 8192 / 8341.25 = 0.491.
    share = hw.gemm_peak_share(8192, 8192, 8192, 1e15, 3.35e12, 0.5, 128)
    assert share == pytest.approx(0.5 * 8192 / (8192 + 0.5e15 / 3.35e12))
    # Nothing hides the write: tile_overhead 0 leaves the main loop's share.
    assert hw.gemm_peak_share(8192, 8192, 8192, 1e15, 3.35e12, 0.5, 128, 0) == pytest.approx(0.5)


def test_the_planner_uses_this_module_and_re_exports_it():
    assert planner.gemm_seconds is hw.gemm_seconds is kernels.gemm_seconds
    assert planner.tile_overhead_k is hw.tile_overhead_k
    assert planner.TILE is hw.TILE == (256, 128)
    assert not hasattr(kernels, "TILE")  # one home: this module


@given(n=sizes)
def test_a_square_gemm_moves_three_matrices(n):
    assert hw.gemm_intensity(n, n, n) == pytest.approx(n / 3)


@given(intensity=st.floats(0, 1e6), peak=st.floats(1e9, 1e16), bw=st.floats(1e9, 1e13))
def test_the_roofline_is_under_both_roofs(intensity, peak, bw):
    rate = hw.roofline_flops(intensity, peak, bw)
    assert rate <= peak and rate <= intensity * bw * (1 + 1e-12)
    assert rate == peak or rate == pytest.approx(intensity * bw)


@given(tiles=st.integers(1, 10**6), sms=st.integers(1, 200))
def test_waves_hold_every_tile_and_no_empty_wave(tiles, sms):
    waves = hw.gemm_waves(tiles, sms)
    assert (waves - 1) * sms < tiles <= waves * sms


@given(
    m=sizes,
    k=sizes,
    n=sizes,
    share=st.floats(0.05, 1.0),
    overhead=st.floats(0.0, 2.0),
    sms=st.integers(1, 200),
)
def test_a_gemm_is_never_faster_than_its_roofline(m, k, n, share, overhead, sms):
    # The tiles, the waves and the tiles' writes only add time to the plain roofline of
    # the main loop's rate; so the share reached never exceeds the main loop's.
    seconds = hw.gemm_seconds(m, k, n, H100_PEAK, H100_HBM, share, 1, sms, overhead)
    bound = hw.roofline_seconds(
        hw.gemm_flops(m, k, n), hw.gemm_bytes(m, k, n), share * H100_PEAK, H100_HBM
    )
    assert seconds >= bound * (1 - 1e-12)
    reached = hw.gemm_peak_share(m, k, n, H100_PEAK, H100_HBM, share, sms, overhead)
    assert 0 < reached <= share * (1 + 1e-12)
    assert math.isfinite(reached)
