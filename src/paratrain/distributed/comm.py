"""Collectives that never hard-code a device.

The tensor's device follows the process group's backend: CPU for gloo, the current CUDA
device for nccl. Every helper is a no-op (or the identity) without a process group, so
the same code runs on one process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from paratrain.errors import AgreedUserError, UserError

T = TypeVar("T")


def is_dist() -> bool:
    """Whether a process group is up (collectives then talk to the other ranks)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank, 0 without a process group."""
    return dist.get_rank() if is_dist() else 0


def world_size() -> int:
    """The number of ranks, 1 without a process group."""
    return dist.get_world_size() if is_dist() else 1


def is_main() -> bool:
    """Rank 0: the one that speaks and writes."""
    return rank() == 0


def comm_device() -> torch.device:
    """The device collectives on the default group must use."""
    if is_dist() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over all ranks; returns a new tensor on the input's device."""
    if not is_dist():
        return tensor.clone()
    buffer = tensor.detach().to(comm_device(), copy=True)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    return buffer.to(tensor.device)


def all_reduce_max(value: int) -> int:
    """The largest of every rank's ``value``."""
    if not is_dist():
        return value
    buffer = torch.tensor([value], dtype=torch.int64, device=comm_device())
    dist.all_reduce(buffer, op=dist.ReduceOp.MAX)
    return int(buffer.item())


def broadcast_object(obj: T, src: int = 0) -> T:
    """Send a picklable object from rank ``src`` to every rank."""
    if not is_dist():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, device=comm_device())
    return holder[0]


def agree(decide: Callable[[], T]) -> T:
    """``decide()`` on rank 0, and its value, or its UserError, on every rank: for a
    decision rank 0 makes alone (a run directory, a cache plan) whose failure must not
    leave the other ranks waiting in the next collective. The error is told once."""
    outcome: tuple[str, Any] | None = None
    if is_main():
        try:
            outcome = ("value", decide())
        except UserError as exc:
            outcome = ("error", (str(exc), exc.exit_code))
    agreed = broadcast_object(outcome)
    assert agreed is not None  # rank 0 always decides
    kind, payload = agreed
    if kind == "error":
        error = AgreedUserError(payload[0])
        error.exit_code = payload[1]
        raise error
    return payload


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled: for small things)."""
    if not is_dist():
        return [obj]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier() -> None:
    """Wait for every rank (on NCCL, on this rank's own device)."""
    if is_dist():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()
