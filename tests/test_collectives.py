"""collectives: the ring all-reduce and its halves, on every awkward length."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale.collectives import (
    bus_bandwidth,
    ring_all_gather,
    ring_all_reduce,
    ring_all_reduce_trace,
    ring_bytes_per_rank,
    ring_factor,
    ring_reduce_scatter,
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
