"""The torch process group of a local multi-worker round, on loopback only.

Contract: when rank 0's Ray node address is a loopback address (the embedded local Ray, which
binds 127.0.0.1), `setup_loopback_process_group` builds the group from a `TCPStore` that
listens on a socket this module bound to 127.0.0.1, and points gloo (and NCCL's bootstrap) at
the loopback interface, unless the user set them. torch's own env:// rendezvous, which Ray
Train uses, binds its store to all interfaces (`::`) whatever MASTER_ADDR says. On a cluster
(a routable node address) it returns False and Ray Train's torch backend sets the group up.
These functions run in the Ray Train workers (torch is imported there anyway).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

__all__ = ["bind_loopback_store", "join_loopback_group", "setup_loopback_process_group"]

LOOPBACK_IFNAME = "lo"  # Linux's loopback interface
_LISTENING: dict[str, int] = {}  # rank 0's bound socket, between the two calls


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bind_loopback_store() -> int | None:
    """Rank 0: bind the store's socket to 127.0.0.1 when this node is a loopback one.

    Returns:
        The port, or None on a routable node (the caller then uses Ray Train's backend).
    """
    import ray

    if not _is_loopback(ray.util.get_node_ip_address()):
        return None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    _LISTENING["fd"] = sock.detach()  # the store takes the socket over
    return port


def join_loopback_group(
    world_rank: int, world_size: int, port: int, backend: str, timeout_s: float
) -> None:
    """Every rank: the store (rank 0 serves it on the bound socket) and the process group."""
    import torch.distributed as dist

    rank = world_rank
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)
    # What torch's env:// rendezvous would have set (one node: local rank = rank).
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
    )
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1",
            port,
            world_size,
            True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=_LISTENING.pop("fd"),
        )
    else:
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def setup_loopback_process_group(worker_group, backend_config) -> bool:
    """Driver side (a Ray Train backend's on_start): the group on loopback, if local.

    Returns:
        False when rank 0's node is routable: nothing was done.
    """
    import ray

    port = worker_group.execute_single(0, bind_loopback_store)
    if port is None:
        return False
    backend = backend_config.backend
    if backend is None:  # as Ray Train's torch backend chooses
        gpus = worker_group.get_resources_per_worker().get("GPU", 0)
        backend = "nccl" if gpus > 0 else "gloo"
    size = len(worker_group)
    ray.get(
        [
            worker_group.execute_single_async(
                rank,
                join_loopback_group,
                world_rank=rank,
                world_size=size,
                port=port,
                backend=backend,
                timeout_s=backend_config.timeout_s,
            )
            for rank in range(size)
        ]
    )
    return True
