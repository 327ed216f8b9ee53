"""Chapter 04 on real processes: the send/recv ring, the four collectives, the
measurements; and the ring's schedule, which the real ring and the simulation share."""

import time

import psutil
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainscale.collectives import (
    RingTransfer,
    ring_all_reduce,
    ring_all_reduce_trace,
    ring_bytes_per_rank,
    ring_schedule,
)
from trainscale.distributed import run_ranks
from trainscale.workers import collectives as wc


def _children() -> set[int]:
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and "resource_tracker" not in " ".join(p.cmdline())
    }


# --- the schedule (no processes) ---------------------------------------------------------


@given(st.integers(1, 9))
def test_schedule_replays_the_simulated_trace(n):
    """Running every rank's schedule on sets of contributors gives the trace, step by step."""
    held = [[frozenset({r}) for _ in range(n)] for r in range(n)]
    schedules = [ring_schedule(r, n) for r in range(n)]
    trace = ring_all_reduce_trace(n)
    assert all(len(s) == 2 * (n - 1) for s in schedules)
    for step in range(2 * (n - 1)):
        moves = [schedules[r][step] for r in range(n)]
        payloads = [held[r][m.send_chunk] for r, m in enumerate(moves)]
        for r, move in enumerate(moves):
            left = (r - 1) % n
            assert move.recv_chunk == moves[left].send_chunk  # what arrives is what was sent
            if move.phase == "reduce-scatter":
                held[r][move.recv_chunk] = held[r][move.recv_chunk] | payloads[left]
            else:
                held[r][move.recv_chunk] = payloads[left]
        assert held == trace[step + 1].contributions
    everyone = frozenset(range(n))
    assert all(cell == everyone for row in held for cell in row)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_after_reduce_scatter_rank_r_owns_chunk_r_plus_1(n):
    for r in range(n):
        schedule = ring_schedule(r, n)
        last_reduce = schedule[n - 2]
        assert last_reduce.phase == "reduce-scatter"
        assert last_reduce.recv_chunk == (r + 1) % n
        assert schedule[n - 1] == RingTransfer("all-gather", 1, (r + 1) % n, r)


def test_one_rank_has_nothing_to_do():
    assert ring_schedule(0, 1) == []


def test_bad_schedule_arguments_are_named():
    with pytest.raises(ValueError, match="rank must be between 0 and ranks - 1 = 3"):
        ring_schedule(4, 4)
    with pytest.raises(ValueError, match="ranks"):
        ring_schedule(0, 0)
    with pytest.raises(ValueError, match="rank"):
        ring_schedule(-1, 4)


def test_ring_input_is_distinct_per_rank_and_reproducible():
    assert wc.ring_input(0, 4).tolist() == [1, 2, 3, 4]
    assert wc.ring_input(2, 3).tolist() == [49, 52, 55]
    assert torch.equal(wc.ring_input(1, 5, torch.float32), wc.ring_input(1, 5, torch.float32))
    assert not torch.equal(wc.ring_input(1, 5, torch.float32), wc.ring_input(2, 5, torch.float32))
    assert wc.ring_input(3, 0).numel() == 0
    with pytest.raises(ValueError, match="length"):
        wc.ring_input(0, -1)


def test_ring_all_reduce_rejects_a_matrix_before_any_communication():
    with pytest.raises(ValueError, match="tensor must be a 1-D"):
        wc.ring_all_reduce(torch.zeros(2, 2))


def test_loopback_ratio_is_the_median_of_the_trials():
    measured = {"active": [1100, 1030, 5000], "idle": [100, 0, 0], "expected": 1000.0}
    assert wc.loopback_ratio(measured) == pytest.approx(1.03)
    two = {"active": [1000, 1100], "idle": [0, 0], "expected": 1000}
    assert wc.loopback_ratio(two) == pytest.approx(1.05)
    with pytest.raises(ValueError, match="expected"):
        wc.loopback_ratio({"active": [1], "idle": [0], "expected": 0})
    with pytest.raises(ValueError, match="one count per trial"):
        wc.loopback_ratio({"active": [1, 2], "idle": [0], "expected": 1})


def test_bandwidth_sizes_run_from_4_kib_to_16_mib():
    assert wc.BANDWIDTH_SIZES[0] == 4 * 2**10
    assert wc.BANDWIDTH_SIZES[-1] == 16 * 2**20


# --- real processes: one run of the chapter's worker, one of the torchrun entry ----------


@pytest.fixture(scope="module")
def four_ranks():
    before = _children()
    results = run_ranks(wc.worker, 4, wc.RING_LENGTHS, (4096, 2**20), 16 * 2**20, timeout=300)
    time.sleep(0.2)
    assert _children() <= before, "processes left behind"
    return results


def test_four_collectives_give_the_textbook_results(four_ranks):
    shown = [r["collectives"] for r in four_ranks]
    for rank, got in enumerate(shown):
        mine = [10 * rank + k for k in range(4)]
        assert got["all-reduce"] == {"input": mine, "output": [60, 64, 68, 72]}
        assert got["reduce-scatter"] == {"input": mine, "output": [60 + 4 * rank]}
        assert got["all-gather"] == {"input": [60 + 4 * rank], "output": [60, 64, 68, 72]}
        assert got["broadcast"] == {"input": mine, "output": [0, 1, 2, 3]}


def test_send_recv_ring_equals_all_reduce_and_the_simulation(four_ranks):
    for index, length in enumerate(wc.RING_LENGTHS):
        simulated, sent = ring_all_reduce([wc.ring_input(r, length) for r in range(4)])
        for rank in range(4):
            check = four_ranks[rank]["ring"][index]
            assert check["length"] == length
            assert check["equal"], f"length {length}: ring != dist.all_reduce on rank {rank}"
            assert torch.equal(check["result"], simulated[rank])
            assert check["sent"] == sent[rank]
            assert check["float_gap"] < 1e-4
    assert [four_ranks[r]["ring"][-1]["sent"] for r in range(4)] == [1500] * 4  # 2(N-1)/N x 1000


def test_bandwidth_times_are_positive_and_shared(four_ranks):
    times = [r["bandwidth"] for r in four_ranks]
    assert all(len(t) == 2 and all(s > 0 for s in t) for t in times)
    assert times[0] == times[1] == times[2] == times[3]  # the slowest rank's time, everywhere


def test_loopback_bytes_match_the_ring(four_ranks):
    measured = four_ranks[0]["loopback"]
    assert all(r["loopback"] is None for r in four_ranks[1:])
    if measured is None:
        assert not wc.LOOPBACK_TX.exists()
        pytest.skip("no /sys/class/net/lo on this machine")
    assert measured["expected"] == ring_bytes_per_rank(16 * 2**20, 4) * 4 * 2
    assert abs(wc.loopback_ratio(measured) - 1) < 0.1


def test_torchrun_entry_reports_on_rank_0(capsys):
    run_ranks(wc.main, 2, timeout=300)
    lines = capsys.readouterr().out.splitlines()
    assert all(line.startswith("[rank 0]") for line in lines)
    assert "[rank 0] all-reduce      rank 0: [0, 1] -> [10, 12]" in lines
    ring = [line for line in lines if "ring, length" in line]
    assert len(ring) == len(wc.RING_LENGTHS)
    assert all("equals dist.all_reduce True" in line for line in ring)
    assert sum(line.count("(measured)") for line in lines) == 2 * len(wc.BANDWIDTH_SIZES)
