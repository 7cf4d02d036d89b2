"""Exact evaluation under every strategy, over generated (images, batch, world size)
triples: each validation image is counted once, and the totals are one process's.

Exact shards differ in size (17 images in batches of 4 on 2 ranks: 9 and 8; 1 image
on 3 ranks: 1, 0 and 0), so ranks hold different numbers of batches. Under fsdp and hsdp a forward is
itself a collective (each unit's parameters are all-gathered), so a rank with fewer
batches must still take part in every forward the others make: before the fix, gloo
aborted with "Received data size doesn't match expected size" or waited forever.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from paratrain.config import TrainConfig
from paratrain.data.samplers import ShardedEvalSampler
from paratrain.distributed.env import detect
from paratrain.distributed.runtime import Runtime
from paratrain.engine.inference.evaluate import evaluate
from paratrain.models.registry import build_model
from paratrain.parallel.parallelize import parallelize
from paratrain.parallel.parts import ModelParts
from spawn import in_single_process, run_distributed

pytestmark = pytest.mark.slow
SIZE, CLASSES = 16, 5


def _cases(world: int, even_batches: bool) -> list[tuple[int, int]]:
    """(images, batch) pairs: the edges (no image at all, fewer images than ranks, one
    more than a whole round of batches) and random draws from a seed per world size."""
    rng = random.Random(1000 + world)
    batches = [2, 4, 6] if even_batches else [1, 2, 3, 5, 8]
    edges = [(0, batches[0]), (1, batches[-1]), (world - 1, batches[0]), (world + 1, batches[0])]
    edges.append((world * batches[-1] + 1, batches[-1]))
    drawn = [(rng.randint(0, 41), rng.choice(batches)) for _ in range(6)]
    return edges + drawn


def _dataset(images: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(images)
    x = torch.randn(images, 3, SIZE, SIZE, generator=generator)
    y = torch.randint(0, CLASSES, (images,), generator=generator)
    return TensorDataset(x, y)


def _config(strategy: str, **extra) -> TrainConfig:
    return TrainConfig(
        model="resnet18",
        image_size=SIZE,
        precision="32",
        seed=5,
        memory_format="contiguous",
        strategy=strategy,
        **extra,
    )


def _evaluate_all(rank, world, strategy: str, extra: dict, cases: list[tuple[int, int]]):
    """Every case evaluated under the strategy: (count, correct, loss) each."""
    cfg = _config(strategy, **extra)
    runtime = Runtime(
        env=detect(os.environ), device=torch.device("cpu"), backend="gloo" if world > 1 else None
    )
    built: dict[int, ModelParts] = {}  # a run has one batch size (a pipeline's buffers)
    results = []
    for images, batch in cases:
        if batch not in built:
            built[batch] = parallelize(build_model(cfg, CLASSES), cfg, runtime)
        parts = built[batch]
        dataset = _dataset(images)
        sampler = ShardedEvalSampler(len(dataset), parts.replica, parts.replicas, batch)
        loader = DataLoader(dataset, batch_size=batch, sampler=sampler)
        result = evaluate(parts, loader, torch.device("cpu"), CLASSES)
        correct = round(result.top1 * result.count) if result.count else 0
        results.append((result.count, correct, result.loss))
    return results


def _reference(cases: list[tuple[int, int]]):
    """One process, the plain model, every image in one shard."""
    model = build_model(_config("ddp"), CLASSES)
    out = []
    for images, batch in cases:
        loader = DataLoader(_dataset(images), batch_size=batch)
        result = evaluate(model, loader, torch.device("cpu"), CLASSES)
        out.append((result.count, round(result.top1 * result.count) if result.count else 0))
        out[-1] += (result.loss,)
    return out


def _check(per_rank: list, cases: list[tuple[int, int]]) -> None:
    expected = _reference(cases)
    for rank, results in enumerate(per_rank):
        for (images, batch), got, want in zip(cases, results, expected, strict=True):
            where = f"rank {rank}, {images} images, batch {batch}"
            assert got[0] == want[0] == images, where  # every image once
            assert got[1] == want[1], where
            if images:
                assert abs(got[2] - want[2]) <= 1e-4 * abs(want[2]), where


STRATEGIES = [  # (strategy, its settings, world size, processes a node)
    ("ddp", {}, 1, None),
    ("split", {"devices": "cpu,cpu"}, 1, None),
    ("ddp", {}, 2, None),
    ("fsdp", {}, 2, None),
    ("hsdp", {}, 2, None),
    ("pipeline", {"stages": 2, "microbatches": 2}, 2, None),
    ("ddp", {}, 3, None),
    ("fsdp", {}, 3, None),
    ("hsdp", {}, 3, None),
    ("fsdp", {}, 4, None),
    ("hsdp", {}, 4, 2),  # 2 nodes of 2: sharded in a node, replicated across
    ("pipeline", {"stages": 2, "microbatches": 2}, 4, None),  # 2 replicas of 2 stages
]


@pytest.mark.parametrize(
    "strategy, extra, world, per_node",
    STRATEGIES,
    ids=[f"{s}-{w}" + (f"x{n}" if n else "") for s, _, w, n in STRATEGIES],
)
def test_every_image_counted_once_whatever_the_shares(strategy, extra, world, per_node):
    cases = _cases(world, even_batches=strategy == "pipeline")
    assert any(images < world for images, _ in cases)  # shares of 0 images are drawn
    if world == 1:
        per_rank = [in_single_process(_evaluate_all, strategy, extra, cases)]
    else:
        per_rank = run_distributed(_evaluate_all, world, strategy, extra, cases, per_node=per_node)
    _check(per_rank, cases)
