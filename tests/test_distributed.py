"""The launcher: real gloo processes, clear failures, nothing left behind, loopback only."""

import time

import psutil
import pytest
import rank_workers
import torch.distributed as dist

from trainscale.distributed import RankError, _loopback_store, run_ranks


def _children() -> set[int]:
    """Live child processes, except multiprocessing's resource tracker: spawn starts
    that helper once per parent and it exits with the parent, so it is no orphan."""
    return {
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.is_running() and "resource_tracker" not in " ".join(p.cmdline())
    }


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Every test must end with exactly the child processes it started with."""
    before = _children()
    yield
    time.sleep(0.2)
    after = _children()
    assert after <= before, f"processes left behind: {after - before}"


def test_results_and_output_come_back_in_rank_order(capsys):
    assert run_ranks(rank_workers.sum_ranks, 4, 10) == [60, 60, 60, 60]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"[rank {r}] hello from rank {r} of 4" for r in range(4)]


def test_one_rank_works():
    assert run_ranks(rank_workers.sum_ranks, 1, 10) == [0]


def test_a_raising_rank_is_named_with_its_traceback():
    with pytest.raises(RankError, match=r"rank 2 failed[\s\S]*rank 2 was told to fail"):
        run_ranks(rank_workers.raise_on, 4, 2, timeout=30)


def test_an_exiting_rank_is_named():
    with pytest.raises(RankError, match=r"rank 1 failed \(exit code 7\)"):
        run_ranks(rank_workers.exit_on, 3, 1, timeout=30)


def test_a_hanging_rank_times_out():
    start = time.monotonic()
    with pytest.raises(RankError, match="did not finish within 8 s"):
        run_ranks(rank_workers.hang_on, 2, 1, timeout=8)
    assert time.monotonic() - start < 8 + 10


def _is_loopback(address: str) -> bool:
    family, hex_address = address.split(":")[:2]
    if family == "AF_INET":
        return hex_address == "0100007F"  # 127.0.0.1, little-endian
    return hex_address == "00000000000000000000000001000000"  # ::1


def test_ranks_listen_on_loopback_only():
    addresses = run_ranks(rank_workers.listening_sockets, 2)
    assert all(addresses), "each rank should listen for its gloo peers"
    assert all(_is_loopback(a) for per_rank in addresses for a in per_rank), addresses


def test_rendezvous_store_listens_on_loopback_only():
    store, port = _loopback_store(1, 10)
    listeners = [
        c.laddr
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    del store
    assert listeners and all(ip == "127.0.0.1" for ip, _ in listeners), listeners


def test_workers_must_be_importable():
    def local_worker(rank, world_size):
        return rank

    with pytest.raises(ValueError, match="worker"):
        run_ranks(local_worker, 2)
    with pytest.raises(ValueError, match="world_size"):
        run_ranks(rank_workers.sum_ranks, 0, 1)
    assert not dist.is_initialized()
