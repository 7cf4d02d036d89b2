"""The run's data: the decoded cache and the screen, then the train and val loaders.

Training is sharded over the model's replicas (every process, except that a pipeline's
stages read the same batches); evaluation shards every image exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from paratrain.config import TrainConfig
from paratrain.data.cache.build import prepare
from paratrain.data.cache.read import CachedImages, DecodedCache, cached_eval_transform
from paratrain.data.device_batches import DeviceAugmented
from paratrain.data.feed import Feed, choose_feed
from paratrain.data.folder import (
    DataSplit,
    ImageSamples,
    Sample,
    build_split,
    leave_stop_signals_to_the_rank,
)
from paratrain.data.samplers import (
    GlobalBatches,
    ShardedEvalSampler,
    StepPlan,
    TrainBatches,
    TrainSampler,
    train_sampler,
)
from paratrain.data.samples import PackedStrings, Samples
from paratrain.data.scan import screen
from paratrain.data.sources.base import memory_folder, source_of
from paratrain.data.transforms import (
    Augment,
    AugmentedSamples,
    DecodedSamples,
    TrainAugment,
    batched,
    eval_samples,
)
from paratrain.distributed import comm
from paratrain.distributed.runtime import Runtime, threads_per_process
from paratrain.errors import AgreedUserError, told_if_full
from paratrain.files import replaced
from paratrain.log import get_logger


def default_workers(local_world_size: int) -> int:
    """Loader processes per rank: the cores left once every rank has one."""
    return max(0, min(8, threads_per_process(local_world_size) - 1))


def loader_workers(cfg: TrainConfig, runtime: Runtime, cached: bool = False) -> int:
    """``--workers``, else the cores left over; none when a CPU trains from the cache:
    its augmentation (0.06 ms an image at 64 px) costs less in the training process
    than a worker that takes turns with the compute threads on their cores — measured,
    ResNet-18 at 64 px on 2 cores: 315-338 images/s without a worker, 295-304 with one."""
    if cfg.workers is not None:
        return cfg.workers
    if cached and runtime.device.type == "cpu":
        return 0
    return default_workers(runtime.env.local_world_size)


def decode_workers(cfg: TrainConfig, runtime: Runtime) -> int:
    """Processes per rank that decode every image once (cache build, screen): nothing
    else runs meanwhile, so all of the rank's cores (at least ``--workers``); one core
    decodes in the rank itself. ``--workers 0`` keeps all of it in the rank's process."""
    if cfg.workers == 0:
        return 0
    cores = min(8, threads_per_process(runtime.env.local_world_size))
    return max(cfg.workers or 0, cores if cores > 1 else 0)


