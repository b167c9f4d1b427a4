"""Decisions shared by every Ray Train worker (rank) of a DDP run.

Anything that ends or changes the training loop must be the same on every rank, or one rank
leaves a collective the others still wait in and the run hangs with no error: whether there is
a next step (a rank's data may run out first), the epoch's loss (the warm-up's plateau test
reads it), the held-out rSum (only rank 0 holds the validation split; patience reads it) and
the resulting stop/select state. Each helper is a no-op in a single-process run.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["all_have", "from_rank0", "is_distributed", "sum_across"]


def is_distributed() -> bool:
    """True inside a process group of more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _collective_device(device: torch.device) -> torch.device:
    # NCCL only moves CUDA tensors; gloo (CPU workers) only CPU ones.
    return device if device.type == "cuda" else torch.device("cpu")


def all_have(has: bool, device: torch.device) -> bool:
    """True when every rank has `has` (e.g. a next batch): all ranks then take the same number
    of optimizer steps, whatever their shards held."""
    if not is_distributed():
        return has
    import torch.distributed as dist

    flag = torch.tensor([1 if has else 0], dtype=torch.int32, device=_collective_device(device))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def sum_across(values: list[float], device: torch.device) -> list[float]:
    """`values` summed over the ranks (float64), the same list on every rank."""
    if not is_distributed():
        return list(values)
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device(device))
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return [float(x) for x in tensor.cpu()]


def from_rank0(value: Any, device: torch.device) -> Any:
    """Rank 0's `value` (any picklable object) on every rank."""
    if not is_distributed():
        return value
    import torch.distributed as dist

    box = [value]
    kwargs = {"device": device} if device.type == "cuda" else {}
    dist.broadcast_object_list(box, src=0, **kwargs)
    return box[0]
