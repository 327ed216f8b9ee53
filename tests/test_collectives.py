"""collectives: the ring all-reduce and its halves, on every awkward length."""

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale.collectives import (
    SEVEN_B_STEP,
    SEVEN_B_TP_LAYER,
    AlphaBeta,
    DataParallelSetup,
    TensorParallelSetup,
    bus_bandwidth,
    data_parallel_step,
    dp_hiding_threshold_tokens,
    fit_alpha_beta,
    latency_bandwidth_crossover,
    ring_all_gather,
    ring_all_reduce,
    ring_all_reduce_seconds,
    ring_all_reduce_trace,
    ring_bytes_per_rank,
    ring_factor,
    ring_reduce_scatter,
    tp_comm_to_compute,
)

ranks = st.integers(1, 9)
lengths = st.integers(0, 40)


def _inputs(n: int, length: int, dtype=torch.int64) -> list[torch.Tensor]:
    """Distinct integer data per rank, so a wrong sum cannot pass by accident."""
    return [(torch.arange(length, dtype=torch.int64) * (r + 1) + 7**r).to(dtype) for r in range(n)]


@given(ranks, lengths)
def test_all_reduce_gives_every_rank_the_exact_sum(n, length):
    tensors = _inputs(n, length)
    results, _ = ring_all_reduce(tensors)
    expected = torch.stack(tensors).sum(dim=0)
    assert len(results) == n
    assert all(torch.equal(r, expected) for r in results)


@given(ranks, lengths)
def test_inputs_are_never_modified(n, length):
    tensors = _inputs(n, length)
    copies = [t.clone() for t in tensors]
    ring_all_reduce(tensors)
    ring_reduce_scatter(tensors)
    ring_all_gather(tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, copies, strict=True))


