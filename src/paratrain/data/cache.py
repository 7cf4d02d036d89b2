"""The decoded-image cache: every image decoded once, stored as uint8 in a memory map.

Each image is decoded as evaluation decodes it (a JPEG at reduced scale where it stays
large enough) and resized (with the very Resize the eval transform uses) so that its
shorter side is what the transforms need, and stored as HWC uint8 in one flat file under the
cache directory, with an index of offsets and shapes. The directory's name is a hash of
the file list, the files' sizes and modification times and the stored size, so changing
the data builds a new cache. Ranks decode disjoint shards in parallel into the same file
and then all read it; the operating system's page cache shares it between processes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, default_collate
from torchvision import transforms as T
from torchvision.transforms import functional as TF
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F2  # uint8 fast path for resizing
from tqdm import tqdm

from paratrain.data.builtin import default_cache_dir
from paratrain.data.folder import (
    IMAGE_ERRORS,
    ImageSamples,
    Sample,
    open_image,
    read_rgb,
    seeded,
)
from paratrain.data.transforms import IMAGENET_MEAN, IMAGENET_STD, eval_resize
from paratrain.distributed import comm

CACHE_FORMAT = 3  # 2: every file has a slot, bad.json lists the unreadable; 3: JPEG draft
_ROTATED = {5, 6, 7, 8}  # EXIF orientations that swap width and height


def cache_key(samples: Sequence[Sample], short_side: int) -> str:
    """The cache's name: a hash of the format, the stored size and every file's path, size and modification time, so changed data gets a new cache."""
    digest = hashlib.sha256(f"paratrain-cache-{CACHE_FORMAT}-{short_side}".encode())
    for path, _ in samples:
        stat = os.stat(path)
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def stored_shape(path: str, short_side: int) -> tuple[int, int]:
    """(height, width) of the image once upright and resized, from its header alone."""
    with open_image(path, short_side) as image:
        width, height = image.size
        if image.getexif().get(0x0112) in _ROTATED:
            width, height = height, width
    return tuple(TF._compute_resized_output_size([height, width], [short_side]))


class _Decode(Dataset):
    """Item k: decode the k-th chunk of images and write each into its slot of the data
    file; only (index, problem) pairs go back. Sending every decoded image back through
    the loader's shared-memory queue cost more than decoding it: 3,000 images of
    400x300 took 5.0 s with two workers, the same as one process alone."""

    CHUNK = 16

    def __init__(self, paths: list[str], ids: list[int], short_side: int, directory: Path):
        self.paths, self.directory, self.short_side = paths, directory, short_side
        self.chunks = [ids[k : k + self.CHUNK] for k in range(0, len(ids), self.CHUNK)]
        self.resize = T.Resize(short_side, antialias=True)  # the eval transform's own
        self.index = np.load(directory / "index.npy")
        self._data: np.memmap | None = None  # opened in the process that writes

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, k: int) -> list[tuple[int, str | None]]:
        if self._data is None:
            self._data = np.memmap(self.directory / "data.u8", dtype=np.uint8, mode="r+")
        done = []
        for i in self.chunks[k]:
            image, problem = read_rgb(self.paths[i], self.short_side)
            if image is not None:
                pixels = np.asarray(self.resize(image), dtype=np.uint8)
                offset, height, width = (int(v) for v in self.index[i])
                if pixels.shape != (height, width, 3):
                    problem = "changed while the cache was built"
                else:
                    self._data[offset : offset + pixels.size] = pixels.reshape(-1)
            done.append((i, problem))
        return done


class DecodedCache:
    def __init__(self, directory: Path, paths: Sequence[str] = ()):
        self.directory = directory
        self.index = np.load(directory / "index.npy")  # rows: offset, height, width
        self.slots = {path: i for i, path in enumerate(paths)}  # where each file is stored
        self._data: np.memmap | None = None  # opened lazily, once per loader process

    @property
    def bad(self) -> list[tuple[str, str]]:
        """(path, reason) of every file the build could not decode (not stored)."""
        found = self.directory / "bad.json"
        return [tuple(pair) for pair in json.loads(found.read_text())] if found.exists() else []

    @property
    def nbytes(self) -> int:
        """Bytes of decoded pixels the cache holds."""
        return int((self.index[:, 1] * self.index[:, 2] * 3).sum())

    def image(self, i: int) -> torch.Tensor:
        """The i-th stored image as a CHW uint8 tensor."""
        if self._data is None:
            self._data = np.memmap(self.directory / "data.u8", dtype=np.uint8, mode="r")
        offset, height, width = (int(v) for v in self.index[i])
        pixels = self._data[offset : offset + height * width * 3].reshape(height, width, 3)
        return torch.from_numpy(np.array(pixels)).permute(2, 0, 1)

    def __getstate__(self) -> dict:  # loader workers open their own map
        return {**self.__dict__, "_data": None}


def prepare(
    samples: Sequence[Sample],
    image_size: int,
    mode: str,
    max_gb: float,
    root: str | None,
    workers: int,
) -> DecodedCache | None:
    """Open or build (all ranks together) the cache of ``samples``; None when it is off.

    Building decodes every image, so it is also the screen for unreadable files: they
    are listed in ``cache.bad`` (kept with the cache, so a ready cache needs no screen)."""
    if mode == "off":
        return None
    short = eval_resize(image_size)
    plan = _plan(samples, image_size, mode, max_gb, root) if comm.is_main() else None
    action, directory, reason = comm.broadcast_object(plan)
    if action == "skip":
        from paratrain.log import get_logger

        get_logger().info(f"decoded-image cache off: {reason}")
        return None
    if action == "build":
        _build(samples, short, Path(directory), workers)
    return DecodedCache(Path(directory), [p for p, _ in samples])


def _stored_shape_or_empty(path: str, short: int) -> tuple[int, int]:
    """A file whose header cannot be read gets no room; the build reports why."""
    try:
        return stored_shape(path, short)
    except IMAGE_ERRORS:
        return (0, 0)


@dataclass
class CachePlan:
    """What the cache of a data set would do: be read ("ready"), be built ("build"), or
    be left out ("skip", with the reason)."""

    action: str
    directory: Path | None
    nbytes: int
    reason: str = ""
    shapes: np.ndarray | None = None  # (height, width) of every image, when built


def survey(
    samples: Sequence[Sample], image_size: int, mode: str, max_gb: float, root: str | None
) -> CachePlan:
    """The plan for ``samples`` without writing anything (reads each file's header)."""
    short = eval_resize(image_size)
    base = (Path(root) if root else default_cache_dir()) / "decoded"
    if mode == "off":
        return CachePlan("skip", None, 0, "--cache off")
    directory = base / cache_key(samples, short)
    if (directory / "COMPLETE").exists():
        return CachePlan("ready", directory, DecodedCache(directory).nbytes)
    shapes = np.array(
        [
            _stored_shape_or_empty(p, short)
            for p, _ in tqdm(
                samples,
                desc="sizing image cache",
                unit="img",
                delay=1.0,
                leave=False,
                disable=not sys.stderr.isatty(),
            )
        ],
        dtype=np.int64,
    ).reshape(-1, 2)
    total = int((shapes[:, 0] * shapes[:, 1] * 3).sum())
    if mode == "auto" and total > max_gb * 2**30:
        reason = f"the decoded images need {total / 2**30:.1f} GB, over --cache-max-gb {max_gb:g}"
        return CachePlan("skip", directory, total, reason)
    return CachePlan("build", directory, total, shapes=shapes)


def _plan(samples, image_size: int, mode: str, max_gb: float, root) -> tuple[str, str, str]:
    plan = survey(samples, image_size, mode, max_gb, root)
    if plan.action != "build":
        return plan.action, str(plan.directory or ""), plan.reason
    directory = plan.directory
    directory.mkdir(parents=True, exist_ok=True)
    sizes = plan.shapes[:, 0] * plan.shapes[:, 1] * 3
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    np.save(directory / "index.npy", np.column_stack([offsets, plan.shapes]))
    with open(directory / "data.u8", "wb") as handle:
        handle.truncate(max(plan.nbytes, 1))
    return "build", str(directory), ""


def _build(samples, short: int, directory: Path, workers: int) -> None:
    rank, world = comm.rank(), comm.world_size()
    paths = [p for p, _ in samples]
    decode = _Decode(paths, list(range(rank, len(paths), world)), short, directory)
    loader = DataLoader(decode, batch_size=None, num_workers=workers)
    bad = []
    with tqdm(
        total=len(paths),
        desc="building image cache",
        unit="img",
        delay=1.0,
        disable=rank != 0 or not sys.stderr.isatty(),
        leave=False,
    ) as bar:
        for done in loader:
            bad += [(paths[i], problem) for i, problem in done if problem]
            bar.update(world * len(done))
    del decode, loader
    descriptor = os.open(directory / "data.u8", os.O_RDONLY)
    try:  # every process's writes reach the disk before COMPLETE says they did
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
    bad = sorted(pair for part in comm.all_gather_object(bad) for pair in part)
    if rank == 0:
        (directory / "bad.json").write_text(json.dumps(bad) + "\n")
        (directory / "COMPLETE").write_text(json.dumps({"images": len(paths)}) + "\n")
    comm.barrier()


class CachedImages(ImageSamples):
    """ImageSamples read from the cache, each from the slot its file was stored in."""

    def __init__(
        self, samples: Sequence[Sample], cache: DecodedCache, transform: Callable | None = None
    ):
        super().__init__(samples, transform)
        self.cache = cache
        self.slots = [cache.slots[path] for path, _ in samples]

    def load(self, index: int) -> torch.Tensor:
        """The sample's pixels from the cache instead of its file."""
        return self.cache.image(self.slots[index])

    def __getitems__(self, keys: list) -> tuple[torch.Tensor, torch.Tensor]:
        """A whole batch at once (the DataLoader asks for it so): a transform that can
        write into its slot of the batch does, which saves a copy of every image."""
        labels = torch.tensor([self.samples[k[0] if isinstance(k, tuple) else k][1] for k in keys])
        if not isinstance(self.transform, CachedTrainTransform):
            return default_collate([self[k] for k in keys])[0], labels
        size = self.transform.size
        batch = torch.empty(len(keys), 3, size, size)
        for slot, (index, seed) in zip(batch, keys, strict=True):
            with seeded(seed):
                self.transform(self.load(index), out=slot)
        return batch, labels


def batched(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """collate_fn for CachedImages: its __getitems__ returns the batch ready."""
    return batch


def _to_float(image: torch.Tensor) -> torch.Tensor:
    return image.float().div(255)  # as ToTensor does, so both paths agree bit for bit


class CachedTrainTransform:
    """RandomResizedCrop + horizontal flip + normalisation on a cached uint8 CHW tensor.

    The same augmentation as the decode path's, written against torchvision's functional
    API: the transform classes' dispatch costs as much as the resize itself at this size.
    """

    def __init__(self, size: int, crop_scale_min: float = 0.08, hflip: float = 0.5):
        self.size, self.scale, self.hflip = size, (crop_scale_min, 1.0), hflip
        self.mean = torch.tensor(IMAGENET_MEAN).mul(255).view(3, 1, 1)
        self.inv_std = torch.tensor(IMAGENET_STD).mul(255).reciprocal().view(3, 1, 1)

    def crop_box(self, height: int, width: int, draws: list[float]) -> tuple[int, int, int, int]:
        """RandomResizedCrop's box (torchvision's algorithm: 10 tries, then the centre),
        from random numbers drawn all at once."""
        area = height * width
        low, high = math.log(3 / 4), math.log(4 / 3)
        for attempt in range(10):
            u = draws[4 * attempt : 4 * attempt + 4]
            target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[0])
            aspect = math.exp(low + (high - low) * u[1])
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return int(u[2] * (height - h + 1)), int(u[3] * (width - w + 1)), h, w
        ratio = width / height
        if ratio < 3 / 4:
            w, h = width, int(round(width / (3 / 4)))
        elif ratio > 4 / 3:
            h, w = height, int(round(height * (4 / 3)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, image: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        draws = torch.rand(41).tolist()  # one call to the generator, not forty
        top, left, height, width = self.crop_box(image.shape[-2], image.shape[-1], draws)
        crop = F2.resized_crop(
            image, top, left, height, width, [self.size, self.size], antialias=True
        )
        if self.hflip > 0 and draws[40] < self.hflip:
            crop = crop.flip(-1)
        out = crop.float() if out is None else out.copy_(crop)
        return out.sub_(self.mean).mul_(self.inv_std)


def cached_train_transform(
    size: int, crop_scale_min: float = 0.08, hflip: float = 0.5
) -> CachedTrainTransform:
    """The training augmentation on cached uint8 images (see CachedTrainTransform)."""
    return CachedTrainTransform(size, crop_scale_min, hflip)


def cached_eval_transform(size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The evaluation transform on cached uint8 images: the same tensors as the decode path's."""
    return v2.Compose([v2.CenterCrop(size), _to_float, v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
