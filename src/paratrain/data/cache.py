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

import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T
from torchvision.transforms import v2
from tqdm import tqdm

from paratrain.data.builtin import default_cache_dir
from paratrain.data.folder import (
    IMAGE_ERRORS,
    Sample,
    open_image,
    read_rgb,
    upright_size,
)
from paratrain.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    AugmentedSamples,
    eval_resize,
    resized_size,
)
from paratrain.distributed import comm
from paratrain.distributed.env import DistEnv
from paratrain.errors import AgreedUserError
from paratrain.files import fsync, swap_in
from paratrain.log import get_logger

CACHE_FORMAT = 4  # 2: every file has a slot; 3: JPEG draft; 4: manifest with checksums


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
        height, width = upright_size(image)
    return resized_size(height, width, short_side)


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
        manifest = json.loads((self.directory / MANIFEST).read_text())
        return [tuple(pair) for pair in manifest["bad"]]

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


MANIFEST = "manifest.json"  # written last: a cache without a valid one is not a cache
BLOCK = 64 * 2**20  # bytes a checksum covers
_held_locks: dict[str, int] = {}  # cache key -> descriptor of its lock, while building


def _checksums(path: Path, size: int) -> list[int]:
    sums = []
    with open(path, "rb") as handle:
        for _ in range(0, max(size, 1), BLOCK):
            sums.append(zlib.crc32(handle.read(BLOCK)))
    return sums


def _write_manifest(directory: Path, images: int, short: int, bad: list) -> None:
    data = directory / "data.u8"
    size = data.stat().st_size
    manifest = {
        "format": CACHE_FORMAT,
        "images": images,
        "short_side": short,
        "index_sha256": hashlib.sha256((directory / "index.npy").read_bytes()).hexdigest(),
        "data_bytes": size,
        "block_bytes": BLOCK,
        "blocks": _checksums(data, size),
        "bad": bad,
    }
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest) + "\n")
    fsync(tmp)
    os.replace(tmp, directory / MANIFEST)


