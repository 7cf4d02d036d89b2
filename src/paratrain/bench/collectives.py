"""All-reduce timings on the current process group: what alpha and beta are fitted on."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from paratrain.distributed import comm

SMALLEST_MESSAGE = 4 * 1024


def message_sizes(largest: int, smallest: int = SMALLEST_MESSAGE) -> list[int]:
    """4 KB, 16 KB, 64 KB, ... up to ``largest`` bytes (a factor of 4 apart)."""
    sizes, size = [], smallest
    while size <= largest:
        sizes.append(size)
        size *= 4
    return sizes


def repeats_for(nbytes: int) -> int:
    """The same on every rank (each call is a collective): many for small messages,
    whose times are short and noisy, few for large ones."""
    if nbytes <= 64 * 1024:
        return 40
    if nbytes <= 2**20:
        return 20
    return 10 if nbytes <= 16 * 2**20 else 4


def time_all_reduce(nbytes: int, repeats: int, warmup: int = 2) -> list[float]:
    """Seconds of each of ``repeats`` all-reduces of a float32 buffer of ``nbytes``."""
    buffer = torch.ones(max(nbytes // 4, 1), dtype=torch.float32, device=comm.comm_device())
    for _ in range(warmup):
        dist.all_reduce(buffer)
    comm.barrier()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(buffer)
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)
        seconds.append(time.perf_counter() - start)
    return seconds


def typical(seconds: list[float]) -> float:
    """The lower quartile: on a busy machine a few calls wait a scheduler tick (4 ms here
    on 2 shared cores), which drags a median of small messages far above the link's cost."""
    return statistics.quantiles(seconds, n=4)[0] if len(seconds) >= 4 else min(seconds)


def sweep_all_reduce(largest: int) -> list[tuple[int, int, float]] | None:
    """(ranks, bytes, seconds) per message size: the typical call on each rank, the
    slowest rank's kept (a collective ends when its last rank does). Every rank takes
    part; rank 0 gets the rows, the others None."""
    mine = [typical(time_all_reduce(size, repeats_for(size))) for size in message_sizes(largest)]
    every = comm.all_gather_object(mine)
    if not comm.is_main():
        return None
    n = comm.world_size()
    return [(n, size, max(r[i] for r in every)) for i, size in enumerate(message_sizes(largest))]