@given(ranks, st.integers(0, 10).map(lambda k: k))
def test_traffic_is_2_n_minus_1_over_n_when_divisible(n, k):
    length = n * k
    _, sent = ring_all_reduce(_inputs(n, length))
    assert sent == [2 * (n - 1) * length // n] * n
    assert sent[0] == ring_bytes_per_rank(length, n)


def test_ring_factor_by_hand():
    # 8 ranks: an all-reduce sends 2 x 7/8 = 1.75 tensors per rank, each half 7/8.
    assert ring_factor(8) == 1.75
    assert ring_factor(8, "reduce-scatter") == ring_factor(8, "all-gather") == 0.875
    assert ring_factor(4) == 1.5 and ring_factor(2, "all-gather") == 0.5
    assert ring_factor(1) == ring_factor(1, "reduce-scatter") == 0.0
    for bad, name in (((0,), "ranks"), ((4, "broadcast"), "collective")):
        with pytest.raises(ValueError, match=name):
            ring_factor(*bad)


@given(ranks, st.integers(0, 10))
def test_ring_factor_is_what_the_simulated_ring_sends(n, k):
    length = n * k  # divisible: every rank sends the same
    _, reduced = ring_reduce_scatter(_inputs(n, length))
    _, gathered = ring_all_gather(list(torch.tensor_split(torch.arange(length), n)))
    _, all_reduced = ring_all_reduce(_inputs(n, length))
    assert reduced == [pytest.approx(ring_factor(n, "reduce-scatter") * length)] * n
    assert gathered == [pytest.approx(ring_factor(n, "all-gather") * length)] * n
    assert all_reduced == [pytest.approx(ring_factor(n) * length)] * n


@given(ranks, lengths)
def test_total_traffic_matches_the_chunks(n, length):
    # Each phase moves every chunk N-1 times in all, whatever the chunk sizes.
    _, sent = ring_all_reduce(_inputs(n, length))
    assert sum(sent) == 2 * (n - 1) * length
    assert max(sent) - min(sent) <= 2 * (n - 1)  # unequal chunks differ by one element


@given(ranks, lengths)
def test_reduce_scatter_owns_chunk_r_plus_1(n, length):
    tensors = _inputs(n, length)
    owned, sent = ring_reduce_scatter(tensors)
    chunks = torch.tensor_split(torch.stack(tensors).sum(dim=0), n)
    assert all(torch.equal(owned[r], chunks[(r + 1) % n]) for r in range(n))
    assert sum(sent) == (n - 1) * length


@given(st.lists(st.integers(0, 6), min_size=1, max_size=8))
def test_all_gather_of_unequal_shards(sizes):
    shards = [torch.full((s,), float(r)) for r, s in enumerate(sizes)]
    gathered, sent = ring_all_gather(shards)
    assert all(torch.equal(g, torch.cat(shards)) for g in gathered)
    assert sum(sent) == (len(sizes) - 1) * sum(sizes)


def test_float_all_reduce_matches_sum():
    torch.manual_seed(0)
    tensors = [torch.randn(1000) for _ in range(4)]
    results, _ = ring_all_reduce(tensors)
    assert torch.allclose(results[2], sum(tensors), atol=1e-5)


def test_mismatched_ranks_are_rejected():
    with pytest.raises(ValueError, match=r"tensors\[1\]"):
        ring_all_reduce([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(ValueError, match="tensors"):
        ring_all_reduce([])
    with pytest.raises(ValueError, match=r"tensors\[0\]"):
        ring_all_reduce([torch.zeros(2, 2)])


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_trace_ends_with_every_chunk_complete_everywhere(n):
    trace = ring_all_reduce_trace(n)
    assert len(trace) == 1 + 2 * (n - 1)
    everyone = frozenset(range(n))
    middle = trace[n - 1]  # after reduce-scatter: rank r owns chunk (r + 1) % n
    assert all(middle.contributions[r][(r + 1) % n] == everyone for r in range(n))
    assert all(c == everyone for row in trace[-1].contributions for c in row)


def test_7b_gradients_on_8_gpus_send_24_5_gb_per_rank():
    assert ring_bytes_per_rank(14e9, 8) == pytest.approx(24.5e9)
    assert ring_bytes_per_rank(14e9, 8) / 100e9 == pytest.approx(0.245)


def test_bus_bandwidth_follows_nccl_tests():
    assert bus_bandwidth(10.0, 4) == pytest.approx(15.0)
    assert bus_bandwidth(10.0, 1) == 0.0
    with pytest.raises(ValueError, match="ranks"):
        bus_bandwidth(10.0, 0)


# --- the alpha-beta model -----------------------------------------------------------


def test_ring_all_reduce_seconds_by_hand():
    # 4 ranks, alpha = 1 ms, B = 1 GB/s, S = 4 MB:
    # 2 x 3 x 1e-3 = 6 ms of latency + 2 x 3/4 x 4e6 / 1e9 = 6 ms of bandwidth = 12 ms.
    assert ring_all_reduce_seconds(4e6, 4, 1e-3, 1e9) == pytest.approx(12e-3)
    assert ring_all_reduce_seconds(4e6, 1, 1e-3, 1e9) == 0.0  # one rank sends nothing
    assert ring_all_reduce_seconds(0, 4, 1e-3, 1e9) == pytest.approx(6e-3)


def test_crossover_is_where_the_two_terms_are_equal():
    # S* = N alpha B = 4 x 1e-3 x 1e9 = 4 MB, the size of the test above: 6 ms + 6 ms.
    assert latency_bandwidth_crossover(4, 1e-3, 1e9) == pytest.approx(4e6)
    fit = AlphaBeta(latency=1e-3, bandwidth=1e9, ranks=4)
    assert fit.crossover_bytes == pytest.approx(4e6)
    assert fit.seconds(fit.crossover_bytes) == pytest.approx(2 * fit.seconds(0))


@given(st.integers(2, 64), st.floats(1e-7, 1e-2), st.floats(1e8, 1e12))
def test_busbw_is_half_the_link_at_the_crossover(n, alpha, bandwidth):
    size = latency_bandwidth_crossover(n, alpha, bandwidth)
    busbw = bus_bandwidth(size / ring_all_reduce_seconds(size, n, alpha, bandwidth), n)
    assert busbw == pytest.approx(bandwidth / 2)


def test_fit_recovers_a_noise_free_sweep():
    # Synthetic times from alpha = 50 us, B = 2 GB/s on 4 ranks, 4 KiB to 16 MiB.
    sizes = [4**k * 4096 for k in range(7)]
    times = [ring_all_reduce_seconds(s, 4, 50e-6, 2e9) for s in sizes]
    fit = fit_alpha_beta(sizes, times, 4)
    assert fit.latency == pytest.approx(50e-6)
    assert fit.bandwidth == pytest.approx(2e9)
    assert fit.ranks == 4
    assert fit.crossover_bytes == pytest.approx(4 * 50e-6 * 2e9)  # 400 kB


def test_fit_minimises_the_relative_error_by_hand():
    # 2 ranks: T = 2 alpha + S / B. Points (0, 1), (1, 1), (2, 3) with weights 1/T^2 =
    # 1, 1, 1/9; normal equations x 9: [19 11; 11 13] [a; c] = [21; 15], det 126,
    # a = (21 x 13 - 11 x 15) / 126 = 6/7, c = (19 x 15 - 11 x 21) / 126 = 3/7.
    # alpha = a / 2 = 3/7 s; B = 1 / c = 7/3 bytes/s. (A plain fit gives a = 2/3, c = 1.)
    fit = fit_alpha_beta([0, 1, 2], [1, 1, 3], 2)
    assert fit.latency == pytest.approx(3 / 7)
    assert fit.bandwidth == pytest.approx(7 / 3)


def test_fit_never_returns_a_negative_latency():
    # Times proportional to size but for a dip at the small end: the best line has a
    # negative intercept, so the fit goes through the origin. Weights 1/T^2 make
    # c = sum(S/T) / sum(S^2/T^2) = (1/0.5 + 2/2.4 + 4/4.8) / (4 + 0.6944 + 0.6944).
    sizes, times = [1, 2, 4], [0.5, 2.4, 4.8]
    fit = fit_alpha_beta(sizes, times, 2)
    assert fit.latency == 0.0
    slope = (2 + 2 / 2.4 + 4 / 4.8) / (4 + (2 / 2.4) ** 2 + (4 / 4.8) ** 2)
    assert fit.bandwidth == pytest.approx(1 / slope)


@pytest.mark.parametrize(
    ("sizes", "seconds", "ranks", "named"),
    [
        ([1, 2], [1.0, 2.0], 1, "ranks"),
        ([1, 2], [1.0], 4, "sizes and seconds"),
        ([1], [1.0], 4, "sizes and seconds"),
        ([3, 3], [1.0, 2.0], 4, "distinct"),
        ([1, 2], [1.0, 0.0], 4, "seconds"),
        ([-1, 2], [1.0, 2.0], 4, "sizes"),
        ([1, 2], [2.0, 1.0], 4, "grow"),
    ],
)
def test_fit_refuses_bad_data(sizes, seconds, ranks, named):
    with pytest.raises(ValueError, match=named):
        fit_alpha_beta(sizes, seconds, ranks)


def test_alpha_beta_arguments_are_named():
    with pytest.raises(ValueError, match="latency"):
        ring_all_reduce_seconds(1, 4, -1.0, 1e9)
    with pytest.raises(ValueError, match="bandwidth"):
        ring_all_reduce_seconds(1, 4, 1e-3, 0)
    with pytest.raises(ValueError, match="ranks"):
        latency_bandwidth_crossover(1, 1e-3, 1e9)


# --- when communication hides ---------------------------------------------------------


def test_dp_hiding_threshold_by_hand():
    # T* = (N-1)/N x b x peak x MFU / (2 B).
    # bf16 at 100 GB/s on 8 GPUs: 7/8 x 2 x 1e15 x 0.4 / (2 x 1e11) = 7/8 x 4,000 = 3,500.
    assert dp_hiding_threshold_tokens(8, 2, 1e15, 0.4, 100e9) == pytest.approx(3500)
    # fp32 at 50 GB/s: 7/8 x 4 x 4e14 / 1e11 = 7/8 x 16,000 = 14,000.
    assert dp_hiding_threshold_tokens(8, 4, 1e15, 0.4, 50e9) == pytest.approx(14000)
    assert dp_hiding_threshold_tokens(1, 2, 1e15, 0.4, 100e9) == 0.0


@given(
    st.integers(1, 1024),
    st.sampled_from([1, 2, 4]),
    st.floats(1e12, 1e16),
    st.floats(0.01, 1.0),
    st.floats(1e9, 1e12),
)
def test_at_the_threshold_the_all_reduce_equals_backward(n, b, peak, mfu, link):
    threshold = dp_hiding_threshold_tokens(n, b, peak, mfu, link)
    if threshold == 0:
        return
    step = data_parallel_step(7e9, threshold, n, b, peak, mfu, link)
    assert step.all_reduce_seconds == pytest.approx(step.backward_seconds)
    assert step.exposed_seconds == pytest.approx(0, abs=1e-9 * step.backward_seconds)
    assert data_parallel_step(7e9, threshold / 2, n, b, peak, mfu, link).exposed_seconds > 0


def test_data_parallel_step_of_the_book_by_hand():
    # 7B, 16,384 tokens per GPU, 8 GPUs, bf16, 1e15 x 0.4, 100 GB/s:
    # backward = 4 x 7e9 x 16,384 / 4e14 = 1.14688 s; all-reduce = 7/4 x 14e9 / 1e11 = 0.245 s.
    step = data_parallel_step(7e9, 16384, 8, 2, 1e15, 0.4, 100e9)
    assert step.backward_seconds == pytest.approx(1.14688)
    assert step.all_reduce_seconds == pytest.approx(0.245)
    assert step.exposed_seconds == 0.0
    # 1,024 tokens: backward 0.07168 s, so 0.245 - 0.07168 = 0.17332 s stays exposed.
    short = data_parallel_step(7e9, 1024, 8, 2, 1e15, 0.4, 100e9)
    assert short.exposed_seconds == pytest.approx(0.17332)


def test_tp_comm_to_compute_by_hand():
    # (t-1)/h x b/9 x peak x MFU / B. t = 2, h = 1,000, bf16, 9e12 FLOP/s, B = 1 GB/s:
    # 1/1000 x 2/9 x 9e12 / 1e9 = 2.
    assert tp_comm_to_compute(2, 1000, 9e12, 1.0, 1e9) == pytest.approx(2.0)
    # t = 8, h = 4,096, bf16, 1e15 x 0.4, 450 GB/s: 7 x 2 x 4e14 / (9 x 4096 x 4.5e11)
    # = 5.6e15 / 1.65888e16 = 0.33757...
    assert tp_comm_to_compute(8, 4096, 1e15, 0.4, 450e9) == pytest.approx(5.6e15 / 1.65888e16)
    assert tp_comm_to_compute(1, 4096, 1e15, 0.4, 450e9) == 0.0
    # fp32 activations send twice the bytes.
    assert tp_comm_to_compute(8, 4096, 1e15, 0.4, 450e9, bytes_per_value=4) == pytest.approx(
        2 * 5.6e15 / 1.65888e16
    )


@given(st.integers(2, 64), st.integers(256, 65536))
def test_tp_ratio_halves_with_twice_the_width_or_the_link(t, h):
    ratio = tp_comm_to_compute(t, h, 1e15, 0.5, 1e11)
    assert tp_comm_to_compute(t, 2 * h, 1e15, 0.5, 1e11) == pytest.approx(ratio / 2)
    assert tp_comm_to_compute(t, h, 1e15, 0.5, 2e11) == pytest.approx(ratio / 2)


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (lambda: dp_hiding_threshold_tokens(0, 2, 1e15, 0.4, 1e11), "ranks"),
        (lambda: dp_hiding_threshold_tokens(8, 0, 1e15, 0.4, 1e11), "bytes_per_element"),
        (lambda: dp_hiding_threshold_tokens(8, 2, 1e15, 1.5, 1e11), "mfu"),
        (lambda: dp_hiding_threshold_tokens(8, 2, 1e15, 0.4, 0), "link_bandwidth"),
        (lambda: data_parallel_step(7e9, 0, 8, 2, 1e15, 0.4, 1e11), "tokens_per_gpu"),
        (lambda: data_parallel_step(0.5, 10, 8, 2, 1e15, 0.4, 1e11), "params"),
        (lambda: tp_comm_to_compute(0, 4096, 1e15, 0.4, 1e11), "shards"),
        (lambda: tp_comm_to_compute(8, 0, 1e15, 0.4, 1e11), "hidden"),
        (lambda: tp_comm_to_compute(8, 4096, -1, 0.4, 1e11), "peak_flops"),
    ],
)
def test_hiding_arguments_are_named(call, named):
    with pytest.raises(ValueError, match=named):
        call()


def test_the_books_shared_7b_step_by_hand():
    # 7e9 parameters, 8 GPUs, 4 x 4,096 = 16,384 tokens per GPU, 1e15 x 0.4, bf16, 100 GB/s:
    # compute = 6 x 7e9 x 16,384 / 4e14 = 1.72032 s; backward 4/6 of it = 1.14688 s;
    # all-reduce = 2 x 7/8 x 14e9 B / 1e11 B/s = 0.245 s; on 2 GPUs 2 x 1/2 x 0.14 s.
    assert SEVEN_B_STEP.tokens_per_gpu == 16384
    assert SEVEN_B_STEP.compute_seconds == pytest.approx(1.72032)
    step = SEVEN_B_STEP.step()
    assert step.backward_seconds == pytest.approx(1.14688)
    assert step.all_reduce_seconds == pytest.approx(0.245)
    assert SEVEN_B_STEP.step(gpus=2).all_reduce_seconds == pytest.approx(0.14)
    assert SEVEN_B_STEP.step(gpus=1).all_reduce_seconds == 0.0


def test_the_books_shared_tp_layer_by_hand():
    # (t-1)/h x b/9 x peak x MFU / B = 7/4,096 x 2/9 x 4e14 / 4.5e11 = 0.33758 over NVLink;
    # 9 times that over the 50 GB/s network: 3.0382.
    assert SEVEN_B_TP_LAYER.comm_to_compute() == pytest.approx(0.33758, rel=1e-4)
    network = SEVEN_B_TP_LAYER.network_bandwidth
    assert SEVEN_B_TP_LAYER.comm_to_compute(network) == pytest.approx(3.0382, rel=1e-4)
    # the same GPU as the data-parallel step
    assert SEVEN_B_TP_LAYER.peak_flops == SEVEN_B_STEP.peak_flops
    assert SEVEN_B_TP_LAYER.mfu == SEVEN_B_STEP.mfu


@given(st.integers(1, 4096))
def test_shared_step_backward_ignores_gpus_and_ring_stays_under_twice(gpus):
    step = SEVEN_B_STEP.step(gpus=gpus)
    assert step.backward_seconds == pytest.approx(SEVEN_B_STEP.step().backward_seconds)
    gradients = SEVEN_B_STEP.params * SEVEN_B_STEP.bytes_per_gradient
    assert step.all_reduce_seconds < 2 * gradients / SEVEN_B_STEP.link_bandwidth


@pytest.mark.parametrize(
    ("record", "change", "name"),
    [
        (SEVEN_B_STEP, {"mfu": 1.5}, "mfu"),
        (SEVEN_B_STEP, {"gpus": 0}, "gpus"),
        (SEVEN_B_STEP, {"link_bandwidth": 0}, "link_bandwidth"),
        (SEVEN_B_TP_LAYER, {"shards": 0}, "shards"),
        (SEVEN_B_TP_LAYER, {"network_bandwidth": -1.0}, "network_bandwidth"),
    ],
)
def test_shared_records_refuse_bad_inputs(record, change, name):
    assert isinstance(record, DataParallelSetup | TensorParallelSetup)
    with pytest.raises(ValueError, match=name):
        dataclasses.replace(record, **change)
