"""workers.collectives, beyond what notebook 04 checks when it runs the worker on 4 real
ranks (the four collectives, the send/recv ring against dist.all_reduce and the simulation,
the loopback byte count): the ring's schedule, the inputs, the helpers, the bad arguments
and the torchrun entry's report."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from trainscale.collectives import RingTransfer, ring_all_reduce_trace, ring_schedule
from trainscale.workers import collectives as wc

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


# --- the torchrun entry's report (in this process; notebook 04 runs the worker itself) -----


def _chapter_04_results() -> dict:
    """What :func:`wc.worker` could return on rank 0 of 4, made up: an all-reduce of
    ``size`` bytes takes ``size`` ns, an algbw of exactly 1 GB/s."""
    return {
        "collectives": {
            "all-reduce": {"input": [0, 1, 2, 3], "output": [60, 64, 68, 72]},
            "broadcast": {"input": [0, 1, 2, 3], "output": [0, 1, 2, 3]},
        },
        "ring": [{"length": 7, "equal": True, "sent": 10, "result": None, "float_gap": 0.0}],
        "bandwidth": [size / 1e9 for size in wc.BANDWIDTH_SIZES],
        "loopback": None,
    }


def test_torchrun_entry_reports_on_rank_0_only(monkeypatch, capsys):
    monkeypatch.setattr(wc, "worker", lambda rank, world_size: _chapter_04_results())
    wc.main(3, 4)
    assert capsys.readouterr().out == ""
    wc.main(0, 4)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        "all-reduce      rank 0: [0, 1, 2, 3] -> [60, 64, 68, 72]",
        "broadcast       rank 0: [0, 1, 2, 3] -> [0, 1, 2, 3]",
        "ring, length    7: equals dist.all_reduce True, rank 0 sent 10 elements",
    ]
    # algbw 1 GB/s; busbw = algbw x 2(N-1)/N = 1.5 GB/s on 4 ranks
    assert lines[3] == "     4,096 bytes: algbw 1.000 GB/s (measured), busbw 1.500 GB/s (measured)"
    assert lines[-1].startswith("16,777,216 bytes: algbw 1.000 GB/s")
    assert len(lines) == 3 + len(wc.BANDWIDTH_SIZES)


# --- the "write it yourself" exercise: the reader's ring on real ranks ---------------------


def _reference_ring(tensor):
    # A ring as a reader writes it: 2(N-1) steps, each one chunk sent right, one received.
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    total = tensor.clone()
    chunks = torch.tensor_split(total, n)
    for step in range(2 * (n - 1)):
        send, recv = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[recv])
        for request in (dist.isend(chunks[send], right), dist.irecv(incoming, left)):
            request.wait()
        if step < n - 1:
            chunks[recv].add_(incoming)
        else:
            chunks[recv].copy_(incoming)
    return total


def _through_rank_0(tensor):
    # Right sum, wrong algorithm: rank 0 receives every tensor and sends the sum back.
    rank, n = dist.get_rank(), dist.get_world_size()
    total = tensor.clone()
    if rank == 0:
        for peer in range(1, n):
            incoming = torch.empty_like(tensor)
            dist.recv(incoming, peer)
            total += incoming
        for peer in range(1, n):
            dist.send(total, peer)
    else:
        dist.send(tensor, 0)
        dist.recv(total, 0)
    return total


def _adds_in_the_all_gather(tensor):
    # The classic slip: the all-gather adds what it receives instead of replacing.
    rank, n = dist.get_rank(), dist.get_world_size()
    total = tensor.clone()
    chunks = torch.tensor_split(total, n)
    for step in range(2 * (n - 1)):
        send, recv = (rank - step) % n, (rank - step - 1) % n
        incoming = torch.empty_like(chunks[recv])
        right, left = (rank + 1) % n, (rank - 1) % n
        for request in (dist.isend(chunks[send], right), dist.irecv(incoming, left)):
            request.wait()
        chunks[recv].add_(incoming)
    return total


def _receives_before_sending(tensor):
    # Every rank waits to receive before it sends: nobody ever sends.
    rank, n = dist.get_rank(), dist.get_world_size()
    incoming = torch.empty_like(tensor)
    dist.recv(incoming, (rank - 1) % n)
    dist.send(tensor, (rank + 1) % n)
    return tensor + incoming


def _calls_all_reduce(tensor):
    total = tensor.clone()
    dist.all_reduce(total)
    return total


@pytest.mark.slow
def test_a_correct_ring_passes_every_check():
    report = wc.check_ring_exercise(_reference_ring)
    assert report.passed, str(report)
    # 1,000 int64 values = 8,000 bytes; 2(4-1)/4 of them = 12,000 bytes from each rank.
    assert "each rank sent 12,000 bytes = 2(4-1)/4 of the tensor" in str(report)
    assert str(report).endswith("passed")


@pytest.mark.slow
def test_a_right_sum_through_rank_0_fails_on_the_bytes():
    report = wc.check_ring_exercise(_through_rank_0)
    assert not report.passed
    text = str(report)
    assert "every rank holds the sum" in text  # the sum itself is right
    # Rank 0 sends the 8,000-byte sum to 3 peers; the others send their tensor once.
    assert "the ranks sent [24000, 8000, 8000, 8000] bytes" in text
    assert "12,000 bytes" in text


@pytest.mark.slow
def test_adding_in_the_all_gather_fails_on_the_sum_and_says_why():
    report = wc.check_ring_exercise(_adds_in_the_all_gather, lengths=(4,))
    assert not report.passed
    assert "hold a wrong sum" in str(report)
    assert "in the all-gather it replaces its chunk" in str(report)


@pytest.mark.slow
def test_a_collective_is_refused_with_a_message():
    report = wc.check_ring_exercise(_calls_all_reduce, lengths=(4,))
    assert not report.passed
    assert "your ring called dist.all_reduce" in str(report)


@pytest.mark.slow
def test_a_deadlock_ends_at_the_timeout_with_a_hint():
    report = wc.check_ring_exercise(_receives_before_sending, lengths=(4,), timeout=3)
    assert not report.passed
    assert "did not finish within 3 s: a rank is waiting for a message" in str(report)


def test_exercise_arguments_are_checked_before_any_process_starts():
    with pytest.raises(ValueError, match="ranks"):
        wc.check_ring_exercise(_reference_ring, ranks=1)
    with pytest.raises(ValueError, match="length"):
        wc.check_ring_exercise(_reference_ring, lengths=(3,))  # shorter than the ring
    with pytest.raises(ValueError, match="function"):
        wc.check_ring_exercise(print)
