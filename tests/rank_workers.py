"""Workers that misbehave on purpose, for the launcher's failure tests."""

import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist


def sum_ranks(rank: int, world_size: int, scale: int) -> int:
    """All-reduce the rank numbers; every rank returns the same total."""
    value = torch.tensor([rank * scale])
    dist.all_reduce(value)
    print(f"hello from rank {rank} of {world_size}")
    return int(value)


def raise_on(rank: int, world_size: int, bad: int) -> int:
    if rank == bad:
        raise ValueError(f"rank {rank} was told to fail")
    dist.barrier()
    return rank


def exit_on(rank: int, world_size: int, bad: int) -> int:
    if rank == bad:
        os._exit(7)
    dist.barrier()
    return rank


def hang_on(rank: int, world_size: int, bad: int) -> int:
    if rank == bad:
        time.sleep(3600)
    dist.barrier()
    return rank


def listening_sockets(rank: int, world_size: int) -> list[str]:
    """Local addresses of this process's listening TCP sockets (from /proc)."""
    dist.barrier()
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A = LISTEN
                    addresses.append(f"{family.name}:{fields[1]}")
    dist.barrier()
    return addresses


def hang_after_touching(rank: int, world_size: int, folder: str) -> int:
    """Say "running" by creating ``folder/<rank>``, then hang until killed."""
    (Path(folder) / str(rank)).touch()
    time.sleep(3600)
    return rank