def nodes_of(runtime: Runtime) -> int:
    """Machines in the job."""
    return max(1, runtime.world_size // max(runtime.env.local_world_size, 1))


def read_split(cfg: TrainConfig, runtime: Runtime | None = None) -> DataSplit:
    """The run's split: a sharded source over several nodes lists only this node's
    shards (each node reads only what its ranks train on)."""
    source = source_of(cfg)
    node, nodes = 0, 1
    if runtime is not None and source.sharded:
        node, nodes = runtime.env.node_rank, nodes_of(runtime)
    return build_split(source, cfg.val_fraction, cfg.split_seed, node, nodes)


SPLIT_RECORD = "split.npz"  # in the run folder: which file went to which side


def keep_sides(split: DataSplit, run_dir: Path, resumed: bool, runtime: Runtime) -> DataSplit:
    """The split a run began with, kept across its resumes: a new run records which
    file went to which side (with its size and time); a resumed one keeps every
    recorded file on its side, places only new files (where the split puts them), leaves
    out those gone, and says in one line how the data changed. A split the source makes
    by each entry's key (shards) needs no record. Rank 0 decides; every rank applies it."""
    if split.layout == "given" or (split.source is not None and split.source.sharded):
        return split
    record = run_dir / SPLIT_RECORD
    both = split.train + split.val
    decided = None
    if runtime.is_main:
        if not resumed or not record.is_file():
            _write_record(record, split)
        else:
            decided = _reconcile(record, both, len(split.train))
    in_val, words = comm.broadcast_object(decided) or (None, "")
    if in_val is None:
        return split
    if words and runtime.is_main:
        get_logger().warning(words)
    kept = _with_sides(split, both, in_val)
    if runtime.is_main and words:
        _write_record(record, kept)  # the sides as they are now, for the next resume
    return kept


def recorded_sides(split: DataSplit, run_dir: Path | None) -> DataSplit:
    """The split as the run in ``run_dir`` recorded it (what `paratrain eval` validates
    on: the run's own validation images), where it kept a record."""
    if run_dir is None or not (run_dir / SPLIT_RECORD).is_file() or split.layout == "given":
        return split
    both = split.train + split.val
    in_val, _ = _reconcile(run_dir / SPLIT_RECORD, both, len(split.train))
    return _with_sides(split, both, in_val)


def _with_sides(split: DataSplit, both: Samples, in_val: np.ndarray) -> DataSplit:
    return DataSplit(
        split.classes,
        both.where(~in_val),
        both.where(in_val),
        split.layout,
        split.root,
        split.ignored,
        split.missing,
        split.label_sets,
    )


def _write_record(record: Path, split: DataSplit) -> None:
    arrays: dict[str, Any] = {
        f"{side}_{field}": value
        for side, samples in (("train", split.train), ("val", split.val))
        for field, value in (
            ("keys", samples.keys.data),
            ("offsets", samples.keys.offsets),
            ("sizes", samples.sizes),
            ("versions", samples.versions),
        )
    }
    with told_if_full(record, sum(a.nbytes for a in arrays.values())), replaced(record) as out:
        np.savez(out, **arrays)


def _reconcile(record: Path, both: Samples, n_train: int) -> tuple[np.ndarray, str]:
    """(which of ``both`` go to validation, what changed in words)."""
    saved = np.load(record)
    recorded: dict[str, tuple[bool, int, int]] = {}
    for side in ("train", "val"):
        keys = PackedStrings(saved[f"{side}_keys"], saved[f"{side}_offsets"])
        for key, size, version in zip(
            keys, saved[f"{side}_sizes"].tolist(), saved[f"{side}_versions"].tolist(), strict=True
        ):
            recorded[key] = (side == "val", size, version)
    in_val = np.zeros(len(both), dtype=bool)
    added = changed = 0
    sizes, versions = both.sizes.tolist(), both.versions.tolist()
    for i, key in enumerate(both.keys):
        known = recorded.get(key)
        if known is None:
            added += 1
            in_val[i] = i >= n_train  # where this split placed it
            continue
        in_val[i] = known[0]
        changed += (known[1], known[2]) != (sizes[i], versions[i])
    gone = len(recorded) - (len(both) - added)
    if not (added or gone or changed):
        return in_val, ""
    return in_val, (
        f"the data changed since the run began: {added} file(s) added (placed by the "
        f"split), {gone} gone (left out), {changed} changed; every earlier file kept on "
        "its side of the split"
    )


def node_local(split: DataSplit, runtime: Runtime) -> tuple[int, int] | None:
    """(local rank, local world) where each node holds its own entries, else None."""
    source = split.source
    if source is None or not source.sharded or nodes_of(runtime) == 1:
        return None
    return runtime.env.local_rank, runtime.env.local_world_size


def prepare_data(
    cfg: TrainConfig, split: DataSplit, runtime: Runtime, run_dir: Path | None
) -> tuple[DecodedCache | None, DataSplit]:
    """The decoded-image cache (built by all ranks, or None) and the split screened for
    unreadable images. Building the cache decodes every image, so it is the screen too;
    without a cache only what the screen's memory has no verdict on is decoded."""
    workers = decode_workers(cfg, runtime)
    cache = prepare(
        split.train + split.val,
        cfg.image_size,
        cfg.cache,
        cfg.cache_max_gb,
        cfg.cache_dir,
        workers,
        runtime.env,
        short=cfg.stored_size,
        interpolation=cfg.interpolation,
    )
    found = cache.bad if cache is not None else None
    screened = screen(
        split,
        cfg.bad_images,
        runtime.rank,
        runtime.world_size,
        workers,
        run_dir,
        found,
        memory_folder(cfg),
        runtime.env.node_rank,
        node_local(split, runtime),
    )
    return cache, screened


@dataclass
class Loaders:
    train: DataLoader
    val: DataLoader
    sampler: TrainSampler  # the training order: set_epoch(epoch, consumed) each epoch
    workers: int  # loader processes per rank
    cache: DecodedCache | None  # what training reads, where it reads a cache
    feed: Feed = Feed("loader", "as built")  # where training images are augmented, and why

    def step_plan(self, step: int) -> StepPlan | None:
        """How the ``step``-th step since the epoch (re)started weighs its micro-batches
        (--order global), or None: as loaded."""
        return self.train.batch_sampler.step_plan(step)  # type: ignore[union-attr]

    @property
    def cached(self) -> bool:
        return self.cache is not None

    @property
    def train_size(self) -> int:
        """The training crop the loader makes now."""
        return _augment_of(self.train.dataset).size

    def train_at(self, size: int) -> None:
        """Training crops of ``size`` pixels from the next epoch on (--progressive): the
        augmentation resized and the loader made anew, so its worker processes start with
        it (persistent workers keep the copy they were started with)."""
        if size == self.train_size:
            return
        _augment_of(self.train.dataset).size = size
        old = self.train
        self.train = DataLoader(
            old.dataset,
            batch_sampler=old.batch_sampler,
            num_workers=old.num_workers,
            pin_memory=old.pin_memory,
            persistent_workers=old.persistent_workers,
            collate_fn=old.collate_fn,
            worker_init_fn=old.worker_init_fn,
        )
        del old  # its workers end with it


def _augment_of(dataset) -> TrainAugment:
    augment = getattr(dataset, "augment", None) or dataset.transform
    assert isinstance(augment, TrainAugment)
    return augment


def make_loaders(
    cfg: TrainConfig,
    split: DataSplit,
    runtime: Runtime,
    cache: DecodedCache | None,
    replica: int,
    replicas: int,
    fixed_batch: bool = False,
) -> Loaders:
    """Training batches of this replica's shard (reshuffled every epoch, resumable) and
    validation batches of its exact shard; ``fixed_batch``: drop a short last batch."""
    workers = loader_workers(cfg, runtime, cached=cache is not None)
    augment = TrainAugment(Augment.of(cfg))

    def on_cpu() -> AugmentedSamples:
        if cache is not None:
            return CachedImages(split.train, cache, augment)
        return DecodedSamples(split.train, augment)

    feed = choose_feed(cfg, split, runtime, cache, workers, on_cpu, augment)
    train_set = (
        DeviceAugmented(split.train, augment, cache, dali=feed.where == "dali")
        if feed.on_device
        else on_cpu()
    )
    labels = split.train.labels
    power = cfg.balance_power if cfg.balance == "sampler" else None  # --balance sampler
    local = node_local(split, runtime)
    if local is not None:  # each node trains on its own shards, the same steps on each
        if replicas != runtime.world_size:
            raise AgreedUserError(
                f"--data {cfg.data}: shards read per node need every process to be a model "
                f"copy (--strategy {cfg.strategy} has {replicas} copies in "
                f"{runtime.world_size} processes)"
            )
        longest = max(comm.all_gather_object(len(train_set)))
        sampler = train_sampler(labels, local[0], local[1], cfg.seed, cfg.ra_reps, power)
        sampler.node_share(-(-longest // local[1]) * local[1], nodes_of(runtime))
        replica, replicas = local
    else:
        padded = cfg.order == "padded"  # --order global: no image twice in an epoch
        sampler = train_sampler(labels, replica, replicas, cfg.seed, cfg.ra_reps, power, padded)
    batches = _train_batches(cfg, sampler, replicas, len(train_set), local is not None, fixed_batch)
    train = DataLoader(
        train_set,
        batch_sampler=batches,
        num_workers=workers,
        pin_memory=runtime.device.type == "cuda",
        persistent_workers=workers > 0,
        collate_fn=batched,
        worker_init_fn=leave_stop_signals_to_the_rank,
    )
    val = validation_loader(
        split.val, cfg, cfg.batch, workers, replica, replicas, cache, runtime.device.type == "cuda"
    )
    return Loaders(train, val, sampler, workers, cache, feed)


def _train_batches(
    cfg: TrainConfig,
    sampler: TrainSampler,
    replicas: int,
    images: int,
    per_node: bool,
    fixed_batch: bool,
) -> TrainBatches | GlobalBatches:
    """The sampler's order in this rank's batches: --order global's steps, or padded
    batches; ``per_node``: each node reads its own shards."""
    if cfg.order == "global":
        if per_node or fixed_batch:
            why = (
                "shards read per node"
                if per_node
                else f"--strategy {cfg.strategy}'s fixed micro-batches"
            )
            raise AgreedUserError(
                f"--order global: {why} give each process its own order; use --order padded"
            )
        return GlobalBatches(sampler, cfg.batch, cfg.grad_accum)
    if len(sampler) == 1:
        raise AgreedUserError(
            f"{images} training image(s) give each of {replicas} model copies 1 image "
            "an epoch, and BatchNorm needs 2 a step: use fewer processes or more images"
        )
    return TrainBatches(sampler, cfg.batch, drop_last=fixed_batch)


def validation_loader(
    samples: Samples | Sequence[Sample],
    cfg: TrainConfig,
    batch_size: int,
    workers: int,
    rank: int,
    world: int,
    cache: DecodedCache | None = None,
    pin: bool = False,
) -> DataLoader:
    """Validation batches of this rank's exact shard (every image once across ranks):
    the training run's and `paratrain eval`'s. From the cache where it holds
    validation's resize (bit for bit the decode path's tensors), else decoded: a second
    resize would change them, and so would a packed cache's JPEG."""
    extra: dict = {}
    if cache is not None and cache.lossless and cfg.stored_size == cfg.eval_resize:
        transform = cached_eval_transform(cfg.eval_crop, cfg.norm_mean, cfg.norm_std)
        dataset: ImageSamples = CachedImages(samples, cache, transform)
        extra["collate_fn"] = batched
    else:
        dataset = eval_samples(
            samples,
            cfg.eval_crop,
            cfg.eval_resize,
            cfg.interpolation,
            cfg.norm_mean,
            cfg.norm_std,
        )
    return DataLoader(
        dataset,
        sampler=ShardedEvalSampler(len(dataset), rank, world, batch_size),
        batch_size=batch_size,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=workers > 0,
        worker_init_fn=leave_stop_signals_to_the_rank,
        **extra,
    )