def verify(directory: Path, images: int, short: int) -> str | None:
    """None when ``directory`` is a whole cache of ``images`` images at ``short``; else
    what is wrong with it (so the run can say why it builds again)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return "it has no manifest (an interrupted build)"
    except (OSError, ValueError) as exc:
        return f"its manifest cannot be read ({type(exc).__name__})"
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        return "it is of another format"
    if (manifest.get("images"), manifest.get("short_side")) != (images, short):
        return "it holds other images"
    try:
        index = (directory / "index.npy").read_bytes()
        size = (directory / "data.u8").stat().st_size
    except OSError as exc:
        return f"a file of it is missing ({exc.strerror})"
    if hashlib.sha256(index).hexdigest() != manifest.get("index_sha256"):
        return "its index differs from its manifest"
    if size != manifest.get("data_bytes"):
        return f"its data file has {size} bytes, its manifest says {manifest.get('data_bytes')}"
    found = _checksums(directory / "data.u8", size)
    for block, (mine, expected) in enumerate(zip(found, manifest.get("blocks", []), strict=False)):
        if mine != expected:
            return f"block {block} of its data differs from its checksum"
    if len(found) != len(manifest.get("blocks", [])):
        return "its checksums do not cover its data"
    return None


def prepare(
    samples: Sequence[Sample],
    image_size: int,
    mode: str,
    max_gb: float,
    root: str | None,
    workers: int,
    env: DistEnv | None = None,
    short: int | None = None,
) -> DecodedCache | None:
    """Open, or build, the cache of ``samples`` on every node of the job; None when off.

    Each node gets a cache holding every image (its ranks read any of them over the
    epochs), whether or not the nodes share a file system: the local rank 0 of each
    node plans for its node. A builder takes a file lock, so runs and nodes that share
    the folder build once while the others wait and reuse it; it writes into a
    temporary folder, then the manifest (format, shapes, a checksum for each block),
    then renames the folder into place. A cache that fails its manifest is rebuilt, and
    the run says why. The cache is used on every node or on none.

    Building decodes every image, so it is also the screen for unreadable files: they
    are listed in ``cache.bad`` (kept in the manifest, so a ready cache needs no screen)."""
    if mode == "off":
        return None
    env = env or DistEnv(
        rank=comm.rank(),
        world_size=comm.world_size(),
        local_rank=comm.rank(),
        local_world_size=comm.world_size(),
    )
    told = False
    short = short or eval_resize(image_size)
    base = (Path(root) if root else default_cache_dir()) / "decoded"
    key = cache_key(samples, short)
    final = base / key
    while True:
        mine = None
        if env.local_rank == 0:
            mine = _plan_node(samples, short, mode, max_gb, base, key)
        plans = {n: plan for n, plan in comm.all_gather_object((env.node_rank, mine)) if plan}
        for action, _, reason in plans.values():
            if action == "error":
                raise AgreedUserError(reason)
        skipped = [reason for action, _, reason in plans.values() if action == "skip"]
        if skipped:
            get_logger().info(f"decoded-image cache off: {skipped[0]}")
            return None
        if all(action == "ready" for action, _, _ in plans.values()):
            return DecodedCache(final, [p for p, _ in samples])
        action, directory, reason = plans[env.node_rank]
        if action == "build" and env.local_rank == 0 and reason:
            get_logger().warning(f"decoded-image cache {final}: {reason}; building it again")
        if action == "wait" and env.local_rank == 0:
            if not told:
                get_logger().info(f"{reason}; waiting for it")
                told = True
            if not any(a == "build" for a, _, _ in plans.values()):
                time.sleep(1.0)  # another run builds it: look again in a moment
        building = action == "build"
        bad = []
        if building:
            bad = _build(samples, short, Path(directory), workers, env)
        bad = sorted({tuple(pair) for part in comm.all_gather_object(bad) for pair in part})
        if building and env.local_rank == 0:
            _finish(Path(directory), final, key, len(samples), short, bad)
        comm.barrier()


def _plan_node(samples, short: int, mode, max_gb, base: Path, key: str) -> tuple[str, str, str]:
    """(action, folder, why) for this node: "ready" (a valid cache), "build" (into a
    temporary folder, this process holding the lock), "wait" (another process held the
    lock: it has finished; look again), "skip" or "error" (why)."""
    final = base / key
    problem = verify(final, len(samples), short) if final.exists() else None
    if final.exists() and problem is None:
        return "ready", str(final), ""
    refused = "error" if mode == "on" else "skip"
    try:
        base.mkdir(parents=True, exist_ok=True)
        handle = os.open(base / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        where = f"cannot write to {base} ({exc.strerror or exc})"
        if mode == "on":
            return "error", "", f"--cache on: {where}"
        return "skip", "", f"{where}; decoding every epoch"
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # never block here: the holder may be a node of this job
        os.close(handle)
        return "wait", "", f"another process is building the decoded-image cache {final}"
    problem = verify(final, len(samples), short) if final.exists() else None
    if final.exists() and problem is None:  # finished while we looked
        os.close(handle)
        return "ready", str(final), ""
    plan = survey(samples, 0, mode, max_gb, str(base.parent), short=short)
    if plan.action == "skip":
        os.close(handle)
        return "skip", "", plan.reason
    free = shutil.disk_usage(base).free
    if free < plan.nbytes + 64 * 2**20:
        os.close(handle)
        where = (
            f"the decoded images need {plan.nbytes / 2**30:.2f} GB and {base} has "
            f"{free / 2**30:.2f} GB free"
        )
        return refused, "", f"--cache on: {where}" if mode == "on" else f"{where}"
    assert plan.shapes is not None  # a plan to build has every image's shape
    tmp = base / f".{key}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    sizes = plan.shapes[:, 0] * plan.shapes[:, 1] * 3
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    np.save(tmp / "index.npy", np.column_stack([offsets, plan.shapes]))
    with open(tmp / "data.u8", "wb") as data:
        data.truncate(max(plan.nbytes, 1))
    _held_locks[key] = handle
    return "build", str(tmp), (f"it failed its check: {problem}" if problem else "")


def _finish(tmp: Path, final: Path, key: str, images: int, short: int, bad: list) -> None:
    """The node's builder: the data on disk, the manifest last, the folder renamed into
    place (an invalid old one out of the way first), the lock let go."""
    fsync(tmp / "data.u8")  # every process's writes reach the disk before the manifest
    _write_manifest(tmp, images, short, [list(pair) for pair in bad])
    swap_in(tmp, final)  # an invalid old one out of the way first
    handle = _held_locks.pop(key, None)
    if handle is not None:
        fcntl.flock(handle, fcntl.LOCK_UN)
        os.close(handle)


def _build(samples, short: int, directory: Path, workers: int, env: DistEnv) -> list:
    """This rank's share of its node's build: every local_world-th image from its local
    rank on, written straight into the data file. Returns (path, why) of the unreadable."""
    local_rank, local_world = env.local_rank, env.local_world_size
    paths = [p for p, _ in samples]
    decode = _Decode(paths, list(range(local_rank, len(paths), local_world)), short, directory)
    loader = DataLoader(decode, batch_size=None, num_workers=workers)
    bad = []
    with tqdm(
        total=len(paths),
        desc="building image cache",
        unit="img",
        delay=1.0,
        disable=local_rank != 0 or not sys.stderr.isatty(),
        leave=False,
    ) as bar:
        for done in loader:
            bad += [(paths[i], problem) for i, problem in done if problem]
            bar.update(local_world * len(done))
    return bad


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
    samples: Sequence[Sample],
    image_size: int,
    mode: str,
    max_gb: float,
    root: str | None,
    short: int | None = None,
) -> CachePlan:
    """The plan for ``samples`` without writing anything (reads each file's header);
    ``short``: the short side stored (default: what evaluation at ``image_size`` needs)."""
    short = short or eval_resize(image_size)
    base = (Path(root) if root else default_cache_dir()) / "decoded"
    if mode == "off":
        return CachePlan("skip", None, 0, "--cache off")
    directory = base / cache_key(samples, short)
    if (directory / MANIFEST).exists() and verify(directory, len(samples), short) is None:
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


class CachedImages(AugmentedSamples):
    """Samples read from the cache, each from the slot its file was stored in."""

    def __init__(
        self, samples: Sequence[Sample], cache: DecodedCache, transform: Callable | None = None
    ):
        super().__init__(samples, transform)
        self.cache = cache
        self.slots = [cache.slots[path] for path, _ in samples]

    def load(self, index: int) -> torch.Tensor:
        """The sample's pixels from the cache instead of its file."""
        return self.cache.image(self.slots[index])


def _to_float(image: torch.Tensor) -> torch.Tensor:
    return image.float().div(255)  # as ToTensor does, so both paths agree bit for bit


def cached_eval_transform(size: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The evaluation transform on cached uint8 images: the same tensors as the decode path's."""
    return v2.Compose([v2.CenterCrop(size), _to_float, v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
