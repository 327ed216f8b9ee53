"""The launcher: real gloo processes, clear failures, nothing left behind, loopback only."""

import ipaddress
import os
import re
import socket
import sys
import time

import psutil
import pytest
import rank_workers
import torch
import torch.distributed as dist
from own_processes import own_children

from trainscale import train
from trainscale.distributed import (
    LOOPBACK,
    RankError,
    _loopback_store,
    join_job,
    run_alone,
    run_nodes,
    run_ranks,
    torchrun_command,
    torchrun_main,
)

pytestmark = pytest.mark.slow  # every test here starts real processes


@pytest.fixture(autouse=True)
def no_leftover_processes():
    """Every test must end with exactly the child processes it started with."""
    before = own_children()
    yield
    time.sleep(0.2)
    after = own_children()
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
    # Rank 1 sleeps for an hour and rank 0 waits for it in a barrier: whether or not
    # both have started by then, the run cannot finish within the timeout.
    with pytest.raises(RankError, match="did not finish within 3 s"):
        run_ranks(rank_workers.hang_on, 2, 1, timeout=3)


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


# --- joining a job that torchrun started --------------------------------------------------


@pytest.fixture
def torchrun_environment(monkeypatch):
    """What torchrun tells rank 0 of a one-process job on this machine, with its own store
    (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``); returns the store's port."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port = probe.getsockname()[1]
    environment = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(port)}
    for key, value in {**environment, "MASTER_ADDR": LOOPBACK}.items():
        monkeypatch.setenv(key, value)
    for key in ("GLOO_SOCKET_IFNAME", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(key, raising=False)
    return port


def _listening_addresses(port: int) -> list[str]:
    return [
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]


def test_joining_a_torchrun_job_on_this_machine_stays_on_loopback(torchrun_environment):
    assert join_job() == (0, 1)
    try:
        assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
        listeners = _listening_addresses(torchrun_environment)
        assert listeners and all(ip == LOOPBACK for ip in listeners), listeners
        assert dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()


def test_torchrun_main_runs_the_worker_and_leaves_the_group(torchrun_environment, capsys):
    assert torchrun_main(rank_workers.sum_ranks, 10) == 0
    assert capsys.readouterr().out == "hello from rank 0 of 1\n"
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="rank 0 was told to fail"):
        torchrun_main(rank_workers.raise_on, 0)
    assert not dist.is_initialized()  # left even when the worker raised


def test_run_alone_is_a_job_of_one_in_this_process(monkeypatch, capsys):
    for key in ("RANK", "WORLD_SIZE", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(key, raising=False)
    assert run_alone(rank_workers.sum_ranks, 10) == 0  # 10 x (rank 0)
    assert capsys.readouterr().out == "hello from rank 0 of 1\n"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="rank 0 was told to fail"):
        run_alone(rank_workers.raise_on, 0)
    assert not dist.is_initialized()  # left even when the worker raised


def test_ranks_end_when_the_process_that_started_them_is_killed(tmp_path):
    """Kill -9 the launching process mid-run: its fork server and every rank go too."""
    ready = tmp_path / "ready"
    ready.mkdir()
    script = tmp_path / "launch.py"
    script.write_text(
        "import rank_workers\n"
        "from trainscale.distributed import run_ranks\n"
        "if __name__ == '__main__':\n"
        f"    run_ranks(rank_workers.hang_after_touching, 2, {str(ready)!r}, timeout=600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    launcher = psutil.Popen([sys.executable, str(script)], env=env)
    try:
        for _ in range(1200):  # wait (up to two minutes) until both ranks are running
            if len(list(ready.iterdir())) == 2 or launcher.poll() is not None:
                break
            time.sleep(0.1)
        assert sorted(p.name for p in ready.iterdir()) == ["0", "1"], "the ranks never ran"
        descendants = launcher.children(recursive=True)
        launcher.kill()
        launcher.wait(30)
        _, alive = psutil.wait_procs(descendants, timeout=30)
        assert alive == [], f"left behind after the launcher died: {alive}"
    finally:
        if launcher.is_running():
            launcher.kill()


# --- torchrun jobs: one node, two nodes, a node lost and replaced ---------------------------


def test_each_agent_only_connects_to_the_launchers_store_and_names_loopback():
    command = torchrun_command("m", ["--x"], 2, 4, 1, 29999)
    assert "--rdzv-endpoint=127.0.0.1:29999" in command
    assert "--local-addr=127.0.0.1" in command
    assert any(a.startswith("--rdzv-conf=is_host=false") for a in command)
    assert command[-3:] == ["-m", "m", "--x"]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"nnodes": 0}, "nnodes"),
        ({"nproc_per_node": 0}, "nproc_per_node"),
        ({"timeout": 0}, "timeout"),
    ],
)
def test_bad_job_shapes_are_named_before_anything_starts(kwargs, name):
    with pytest.raises(ValueError, match=name):
        run_nodes("trainscale.train", [], **kwargs)


def _only_loopback(listeners: tuple[tuple[str, int], ...]) -> bool:
    """Whether every address is a loopback one: 127.0.0.1, or ::1 where torchrun's brief
    free-port probe (``get_free_port``, on "localhost") resolves to IPv6 first."""
    return all(ipaddress.ip_address(ip).is_loopback for ip, _ in listeners)


# Two "nodes" of two ranks each train the capstone with FSDP over all four; once the
# checkpoint of step 4 is complete, every process of the second node is SIGKILLed and a
# new node is started in its place. 11 Python processes import torch (8 of them also the
# capstone's DTensor and checkpoint modules, ~4.5 CPU-s each). Four ranks per node work
# the same way (checked: 19 processes, 64 s on a shared 2-core machine); two keep
# `make test` inside its 10-minute budget.
TWO_NODE_FLAGS = [
    *("--parallel", "fsdp", "--steps", "12", "--warmup", "2", "--micro-batch", "1"),
    *("--log-every", "4", "--ckpt-every", "4"),
]


def test_two_nodes_survive_losing_one_and_stay_on_loopback(tmp_path):
    weights = {name: tmp_path / f"{name}.pt" for name in ("straight", "two_nodes")}
    straight = [*TWO_NODE_FLAGS, "--final-weights", str(weights["straight"])]
    run_ranks(train.worker, 4, straight, timeout=300)
    checkpoints = ["--ckpt-dir", str(tmp_path / "ckpt")]
    job = run_nodes(
        "trainscale.train",
        [*TWO_NODE_FLAGS, *checkpoints, "--final-weights", str(weights["two_nodes"])],
        nnodes=2,
        nproc_per_node=2,
        max_restarts=1,
        fail_node_after="saved checkpoint step_00000004",
        timeout=300,
    )
    assert job.replaced_nodes == 1
    assert job.processes == 3 + 8  # agents: two, then the replacement; ranks: 4 + 4
    resumed = re.findall(r"attempt \d+: resumed from step (\d+)", job.output)
    assert len(resumed) == 1 and 4 <= int(resumed[0]) < 12, job.output
    assert "finished at step 12" in job.output
    assert (LOOPBACK, job.rendezvous_port) in job.listeners
    assert len(job.listeners) > 4, job.listeners  # stores and every rank's gloo listener
    assert _only_loopback(job.listeners), job.listeners
    straight_weights, two_node_weights = (torch.load(weights[n]) for n in weights)
    assert straight_weights.keys() == two_node_weights.keys()
    assert all(torch.equal(straight_weights[k], two_node_weights[k]) for k in straight_weights)


def test_each_node_of_a_multi_node_job_uses_its_own_gpus(monkeypatch):
    """On 8 nodes of 8 GPUs (WORLD_SIZE 64, LOCAL_WORLD_SIZE 8), local rank 3 of any node
    takes GPU 3 with NCCL; a node with fewer GPUs than ranks falls back to gloo on the CPU."""
    from trainscale.distributed import backend_and_device

    monkeypatch.setenv("WORLD_SIZE", "64")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert backend_and_device(3) == ("nccl", torch.device("cuda", 3))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert backend_and_device(3) == ("gloo", torch.device("cpu"))
