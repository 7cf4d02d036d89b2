"""Samplers: shuffled shards for training, exact (unpadded) shards for evaluation."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DistributedSampler, Sampler


def train_sampler(dataset_len: int, rank: int, world_size: int, seed: int) -> DistributedSampler:
    """torch's DistributedSampler; the trainer calls set_epoch() every epoch.

    It pads the last round by repeating samples so every rank runs the same number of
    steps (which DDP needs); evaluation does not pad.
    """
    return DistributedSampler(
        range(dataset_len), num_replicas=world_size, rank=rank, shuffle=True, seed=seed
    )


class ShardedEvalSampler(Sampler[int]):
    """Every index exactly once across ranks: rank r takes r, r+W, r+2W, ...

    Ranks may get different counts (1,001 images on 2 ranks: 501 and 500); evaluation
    sums counts, so nothing is duplicated and nothing is dropped.
    """

    def __init__(self, dataset_len: int, rank: int, world_size: int):
        self.indices = list(range(rank, dataset_len, world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
