"""Where training images are augmented (--augment-on, --loader), and why.

Three ways feed the step:

* ``loader``: the DataLoader's processes decode (or read the cache), crop, resize, flip
  and normalise, image by image, on the CPU;
* ``device``: the loader only reads each image as stored; the model's device decodes
  JPEGs and augments the whole batch at once (data/device_batches.py);
* ``dali``: as ``device``, with NVIDIA DALI decoding only each crop's region and
  resizing (data/dali.py).

``auto`` measures on the machine, on a few of the training images, the seconds per
image each way can deliver: the loader's work divided over its processes, and for the
device ways the slower of the loader's reading (over its processes) and the device's
batch. The fastest wins, and the start line says the figures. On a CPU the loader
augments: a device path there would take the training threads' own cores.
Rank 0 measures; every rank feeds the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from paratrain.config import TrainConfig
from paratrain.data import dali
from paratrain.data.device_batches import DeviceAugmented
from paratrain.distributed import comm
from paratrain.errors import UserError

if TYPE_CHECKING:
    from paratrain.data.cache.read import DecodedCache
    from paratrain.data.folder import DataSplit
    from paratrain.data.transforms import AugmentedSamples, TrainAugment
    from paratrain.distributed.runtime import Runtime

__all__ = ["Feed", "choose_feed"]

WAYS = {"loader": "in the loader", "device": "on the device, batch-wide", "dali": "by DALI"}
PROBE = 32  # training images each way is timed on


@dataclass(frozen=True)
class Feed:
    """How training batches are made: ``where`` (a key of WAYS) and why, in words."""

    where: str
    why: str

    @property
    def on_device(self) -> bool:
        return self.where != "loader"

    def words(self) -> str:
        """For the start line."""
        return f"augmented {WAYS[self.where]} ({self.why})"


def choose_feed(
    cfg: TrainConfig,
    split: DataSplit,
    runtime: Runtime,
    cache: DecodedCache | None,
    workers: int,
    cpu_set: Callable[[], AugmentedSamples],
    augment: TrainAugment,
) -> Feed:
    """The run's way (``cpu_set``: the loader's own dataset, built if measured)."""
    if cfg.loader == "dali":
        why = dali.available()
        if why is not None:  # preflight says so first, with the extra to install
            raise UserError(f"--loader dali: {why}")
        if cache is not None and cache.lossless:
            return Feed("device", "--loader dali, but the cache holds decoded pixels, not "
                        "JPEGs: DALI has nothing to decode (--cache packed keeps JPEGs)")  # fmt: skip
        return Feed("dali", "--loader dali")
    if cfg.augment_on != "auto":
        return Feed(
            "loader" if cfg.augment_on == "cpu" else "device", f"--augment-on {cfg.augment_on}"
        )
    if runtime.device.type != "cuda":
        return Feed("loader", "on a CPU the loader's work would otherwise take the training cores")
    jpegs = cache is None or not cache.lossless  # what DALI decodes
    with_dali = cfg.loader == "auto" and jpegs and dali.available() is None
    ways = ["loader", "device"] + (["dali"] if with_dali else [])

    def measure() -> Feed:
        seconds = {way: _per_image(way, split, runtime.device, cache, workers, cpu_set, augment)
                   for way in ways}  # fmt: skip
        best = min(seconds, key=lambda way: seconds[way])
        said = ", ".join(f"{way} {seconds[way] * 1e3:.3g} ms" for way in ways)
        return Feed(best, f"measured per image: {said}; {max(workers, 1)} loader process(es)")

    return comm.agree(measure)


def _per_image(
    way: str,
    split: DataSplit,
    device: torch.device,
    cache: DecodedCache | None,
    workers: int,
    cpu_set: Callable[[], AugmentedSamples],
    augment: TrainAugment,
) -> float:
    """Seconds per image ``way`` delivers, after one warm-up batch."""
    keys = [(i, i) for i in range(min(PROBE, len(split.train)))]
    share = max(workers, 1)  # the loader's work spreads over its processes
    if way == "loader":
        dataset = cpu_set()
        dataset.__getitems__(keys[:2])
        return _timed(lambda: dataset.__getitems__(keys)) / len(keys) / share
    reader = DeviceAugmented(split.train, augment, cache, dali=way == "dali")
    batch, _ = reader.__getitems__(keys)
    batch.on(device, torch.contiguous_format)  # warm-up: kernels, DALI's graph
    read = _timed(lambda: reader.__getitems__(keys)) / len(keys) / share

    def augmented() -> None:
        batch.on(device, torch.contiguous_format)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return max(read, _timed(augmented) / len(keys))


def _timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start
