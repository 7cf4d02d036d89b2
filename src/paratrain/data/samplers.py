"""Samplers: resumable shuffled shards for training, exact (unpadded) shards for evaluation."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Sampler


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """The augmentation seed of one sample: a function of where it stands in the epoch's
    global order, so crops and flips do not depend on the rank, the world size, the
    number of loader workers, or on whether the epoch was interrupted and resumed."""
    return (seed * 1_000_003 + epoch * 10_000_019 + position * 7_919) % (2**63 - 1)


class TrainSampler(Sampler[tuple[int, int]]):
    """torch's DistributedSampler order, resumable in the middle of an epoch.

    The epoch's order is a permutation seeded by ``seed + epoch`` (as DistributedSampler
    does), padded by repeating its head to a multiple of the world size; rank r takes
    positions r, r+W, r+2W, ... ``set_epoch(epoch, consumed)`` skips the first
    ``consumed`` positions of the global order — the samples already trained on — so a
    resumed epoch neither repeats nor skips a sample, whatever the world size was before.
    Each item is ``(index, augmentation seed)``.
    """

    def __init__(
        self,
        dataset_len: int,
        rank: int,
        world_size: int,
        seed: int = 0,
        repeats: int = 1,
        padded: bool = True,
    ):
        self.n, self.rank, self.world_size, self.seed = dataset_len, rank, world_size, seed
        self.repeats = repeats
        self.epoch, self.consumed = 0, 0
        # padded to a multiple of the ranks; unpadded for --order global (GlobalBatches)
        self.length = math.ceil(dataset_len / world_size) * world_size if padded else dataset_len
        self.nodes = 1  # orders like this one, on as many nodes (node_share)

    def node_share(self, length: int, nodes: int) -> None:
        """This order is one node's of ``nodes`` (a sharded source: each node its own
        shards), padded to ``length`` so that every node takes as many steps; ``consumed``
        and ``total`` stay counts over the whole job."""
        self.length, self.nodes = max(length, self.length), nodes

    def set_epoch(self, epoch: int, consumed: int = 0) -> None:
        """A new order for ``epoch``, skipping the ``consumed`` samples a resumed epoch already trained on."""
        self.epoch, self.consumed = epoch, consumed // self.nodes

    def _global_order(self) -> np.ndarray:
        """The epoch's order (an array: a million Python ints would cost 36 MB a rank)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=generator).numpy()
        if self.repeats > 1:  # repeated augmentation: each image K times, side by side, so
            # the K copies go to K different ranks; the epoch keeps its n samples
            order = np.repeat(order, self.repeats)[: self.n]
        return np.resize(order, self.length) if self.n else order  # padded with its head

    def __iter__(self) -> Iterator[tuple[int, int]]:
        order = self._global_order()
        positions = range(self.consumed + self.rank, len(order), self.world_size)
        for position, index in zip(
            positions, order[positions.start :: self.world_size].tolist(), strict=True
        ):
            yield index, sample_seed(self.seed, self.epoch, position)

    @property
    def total(self) -> int:
        """Samples in an epoch's global order (the data, padded to a multiple of ranks),
        over every node."""
        return self.length * self.nodes

    def __len__(self) -> int:
        return len(range(self.consumed + self.rank, self.length, self.world_size))


def balanced_quotas(counts: np.ndarray, n: int, power: float) -> np.ndarray:
    """How many of an epoch's ``n`` draws each class gets: in proportion to
    ``count^(1 - power)`` (inverse-frequency weights ``count^-power`` per image), rounded
    by largest remainder so that they sum to ``n`` exactly; a class without images none."""
    share = np.where(counts > 0, counts.astype(np.float64) ** (1.0 - power), 0.0)
    target = share / share.sum() * n
    quotas = np.floor(target).astype(np.int64)
    short = n - int(quotas.sum())
    if short:  # the largest remainders first, ties to the lower class
        order = np.lexsort((np.arange(len(counts)), -(target - quotas)))
        quotas[order[:short]] += 1
    return quotas


