"""`paratrain check`: verified collectives, agreement on failure, the CLI table."""

from __future__ import annotations

import os

import pytest
import torch

from paratrain.distributed.env import detect
from paratrain.distributed.runtime import Runtime
from spawn import run_distributed

pytestmark = pytest.mark.slow


def _checks(rank, world, corrupt_broadcast_on):
    import torch.distributed as dist

    from paratrain.bench import check

    if rank == corrupt_broadcast_on:
        original = dist.broadcast

        def corrupted(tensor, src, *args, **kwargs):
            work = original(tensor, src, *args, **kwargs)
            tensor.add_(1)
            return work

        check.dist.broadcast = corrupted
    rt = Runtime(env=detect(os.environ), device=torch.device("cpu"), backend="gloo")
    return [(r.name, r.ok, r.detail) for r in check.run_checks(rt, bandwidth_sizes_mb=(1,))]


@pytest.mark.parametrize("world", [2, 3])
def test_every_check_passes_on_a_healthy_group(world):
    for rows in run_distributed(_checks, world, None):
        names = [name for name, _, _ in rows]
        assert names == [
            "backends",
            "rank placement",
            "all_reduce",
            "broadcast",
            "all_gather",
            "SyncBatchNorm",
            "all_reduce 1 MB",
        ]
        assert all(ok for _, ok, _ in rows), rows
        assert f"expected {world * (world + 1) / 2:g}" in rows[2][2]


def test_a_failure_on_one_rank_fails_the_check_on_every_rank():
    results = run_distributed(_checks, 2, 1)
    for rows in results:
        verdicts = {name: ok for name, ok, _ in rows}
        assert verdicts["broadcast"] is False
        assert verdicts["all_reduce"] is True
    assert "failed on 1 rank(s)" in dict((n, d) for n, _, d in results[0])["broadcast"]
