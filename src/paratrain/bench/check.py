"""`paratrain check`: a self-test for a new machine or cluster.

Every rank runs the same checks; results are all-reduced so that every rank agrees on
pass or fail, and rank 0 prints one table. Known values make the collectives checkable:
all_reduce of rank+1 must give W(W+1)/2, broadcast must deliver rank 0's tensor,
all_gather must return every rank's id in order.
"""

from __future__ import annotations

import socket
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import CheckOptions
from paratrain.distributed import comm
from paratrain.distributed.env import DistEnv
from paratrain.distributed.runtime import Runtime
from paratrain.parallel.sync_batchnorm import SyncBatchNorm

BANDWIDTH_SIZES_MB = (1, 16, 64)


@dataclass
class Row:
    name: str
    ok: bool
    detail: str


def run_checks(
    runtime: Runtime, bandwidth_sizes_mb: tuple[int, ...] = BANDWIDTH_SIZES_MB
) -> list[Row]:
    """Every check on every rank; a check failed anywhere is failed everywhere, so every rank's verdict agrees."""
    rows = [_backends(runtime), _placement(runtime)]
    rows += [_all_reduce(runtime), _broadcast(runtime), _all_gather(runtime), _sync_bn(runtime)]
    rows += [_bandwidth(runtime, size) for size in bandwidth_sizes_mb]
    # every rank must agree on every verdict, so a failure anywhere fails everywhere
    verdicts = comm.all_reduce_sum(torch.tensor([0 if r.ok else 1 for r in rows]))
    for row, failures in zip(rows, verdicts.tolist(), strict=True):
        if failures and row.ok:
            row.ok, row.detail = False, f"{row.detail} (failed on {failures} rank(s))"
    return rows


def format_table(rows: list[Row]) -> str:
    """The table `paratrain check` prints: one row per check, ok or FAIL, and what was measured."""
    width = max(len(r.name) for r in rows)
    lines = [f"{'check'.ljust(width)}  result  detail", "-" * (width + 40)]
    lines += [f"{r.name.ljust(width)}  {'ok' if r.ok else 'FAIL':6}  {r.detail}" for r in rows]
    return "\n".join(lines)


def _backends(runtime: Runtime) -> Row:
    have = [
        name
        for name, ok in (
            ("gloo", dist.is_gloo_available()),
            ("nccl", dist.is_nccl_available()),
            ("mpi", dist.is_mpi_available()),
        )
        if ok
    ]
    cuda = f"cuda x{torch.cuda.device_count()}" if torch.cuda.is_available() else "no cuda"
    return Row(
        "backends",
        bool(have),
        f"available: {', '.join(have) or 'none'}; {cuda}; using {runtime.backend}",
    )


def _placement(runtime: Runtime) -> Row:
    seen = comm.all_gather_object((runtime.rank, socket.gethostname(), str(runtime.device)))
    ranks_ok = [r for r, _, _ in seen] == list(range(runtime.world_size))
    hosts = sorted({h for _, h, _ in seen})
    detail = "; ".join(f"rank {r}: {h} {d}" for r, h, d in seen[:8])
    more = f" ... ({len(seen)} ranks on {len(hosts)} host(s))" if len(seen) > 8 else ""
    return Row("rank placement", ranks_ok, detail + more)


def _all_reduce(runtime: Runtime) -> Row:
    value = comm.all_reduce_sum(torch.full((1024,), float(runtime.rank + 1)))
    expected = runtime.world_size * (runtime.world_size + 1) / 2
    ok = bool(torch.all(value == expected))
    return Row("all_reduce", ok, f"sum of rank+1 = {value[0].item():g}, expected {expected:g}")


def _broadcast(runtime: Runtime) -> Row:
    reference = torch.arange(1000, dtype=torch.float32)
    tensor = reference.clone() if runtime.rank == 0 else torch.zeros(1000)
    buffer = tensor.to(comm.comm_device())
    dist.broadcast(buffer, src=0)
    ok = torch.equal(buffer.cpu(), reference)
    return Row("broadcast", ok, "rank 0's arange(1000) received" if ok else "wrong data received")