class BalancedSampler(TrainSampler):
    """--balance sampler: each epoch draws as many images as the data holds (the epoch
    is as long as an unbalanced one), each class its quota (``balanced_quotas``): a
    class's images in a fresh random order, cycled where the quota exceeds them (a rare
    class's images repeat evenly, a frequent class's are a subset, none twice before all
    once). The draws are shuffled together, seeded by the seed and the epoch alone, so
    the order is the same at every rank and world size, and a resumed epoch skips what
    was consumed, as TrainSampler's; every rank takes the same number of steps."""

    def __init__(
        self,
        labels: np.ndarray,
        rank: int,
        world_size: int,
        seed: int = 0,
        power: float = 0.5,
        repeats: int = 1,
        padded: bool = True,
    ):
        super().__init__(len(labels), rank, world_size, seed, repeats, padded)
        labels = np.asarray(labels, np.int64)
        self.counts = np.bincount(labels) if len(labels) else np.zeros(0, np.int64)
        self.quotas = balanced_quotas(self.counts, len(labels), power)
        by_class = np.argsort(labels, kind="stable")
        self.members = np.split(by_class, np.cumsum(self.counts)[:-1]) if len(labels) else []

    def _global_order(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.epoch, 0xBA1])
        picks = []
        for members, quota in zip(self.members, self.quotas.tolist(), strict=True):
            if quota:
                cycles = -(-quota // len(members))
                picks.append(
                    np.concatenate([rng.permutation(members) for _ in range(cycles)])[:quota]
                )
        order = rng.permutation(np.concatenate(picks)) if picks else np.zeros(0, np.int64)
        if self.repeats > 1:
            order = np.repeat(order, self.repeats)[: self.n]
        return np.resize(order, self.length) if self.n else order


@dataclass(frozen=True)
class StepPlan:
    """How one optimizer step of --order global weighs its micro-batches: ``images`` in
    the step over every rank; per micro-batch of this rank, its ``real`` images (0: a
    stand-in image, weighted zero) and the ``divisor`` of its mean loss, so that the
    gradients averaged over the ranks are the mean over the step's images."""

    images: int
    real: tuple[int, ...]
    divisors: tuple[float, ...]


FEWEST = 3  # images a training step holds at least, where its batch size allows


class TrainBatches(Sampler):
    """The sampler's samples in batches of ``batch_size``, where a short last batch
    (under half a batch, or under ``FEWEST`` images) shares the last two batches' samples
    evenly (8 and 2 become 5 and 5). BatchNorm normalises a training batch by its own
    statistics, and ResNet's last stage is one pixel a side at 32 px and below: two
    images give it two values a channel, which it maps to -1 and +1 whatever they hold,
    with gradients as large as the two are close. One such step an epoch took
    ResNet-18's validation loss at 16 px to 1e14 and more (a last batch of 2, on 1
    process as on 2, in batches of 4, 8 or 17). So no step has fewer than half a batch
    or fewer than ``FEWEST`` images, and every sample stays in the epoch. Where the two
    batches cannot each have ``FEWEST`` (fewer than 6 images in all: batches of 2 to 4),
    they are one batch of up to 5. Every rank holds the same number of samples
    (TrainSampler pads), so every rank splits alike; a resumed epoch, which starts at a
    batch's edge, ends in the same batches. ``drop_last``: only full batches (a
    pipeline's fixed micro-batches)."""

    def __init__(self, sampler: TrainSampler, batch_size: int, drop_last: bool = False):
        self.sampler, self.batch_size, self.drop_last = sampler, batch_size, drop_last

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        held: list | None = None  # a full batch, held back in case the last one is short
        batch: list = []
        for item in self.sampler:
            batch.append(item)
            if len(batch) == self.batch_size:
                if held is not None:
                    yield held
                held, batch = batch, []
        if held is None:  # fewer samples than one batch: all of them, as one
            if batch and not self.drop_last:
                yield batch
            return
        both, start = held + batch, 0
        for size in self._tail(len(batch)):
            yield both[start : start + size]
            start += size

    def _tail(self, rest: int) -> list[int]:
        """The sizes of the epoch's last batches, made of its last full batch and the
        ``rest`` after it: as they are, shared evenly where ``rest`` is short, or one
        batch where the two hold fewer than 2 x ``FEWEST``."""
        if self.drop_last or not rest:
            return [self.batch_size]
        if 2 * rest >= self.batch_size and rest >= FEWEST:
            return [self.batch_size, rest]
        both = self.batch_size + rest
        return [both] if both < 2 * FEWEST else [-(-both // 2), both // 2]

    def __len__(self) -> int:
        full, rest = divmod(len(self.sampler), self.batch_size)
        if not full:
            return int(rest > 0 and not self.drop_last)
        return full - 1 + len(self._tail(rest))

    def step_plan(self, step: int) -> StepPlan | None:
        """Every micro-batch as loaded: the loss averaged over the step's micro-batches."""
        return None


class GlobalBatches(Sampler):
    """--order global: the sampler's order, unpadded, cut into global steps of
    ``world x batch x accum`` images whatever the world size; step s takes positions
    ``s·G .. s·G + G`` (from where a resumed epoch starts), its micro-batch j the next
    ``world x batch`` of them, and rank r every world-th from the r-th. A step short of
    images (the epoch's last, or one resumed under another world size) gives some ranks
    fewer: ``step_plan`` weighs each rank's loss by its share, so the averaged gradient
    is the mean over the step's images, as one process with the whole batch computes it.
    A rank left without an image in a micro-batch takes the micro-batch's first image as
    a stand-in weighted zero, so every rank runs the same forwards and collectives."""

    def __init__(self, sampler: TrainSampler, batch_size: int, accum: int = 1):
        assert sampler.length == sampler.n, "an unpadded order (padded=False)"
        self.sampler, self.batch_size, self.accum = sampler, batch_size, accum

    @property
    def _micro(self) -> int:
        return self.sampler.world_size * self.batch_size

    def _steps(self) -> Iterator[tuple[int, int]]:
        """(start, end) positions of the epoch's remaining steps."""
        start, n, size = self.sampler.consumed, self.sampler.length, self._micro * self.accum
        while start < n:
            yield start, min(start + size, n)
            start += size

    def _micros(self, start: int, end: int) -> list[tuple[int, range]]:
        """Each micro-batch of the step [start, end): its first position, and this rank's."""
        world, rank = self.sampler.world_size, self.sampler.rank
        return [
            (first, range(first + rank, min(first + self._micro, end), world))
            for first in range(start, end, self._micro)
        ]

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        sampler = self.sampler
        order = sampler._global_order()
        for start, end in self._steps():
            for first, positions in self._micros(start, end):
                if not positions:  # a stand-in, weighted zero
                    positions = range(first, first + 1)
                yield [
                    (int(order[p]), sample_seed(sampler.seed, sampler.epoch, p)) for p in positions
                ]

    def __len__(self) -> int:
        return sum(len(self._micros(start, end)) for start, end in self._steps())

    def step_plan(self, step: int) -> StepPlan:
        """The weights of the ``step``-th step from where the epoch (re)started."""
        size = self._micro * self.accum
        start = self.sampler.consumed + step * size
        end = min(start + size, self.sampler.length)
        real = tuple(len(positions) for _, positions in self._micros(start, end))
        world = self.sampler.world_size
        divisors = tuple((end - start) / (world * count) if count else math.inf for count in real)
        return StepPlan(end - start, real, divisors)


def train_sampler(
    labels: np.ndarray,
    rank: int,
    world_size: int,
    seed: int,
    repeats: int = 1,
    balance_power: float | None = None,
    padded: bool = True,
) -> TrainSampler:
    """The training sampler of one shard of ``replicas``: class-balanced where
    ``balance_power`` is given (--balance sampler); ``padded``: to a multiple of the
    ranks (torch's DistributedSampler), not for --order global."""
    if balance_power is not None:
        return BalancedSampler(labels, rank, world_size, seed, balance_power, repeats, padded)
    return TrainSampler(len(labels), rank, world_size, seed, repeats, padded)


class ShardedEvalSampler(Sampler[int]):
    """Every index exactly once across ranks, dealt as whole batches of one process's
    order: the batches are [0, B), [B, 2B), ... and rank r takes batches r, r+W, r+2W,
    ... So each image sits in the same batch, at the same row, beside the same images,
    at every process count, and a math library that rounds a row by its place in the
    batch rounds it the same way. ``batch_size`` must be the loader's.

    Ranks may get different counts (1,001 images in batches of 16 on 2 ranks: 32 and 31
    batches, 505 and 496 images); evaluation sums counts, so nothing is duplicated and
    nothing is dropped.
    """

    def __init__(self, dataset_len: int, rank: int, world_size: int, batch_size: int):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        batches = range(rank * batch_size, dataset_len, world_size * batch_size)
        self.indices = [
            i for start in batches for i in range(start, min(start + batch_size, dataset_len))
        ]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
