"""Ray Train's torch config for several training workers, with a store bound to one address.

Contract: `LoopbackTorchConfig` is Ray Train's public `TorchConfig` whose backend sets the
process group up from a `TCPStore` listening on a socket this module bound to rank 0's Ray node
address only: 127.0.0.1 on the embedded local Ray (which binds loopback), the node's address on
a cluster. torch's env:// and tcp:// rendezvous (what `TorchConfig`'s own backend uses) bind
the store to every interface (`::`) whatever MASTER_ADDR says. On loopback, gloo (and NCCL's
bootstrap) are pointed at the loopback interface unless the user set them. The config's other
parts (the CUDA device each worker selects, the framework) are `TorchConfig`'s own.
The backend runs in Ray Train's controller and hands functions of this module to the workers;
the controller loads torch (`TorchConfig`'s module does) but none of the pipeline's training
code (open_clip, the loop) for it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from datetime import timedelta

from ray.train.backend import Backend
from ray.train.torch import TorchConfig

__all__ = ["LoopbackTorchConfig", "bind_store", "join_group", "leave_group"]

LOOPBACK_IFNAME = "lo"  # Linux's loopback interface
_LISTENING: dict[str, int] = {}  # rank 0's bound socket, between the two calls


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def bind_store() -> tuple[str, int]:
    """Rank 0: bind the store's socket to this node's Ray address only.

    Returns:
        (address, port) for every rank to reach the store at.
    """
    import ray

    host = ray.util.get_node_ip_address()
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen()
    port = sock.getsockname()[1]
    _LISTENING["fd"] = sock.detach()  # the store takes the socket over
    return host, port


def join_group(
    world_rank: int, world_size: int, host: str, port: int, backend: str, timeout_s: float
) -> None:
    """Every rank: the store (rank 0 serves it on the bound socket) and the process group."""
    import torch.distributed as dist

    if _is_loopback(host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)
    # What torch's env:// rendezvous would have set (one node per rank's local group).
    local = {"LOCAL_RANK": str(world_rank), "LOCAL_WORLD_SIZE": str(world_size), "NODE_RANK": "0"}
    os.environ.update(
        MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(world_rank), WORLD_SIZE=str(world_size)
    )
    for key, value in local.items():
        os.environ.setdefault(key, value)  # Ray Train sets them per node on a cluster
    timeout = timedelta(seconds=timeout_s)
    if world_rank == 0:
        store = dist.TCPStore(
            host,
            port,
            world_size,
            True,
            timeout=timeout,
            wait_for_workers=False,
            master_listen_fd=_LISTENING.pop("fd"),
        )
    else:
        store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
    dist.init_process_group(
        backend, store=store, rank=world_rank, world_size=world_size, timeout=timeout
    )


def leave_group() -> None:
    """Every rank, when the worker group shuts down."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class _LoopbackBackend(Backend):
    share_cuda_visible_devices = True  # as torch's: a worker sees its node's granted GPUs

    def on_start(self, worker_group, backend_config) -> None:
        import ray

        host, port = worker_group.execute_single(0, bind_store)
        backend = backend_config.backend
        if backend is None:  # as Ray Train's torch backend chooses
            gpus = worker_group.get_resources_per_worker().get("GPU", 0)
            backend = "nccl" if gpus > 0 else "gloo"
        size = len(worker_group)
        ray.get(
            [
                worker_group.execute_single_async(
                    rank,
                    join_group,
                    world_rank=rank,
                    world_size=size,
                    host=host,
                    port=port,
                    backend=backend,
                    timeout_s=backend_config.timeout_s,
                )
                for rank in range(size)
            ]
        )

    def on_shutdown(self, worker_group, backend_config) -> None:
        worker_group.execute(leave_group)


class LoopbackTorchConfig(TorchConfig):
    """`TorchConfig` (backend, timeout_s) with the rendezvous above."""

    @property
    def backend_cls(self):
        return _LoopbackBackend