def _all_gather(runtime: Runtime) -> Row:
    mine = torch.tensor([float(runtime.rank)], device=comm.comm_device())
    out = [torch.zeros_like(mine) for _ in range(runtime.world_size)]
    dist.all_gather(out, mine)
    got = [int(t.item()) for t in out]
    return Row("all_gather", got == list(range(runtime.world_size)), f"gathered ranks {got[:16]}")


def _sync_bn(runtime: Runtime) -> Row:
    """A small conv+BN model: the global batch split across ranks vs. one BatchNorm."""
    torch.manual_seed(0)
    per_rank = 3
    x = torch.randn(per_rank * runtime.world_size, 3, 8, 8) * 2 + 0.5
    conv = nn.Conv2d(3, 6, 3)
    model = nn.Sequential(conv, nn.BatchNorm2d(6), nn.ReLU())
    reference = model(x)
    reference.square().sum().backward()
    assert conv.weight.grad is not None
    ref_grad = conv.weight.grad.clone()
    model.zero_grad()
    synced = SyncBatchNorm.convert(model).to(runtime.device)
    local = x[runtime.rank * per_rank : (runtime.rank + 1) * per_rank].to(runtime.device)
    out = synced(local)
    out.square().sum().backward()
    assert conv.weight.grad is not None  # the same conv: conversion replaces BatchNorm only
    grad = comm.all_reduce_sum(conv.weight.grad.detach().cpu())
    out_err = (
        (out.detach().cpu() - reference[runtime.rank * per_rank : (runtime.rank + 1) * per_rank])
        .abs()
        .max()
    )
    grad_err = ((grad - ref_grad).abs().max() / ref_grad.abs().max()).item()
    ok = out_err.item() < 1e-4 and grad_err < 1e-4
    return Row(
        "SyncBatchNorm", ok, f"max output error {out_err.item():.1e}, grad error {grad_err:.1e}"
    )


def _bandwidth(runtime: Runtime, size_mb: int) -> Row:
    from paratrain.bench.collectives import time_all_reduce

    nbytes = size_mb * 2**20
    seconds = statistics.median(time_all_reduce(nbytes, repeats=5 if size_mb <= 16 else 3))
    n = runtime.world_size
    algorithm = nbytes / seconds / 1e9
    bus = algorithm * 2 * (n - 1) / n  # what each link carries in a ring all-reduce
    return Row(
        f"all_reduce {size_mb} MB",
        True,
        f"{seconds * 1e3:.2f} ms, algorithm {algorithm:.2f} GB/s, bus {bus:.2f} GB/s",
    )


def check_worker(opts: CheckOptions, env: DistEnv, say: Callable[[str], object]) -> int:
    """This process's share of `paratrain check`; 0 when every check passed."""
    from paratrain.distributed.runtime import distributed

    with distributed(env, opts.device, opts.backend, opts.timeout) as runtime:
        if not runtime.backend:  # one process still exercises the collectives
            return _alone(runtime, opts.timeout, say)
        rows = run_checks(runtime)
    if env.is_main:
        say(format_table(rows))
    return 0 if all(r.ok for r in rows) else 1


def _alone(runtime: Runtime, timeout_s: float, say: Callable[[str], object]) -> int:
    """One process: a process group of one on an in-memory store, so the collectives
    still run."""
    import datetime

    from paratrain.distributed.runtime import choose_backend

    backend = choose_backend(runtime.device)
    dist.init_process_group(
        backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        rows = run_checks(Runtime(env=runtime.env, device=runtime.device, backend=backend))
    finally:
        dist.destroy_process_group()
    say(format_table(rows))
    return 0 if all(r.ok for r in rows) else 1
