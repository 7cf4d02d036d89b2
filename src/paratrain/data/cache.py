"""The decoded-image cache: every image decoded once, resized, and kept on local disk.

Each image is decoded as evaluation decodes it (a JPEG at reduced scale where it stays
large enough) and resized (with the very Resize the eval transform uses) so that its
shorter side is what the transforms need. Two kinds:

* ``raw``: HWC uint8 pixels in one flat file, memory-mapped: nothing to decode, so the
  fastest to read, and bit for bit the decode path's evaluation input; as large as the
  pixels (ImageNet at 224 px: about 335 GB);
* ``packed``: each image re-encoded as a JPEG at quality 90 into a few large files (one
  per building rank) with an index, as FFCV keeps ImageNet (tens of GB): a small JPEG
  decodes several times faster than the original photo. Lossy, so validation still
  decodes the originals (exact evaluation stays exact).

``--cache auto`` takes raw pixels when they fit ``--cache-max-gb``, else packed JPEG when
the disk has room, else none, and says which and why.

The folder's name is a hash of the kind, the stored size and every entry's key, size and
modification time (data/samples.py), so changed data builds a new cache. Ranks decode
disjoint shares in parallel; the node's first rank writes the manifest (each file's size,
a CRC-32 for every 64 MB block) and renames the folder into place. A ready cache is
checked at start by what is cheap (manifest, index, sizes); its blocks' checksums are
checked in the background while training runs, and damage stops the run, named, with
the manifest removed so the next start builds it again (``agree_intact``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms as T
from torchvision.transforms import v2
from tqdm import tqdm

from paratrain.data import jpeg
from paratrain.data.builtin import default_cache_dir
from paratrain.data.folder import (
    IMAGE_ERRORS,
    leave_stop_signals_to_the_rank,
    open_image,
    read_rgb,
    upright_size,
)
from paratrain.data.samples import Samples, as_samples
from paratrain.data.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    INTERPOLATION,
    AugmentedSamples,
    eval_resize,
    resized_size,
)
from paratrain.distributed import comm
from paratrain.distributed.env import DistEnv
from paratrain.errors import AgreedUserError, DiskFull, is_disk_full, told_if_full
from paratrain.files import fsync, swap_in, try_lock
from paratrain.log import get_logger

if TYPE_CHECKING:
    from filelock import BaseFileLock

CACHE_FORMAT = 5  # 4: manifest with checksums; 5: kinds (raw, packed), parts, keyed entries
RAW, PACKED = "raw", "packed"
MODES = ("auto", "on", RAW, PACKED, "off")  # on: raw pixels, as before there were kinds
MANIFEST = "manifest.json"  # written last: a cache without a valid one is not a cache
BLOCK = 64 * 2**20  # bytes a checksum covers
SIZING_SAMPLE = 2000  # headers read to estimate a large data set's decoded size
_held_locks: dict[str, BaseFileLock] = {}  # cache key -> its build lock, while building
_planned_bytes: dict[str, int] = {}  # a build's temporary folder -> the space it planned


def kind_of(mode: str) -> str | None:
    """The kind a mode asks for (None: auto decides)."""
    return {"on": RAW, RAW: RAW, PACKED: PACKED}.get(mode)


def cache_key(
    samples: Samples, short_side: int, kind: str = RAW, interpolation: str = "bilinear"
) -> str:
    """The cache's name: a hash of the format, the kind, the stored size and its
    resizing, and every entry's key, size and modification time, so changed data gets a
    new cache."""
    quality = jpeg.QUALITY if kind == PACKED else 0
    resizing = "" if interpolation == "bilinear" else f"-{interpolation}"
    digest = hashlib.sha256(
        f"paratrain-cache-{CACHE_FORMAT}-{kind}-{short_side}-{quality}{resizing}".encode()
    )
    digest.update(samples.digest().encode())
    return digest.hexdigest()[:24]


def stored_shape(samples: Samples, i: int, short_side: int) -> tuple[int, int]:
    """(height, width) of entry ``i`` once upright and resized, from its header alone."""
    with open_image(samples.keys[i], short_side, samples.source) as image:
        height, width = upright_size(image)
    return resized_size(height, width, short_side)


def _shape_or_empty(samples: Samples, i: int, short: int) -> tuple[int, int]:
    """A file whose header cannot be read gets no room; the build reports why."""
    try:
        return stored_shape(samples, i, short)
    except IMAGE_ERRORS:
        return (0, 0)


# ---------------------------------------------------------------------------- reading


class DecodedCache:
    """A built cache: ``image(row)`` gives an entry's pixels, ``slots(samples)`` the rows
    of samples of the data set it was built from."""

    def __init__(self, directory: Path, samples: Samples | None = None):
        self.directory = directory
        self.manifest = json.loads((directory / MANIFEST).read_text())
        self.kind: str = self.manifest["kind"]
        self.parts: list[str] = [part["name"] for part in self.manifest["parts"]]
        self.index = np.load(directory / "index.npy")  # rows: part, offset, bytes, height, width
        self.ids = samples.ids if samples is not None else np.arange(len(self.index))
        self._maps: dict[int, np.memmap] = {}  # opened lazily, once per loader process
        self.check: CacheCheck | None = None  # the background checksum pass, where run

    @property
    def bad(self) -> list[tuple[str, str]]:
        """(key, reason) of every entry the build could not decode (not stored)."""
        return [(str(key), str(why)) for key, why in self.manifest["bad"]]

    @property
    def nbytes(self) -> int:
        """Bytes the cache's files hold."""
        return int(sum(part["bytes"] for part in self.manifest["parts"]))

    def slots(self, samples: Samples) -> np.ndarray:
        """The row of each of ``samples`` (a subset of what the cache was built from)."""
        order = np.argsort(self.ids, kind="stable")
        found = np.searchsorted(self.ids[order], samples.ids)
        rows = order[np.minimum(found, max(len(order) - 1, 0))]
        if len(rows) and not np.array_equal(self.ids[rows], samples.ids):
            raise KeyError("samples the cache was not built from")
        return rows

    def _part(self, number: int) -> np.memmap:
        if number not in self._maps:
            path = self.directory / self.parts[number]
            self._maps[number] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[number]

    def image(self, row: int) -> torch.Tensor:
        """The stored image of ``row`` as a CHW uint8 tensor."""
        part, offset, nbytes, height, width = (int(v) for v in self.index[row])
        stored = self._part(part)[offset : offset + nbytes]
        if self.kind == PACKED:
            pixels = jpeg.decode(stored.tobytes())
        else:
            pixels = np.array(stored).reshape(height, width, 3)
        return torch.from_numpy(pixels).permute(2, 0, 1)

    def stored(self, row: int) -> tuple[torch.Tensor, bool, tuple[int, int]]:
        """``row`` as stored, for the device path: (CHW pixels, or a packed entry's JPEG
        bytes for the device to decode; whether encoded; (height, width))."""
        if self.kind != PACKED:
            pixels = self.image(row)
            return pixels, False, (pixels.shape[-2], pixels.shape[-1])
        part, offset, nbytes, height, width = (int(v) for v in self.index[row])
        raw = bytearray(self._part(part)[offset : offset + nbytes])
        return torch.frombuffer(raw, dtype=torch.uint8), True, (height, width)

    def start_check(self) -> None:
        """Check every block's checksum in a thread of this process, from now on."""
        self.check = CacheCheck(self.directory, self.manifest)
        self.check.start()

    def damage(self, wait: bool = False) -> str | None:
        """What the background check found wrong so far (``wait``: once it has read
        everything); None while nothing is."""
        if self.check is None:
            return None
        if wait:
            self.check.join()
        return self.check.problem

    def __getstate__(self) -> dict:  # loader workers open their own maps
        return {**self.__dict__, "_maps": {}, "check": None}


class CacheCheck(threading.Thread):
    """Reads every block of the cache's files once, in order, comparing its CRC-32 with
    the manifest's (zlib releases the GIL while it sums, so training runs meanwhile);
    ``problem`` names the first block that differs."""

    def __init__(self, directory: Path, manifest: dict):
        super().__init__(name="paratrain-cache-check", daemon=True)
        self.directory, self.manifest = directory, manifest
        self.problem: str | None = None
        self.blocks_read = 0

    def run(self) -> None:
        for part in self.manifest["parts"]:
            try:
                with open(self.directory / part["name"], "rb") as handle:
                    for block, expected in enumerate(part["blocks"]):
                        if zlib.crc32(handle.read(BLOCK)) != expected:
                            self.problem = (
                                f"block {block} of {part['name']} (bytes {block * BLOCK:,} to "
                                f"{(block + 1) * BLOCK:,}) differs from its checksum"
                            )
                            return
                        self.blocks_read += 1
            except OSError as exc:
                self.problem = f"{part['name']} cannot be read ({exc.strerror or exc})"
                return


def agree_intact(cache: DecodedCache | None, wait: bool = False) -> None:
    """Every rank together: stop, named, when a node's background check found its cache
    damaged (after removing that cache's manifest, so the next start rebuilds it).
    ``wait``: for the checks to finish first (at the end of training)."""
    if cache is None:
        return
    mine = cache.damage(wait)
    if mine is not None:
        (cache.directory / MANIFEST).unlink(missing_ok=True)
        mine = f"{cache.directory}: {mine}"
    found = [problem for problem in comm.all_gather_object(mine) if problem]
    if found:
        raise AgreedUserError(
            f"the decoded-image cache is damaged: {found[0]}; its manifest is removed, so "
            "the next start builds it again (resume from the last checkpoint)"
        )


# ---------------------------------------------------------------------------- the manifest


def _checksums(path: Path) -> list[int]:
    sums = []
    with open(path, "rb") as handle:
        while True:
            block = handle.read(BLOCK)
            sums.append(zlib.crc32(block))
            if len(block) < BLOCK:
                return sums


def _write_manifest(directory: Path, kind: str, images: int, short: int, bad: list) -> None:
    index = directory / "index.npy"
    part_names = [RAW_FILE] if kind == RAW else sorted(p.name for p in directory.glob("part-*"))
    parts = [
        {
            "name": name,
            "bytes": (directory / name).stat().st_size,
            "blocks": _checksums(directory / name),
        }
        for name in part_names
    ]
    manifest = {
        "format": CACHE_FORMAT,
        "kind": kind,
        "images": images,
        "short_side": short,
        "quality": jpeg.QUALITY if kind == PACKED else None,
        "index_sha256": hashlib.sha256(index.read_bytes()).hexdigest(),
        "block_bytes": BLOCK,
        "parts": parts,
        "bad": bad,
    }
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest) + "\n")
    fsync(tmp)
    os.replace(tmp, directory / MANIFEST)


RAW_FILE = "data.u8"


def verify(directory: Path, images: int, short: int, kind: str = RAW) -> str | None:
    """None when ``directory`` looks like a whole cache of ``images`` images at ``short``
    by what is cheap to check (the manifest, the index's hash, every file's size); else
    what is wrong with it (so the run can say why it builds again). The blocks'
    checksums are checked while training runs (``DecodedCache.start_check``)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return "it has no manifest (an interrupted build, or damage found before)"
    except (OSError, ValueError) as exc:
        return f"its manifest cannot be read ({type(exc).__name__})"
    if not isinstance(manifest, dict) or manifest.get("format") != CACHE_FORMAT:
        return "it is of another format"
    if (manifest.get("images"), manifest.get("short_side"), manifest.get("kind")) != (
        images,
        short,
        kind,
    ):
        return "it holds other images"
    try:
        index = (directory / "index.npy").read_bytes()
        sizes = {
            part["name"]: (directory / part["name"]).stat().st_size for part in manifest["parts"]
        }
    except OSError as exc:
        return f"a file of it is missing ({exc.strerror})"
    if hashlib.sha256(index).hexdigest() != manifest.get("index_sha256"):
        return "its index differs from its manifest"
    for part in manifest["parts"]:
        if sizes[part["name"]] != part["bytes"]:
            return (
                f"its file {part['name']} has {sizes[part['name']]} bytes, its manifest says "
                f"{part['bytes']}"
            )
        if len(part["blocks"]) != part["bytes"] // BLOCK + 1:
            return "its checksums do not cover its data"
    return None


# ---------------------------------------------------------------------------- planning


@dataclass
class CachePlan:
    """What the cache of a data set would do: be read ("ready"), be built ("build"), or
    be left out ("skip", with the reason); ``kind``: raw or packed."""

    action: str
    directory: Path | None
    nbytes: int
    reason: str = ""
    shapes: np.ndarray | None = None  # (height, width) of every image, for a raw build
    kind: str = RAW


def _base(root: str | None) -> Path:
    return (Path(root) if root else default_cache_dir()) / "decoded"


def survey(
    samples: Samples | Sequence[tuple[str, int]],
    image_size: int,
    mode: str,
    max_gb: float,
    root: str | None,
    short: int | None = None,
    free: int | None = None,
    interpolation: str = "bilinear",
) -> CachePlan:
    """The plan for ``samples`` without writing anything; ``short``: the short side
    stored (default: what evaluation at ``image_size`` needs); ``free``: bytes the
    cache folder's disk has (auto mode takes packed JPEG only where they fit)."""
    samples = as_samples(samples)
    short = short or eval_resize(image_size)
    base = _base(root)
    if mode == "off":
        return CachePlan("skip", None, 0, "--cache off")
    wanted = kind_of(mode)
    for kind in [wanted] if wanted else [RAW, PACKED]:
        directory = base / cache_key(samples, short, kind, interpolation)
        if (directory / MANIFEST).exists() and verify(directory, len(samples), short, kind) is None:
            return CachePlan("ready", directory, DecodedCache(directory).nbytes, kind=kind)
    raw_bytes, exact = _raw_size(samples, short)
    budget = max_gb * 2**30
    if free is None:
        free = shutil.disk_usage(_existing(base)).free
    if wanted == RAW or (wanted is None and raw_bytes <= budget):
        shapes = exact if exact is not None else _shapes(samples, short)
        nbytes = int((shapes[:, 0] * shapes[:, 1] * 3).sum())
        if wanted is None and nbytes > budget:  # the estimate was under, the count is over
            return _packed_plan(samples, short, base, nbytes, budget, free, wanted, interpolation)
        reason = (
            ""
            if wanted
            else (f"raw pixels, {nbytes / 2**30:.2f} GB (within --cache-max-gb {max_gb:g})")
        )
        directory = base / cache_key(samples, short, RAW, interpolation)
        return CachePlan("build", directory, nbytes, reason, shapes)
    return _packed_plan(samples, short, base, raw_bytes, budget, free, wanted, interpolation)


def _existing(path: Path) -> Path:
    """``path``, or its nearest parent that exists (to ask its disk for free space)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _packed_plan(
    samples: Samples,
    short: int,
    base: Path,
    raw_bytes: int,
    budget: float,
    free: int,
    wanted,
    interpolation: str = "bilinear",
) -> CachePlan:
    packed = _packed_size(samples, short, raw_bytes, interpolation=interpolation)
    directory = base / cache_key(samples, short, PACKED, interpolation)
    if wanted is None:
        over = f"raw pixels would take {raw_bytes / 2**30:.1f} GB, over --cache-max-gb {budget / 2**30:g}"
        if packed * 1.1 > free:
            reason = f"{over}, and packed JPEG about {packed / 2**30:.1f} GB, more than the {free / 2**30:.1f} GB free"
            return CachePlan(
                "skip", directory, packed, reason + "; decoding every epoch", kind=PACKED
            )
        reason = f"packed JPEG, about {packed / 2**30:.1f} GB on disk ({over})"
        return CachePlan("build", directory, packed, reason, kind=PACKED)
    return CachePlan("build", directory, packed, "", kind=PACKED)


def _sample_rows(n: int) -> np.ndarray:
    """Up to SIZING_SAMPLE entries spread evenly (all of them when fewer)."""
    if n <= SIZING_SAMPLE:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, SIZING_SAMPLE).astype(np.int64))


def _shapes(samples: Samples, short: int, rows: np.ndarray | None = None) -> np.ndarray:
    rows = np.arange(len(samples)) if rows is None else rows
    bar = tqdm(
        rows.tolist(),
        desc="sizing image cache",
        unit="img",
        delay=1.0,
        leave=False,
        disable=not sys.stderr.isatty(),
    )
    return np.array([_shape_or_empty(samples, i, short) for i in bar], np.int64).reshape(-1, 2)


def _raw_size(samples: Samples, short: int) -> tuple[int, np.ndarray | None]:
    """Bytes of raw pixels, counted (with every shape) for small sets, else estimated
    from the headers of SIZING_SAMPLE entries."""
    rows = _sample_rows(len(samples))
    shapes = _shapes(samples, short, rows)
    total = int((shapes[:, 0] * shapes[:, 1] * 3).sum())
    if len(rows) == len(samples):
        return total, shapes
    return int(total * len(samples) / max(len(rows), 1)), None


def _packed_size(
    samples: Samples, short: int, raw_bytes: int, tries: int = 16, interpolation: str = "bilinear"
) -> int:
    """Bytes the packed cache will take: raw bytes times the JPEG ratio of a few entries."""
    raw = packed = 0
    for i in _sample_rows(len(samples))[:: max(1, min(len(samples), SIZING_SAMPLE) // tries)]:
        pixels, _ = _resized(samples, int(i), short, interpolation)
        if pixels is not None:
            raw += pixels.size
            packed += len(jpeg.encode(pixels))
    return int(raw_bytes * packed / raw) if raw else raw_bytes


def _resized(
    samples: Samples, i: int, short: int, interpolation: str = "bilinear"
) -> tuple[np.ndarray | None, str | None]:
    image, problem = read_rgb(samples.keys[i], short, samples.source)
    if image is None:
        return None, problem
    # the eval transform's own Resize
    resize = T.Resize(short, interpolation=INTERPOLATION[interpolation], antialias=True)
    return np.asarray(resize(image), dtype=np.uint8), None


# ---------------------------------------------------------------------------- building


def prepare(
    samples: Samples | Sequence[tuple[str, int]],
    image_size: int,
    mode: str,
    max_gb: float,
    root: str | None,
    workers: int,
    env: DistEnv | None = None,
    short: int | None = None,
    check: bool = True,
    interpolation: str = "bilinear",
) -> DecodedCache | None:
    """Open, or build, the cache of ``samples`` on every node of the job; None when off.

    Each node gets a cache holding every image (its ranks read any of them over the
    epochs), whether or not the nodes share a file system: the local rank 0 of each
    node plans for its node. A builder takes a file lock, so runs and nodes that share
    the folder build once while the others wait and reuse it; it writes into a
    temporary folder, then the manifest, then renames the folder into place. A cache
    that fails its cheap checks is rebuilt, and the run says why; ``check``: the node's
    first rank checks the blocks' checksums in the background. The cache is used on
    every node or on none.

    Building decodes every image, so it is also the screen for unreadable files: they
    are listed in ``cache.bad`` (kept in the manifest, so a ready cache needs no screen)."""
    if mode == "off":
        return None
    samples = as_samples(samples)
    env = env or DistEnv(
        rank=comm.rank(),
        world_size=comm.world_size(),
        local_rank=comm.rank(),
        local_world_size=comm.world_size(),
    )
    told = False
    short = short or eval_resize(image_size)
    base = _base(root)
    while True:
        mine = None
        if env.local_rank == 0:
            mine = _plan_node(samples, short, mode, max_gb, base, interpolation)
        plans = {n: plan for n, plan in comm.all_gather_object((env.node_rank, mine)) if plan}
        for action, _, _, reason in plans.values():
            if action == "error":
                raise AgreedUserError(reason)
        skipped = [reason for action, _, _, reason in plans.values() if action == "skip"]
        if skipped:
            get_logger().info(f"decoded-image cache off: {skipped[0]}")
            return None
        if all(action == "ready" for action, _, _, _ in plans.values()):
            directory = Path(plans[env.node_rank][2])
            cache = DecodedCache(directory, samples)
            if check and env.local_rank == 0:
                cache.start_check()
            return cache
        action, kind, directory, reason = plans[env.node_rank]
        if action == "build" and env.local_rank == 0 and reason:
            damaged = reason.startswith("it failed")
            say = get_logger().warning if damaged else get_logger().info
            say(f"decoded-image cache in {Path(directory).parent}: {reason}")
        if action == "wait" and env.local_rank == 0:
            if not told:
                get_logger().info(f"{reason}; waiting for it")
                told = True
            if not any(a == "build" for a, _, _, _ in plans.values()):
                time.sleep(1.0)  # another run builds it: look again in a moment
        building = action == "build"
        owner = building and env.local_rank == 0  # made the temporary folder, holds the lock
        try:
            bad = _built(building, samples, short, kind, directory, workers, env, interpolation)
            if owner:
                final = base / cache_key(samples, short, kind, interpolation)
                with told_if_full(directory, _planned_bytes.get(directory)):
                    _finish(Path(directory), final, kind, len(samples), short, bad)
        except BaseException:  # Ctrl-C, a full disk, a lost peer: no half-built folder left
            if owner:
                abandon(Path(directory))
            raise
        comm.barrier()


def _built(
    building: bool,
    samples: Samples,
    short: int,
    kind: str,
    directory: str,
    workers: int,
    env: DistEnv,
    interpolation: str,
) -> list:
    """Every builder's share decoded (a rank that builds nothing joins with none): the
    unreadable entries of all of them, or, where a builder's disk filled up, that one
    line on every rank."""
    bad: list = []
    full = None
    if building:
        try:
            bad = _build(samples, short, kind, Path(directory), workers, env, interpolation)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            full = str(DiskFull(directory, _planned_bytes.get(directory)))
    gathered = comm.all_gather_object((bad, full))
    for _, told in gathered:
        if told:
            raise AgreedUserError(told)
    return sorted({tuple(pair) for part, _ in gathered for pair in part})


def abandon(tmp: Path) -> None:
    """A build that will not finish: its temporary folder removed and its lock let go."""
    shutil.rmtree(tmp, ignore_errors=True)
    _planned_bytes.pop(str(tmp), None)
    key = tmp.name[1:].split(".tmp-")[0]
    handle = _held_locks.pop(key, None)
    if handle is not None:
        handle.release()


def remove_stale_builds(base: Path) -> list[Path]:
    """Temporary build folders (``.<key>.tmp-<host>-<pid>``) of this host whose builder
    is gone (a Ctrl-C, a kill, a full disk): removed, and returned. Another host's, and
    a live process's, are left alone."""
    removed = []
    host = socket.gethostname()
    for tmp in base.glob(".*.tmp-*"):
        owner, _, pid = tmp.name.rpartition(".tmp-")[2].rpartition("-")
        if owner != host or not pid.isdigit() or _alive(int(pid)):
            continue
        shutil.rmtree(tmp, ignore_errors=True)
        removed.append(tmp)
    if removed:
        get_logger().info(
            f"removed {len(removed)} unfinished cache build(s) left in {base} by processes "
            "that are gone"
        )
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _plan_node(
    samples: Samples,
    short: int,
    mode: str,
    max_gb: float,
    base: Path,
    interpolation: str = "bilinear",
) -> tuple:
    """(action, kind, folder, why) for this node: "ready" (a valid cache), "build" (into
    a temporary folder, this process holding the lock), "wait" (another process held the
    lock: it has finished; look again), "skip" or "error" (why)."""
    refused = "error" if mode != "auto" else "skip"
    wanted = kind_of(mode)
    problems = {}
    for kind in [wanted] if wanted else [RAW, PACKED]:
        final = base / cache_key(samples, short, kind, interpolation)
        if final.exists():
            problems[kind] = verify(final, len(samples), short, kind)
            if problems[kind] is None:
                return "ready", kind, str(final), ""
    try:
        base.mkdir(parents=True, exist_ok=True)
        lock = base / f"{hashlib.sha256(samples.digest().encode()).hexdigest()[:24]}-{short}.lock"
        handle = try_lock(lock)
    except OSError as exc:
        where = f"cannot write to {base} ({exc.strerror or exc})"
        if refused == "error":
            return "error", "", "", f"--cache {mode}: {where}"
        return "skip", "", "", f"{where}; decoding every epoch"
    if handle is None:  # never block here: the holder may be a node of this job
        return "wait", "", "", f"another process is building the decoded-image cache in {base}"
    for kind in [wanted] if wanted else [RAW, PACKED]:
        final = base / cache_key(samples, short, kind, interpolation)
        if final.exists() and verify(final, len(samples), short, kind) is None:
            handle.release()  # finished while we looked
            return "ready", kind, str(final), ""
    remove_stale_builds(base)  # before the free space is counted: theirs is back
    free = shutil.disk_usage(base).free
    plan = survey(
        samples,
        0,
        mode,
        max_gb,
        str(base.parent),
        short=short,
        free=free,
        interpolation=interpolation,
    )
    if plan.action == "skip":
        handle.release()
        return "skip", "", "", plan.reason
    if free < plan.nbytes + 64 * 2**20:
        handle.release()
        where = (
            f"the {plan.kind} cache needs {plan.nbytes / 2**30:.2f} GB and {base} has "
            f"{free / 2**30:.2f} GB free"
        )
        return refused, "", "", f"--cache {mode}: {where}" if refused == "error" else where
    assert plan.directory is not None
    key = plan.directory.name
    tmp = base / f".{key}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    if plan.kind == RAW and (lacking := _lay_out_raw(tmp, plan, base)) is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        handle.release()
        return refused, "", "", f"--cache {mode}: {lacking}" if refused == "error" else lacking
    _held_locks[key] = handle
    _planned_bytes[str(tmp)] = plan.nbytes
    reason = plan.reason
    if problems.get(plan.kind):
        reason = f"it failed its check: {problems[plan.kind]}; building it again"
    return "build", plan.kind, str(tmp), reason


def _lay_out_raw(tmp: Path, plan: CachePlan, base: Path) -> str | None:
    """A raw build's index written and its data file's space reserved in ``tmp``; why
    not (a full disk), else None."""
    assert plan.shapes is not None  # a raw build has every image's shape
    sizes = plan.shapes[:, 0] * plan.shapes[:, 1] * 3
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    rows = np.column_stack([np.zeros_like(offsets), offsets, sizes, plan.shapes])
    np.save(tmp / "index.npy", rows.astype(np.int64))
    try:
        reserve(tmp / RAW_FILE, max(plan.nbytes, 1))
    except OSError as exc:
        return f"cannot reserve {plan.nbytes / 2**30:.2f} GB in {base} ({exc.strerror or exc})"
    return None


def reserve(path: Path, nbytes: int) -> None:
    """A file of ``nbytes`` with its disk blocks allocated now, so a full disk is an error
    here rather than a crash (SIGBUS) when a memory-mapped write finds no room later;
    where the file system cannot allocate ahead, a sparse file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            if exc.errno not in (95, 22):  # EOPNOTSUPP, EINVAL: not supported here
                raise
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def _finish(tmp: Path, final: Path, kind: str, images: int, short: int, bad: list) -> None:
    """The node's builder: the index whole, the data on disk, the manifest last, the
    folder renamed into place (an invalid old one out of the way first), the lock let go."""
    if kind == PACKED:
        index = np.zeros((images, 5), np.int64)
        for found in sorted(tmp.glob("rows-*.npy")):
            rows = np.load(found)
            index[rows[:, 0]] = rows[:, 1:]
            found.unlink()
        np.save(tmp / "index.npy", index)
    for part in tmp.glob("part-*") if kind == PACKED else [tmp / RAW_FILE]:
        fsync(part)  # every process's writes reach the disk before the manifest
    _write_manifest(tmp, kind, images, short, [list(pair) for pair in bad])
    swap_in(tmp, final)
    handle = _held_locks.pop(final.name, None)
    if handle is not None:
        handle.release()


class _Decode(Dataset):
    """Item k: decode the k-th chunk of entries; raw: write each into its slot of the data
    file, and only (index, problem) pairs go back (sending every decoded image back through
    the loader's shared-memory queue cost more than decoding it: 3,000 images of 400x300
    took 5.0 s with two workers, the same as one process alone); packed: each comes back
    as its small JPEG's bytes, which the rank appends to its part file."""

    CHUNK = 16

    def __init__(
        self,
        samples: Samples,
        ids: list[int],
        short: int,
        directory: Path,
        kind: str,
        interpolation: str = "bilinear",
    ):
        self.samples, self.directory, self.short, self.kind = samples, directory, short, kind
        self.interpolation = interpolation
        self.chunks = [ids[k : k + self.CHUNK] for k in range(0, len(ids), self.CHUNK)]
        self.index = np.load(directory / "index.npy") if kind == RAW else None
        self._data: np.memmap | None = None  # opened in the process that writes

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, k: int) -> list[tuple[int, str | None, tuple | None]]:
        done = []
        for i in self.chunks[k]:
            pixels, problem = _resized(self.samples, i, self.short, self.interpolation)
            stored = None
            if pixels is not None and self.kind == PACKED:
                stored = (pixels.shape[0], pixels.shape[1], jpeg.encode(pixels))
            elif pixels is not None:
                assert self.index is not None
                if self._data is None:
                    self._data = np.memmap(self.directory / RAW_FILE, dtype=np.uint8, mode="r+")
                _, offset, nbytes, height, width = (int(v) for v in self.index[i])
                if pixels.shape != (height, width, 3):
                    problem = "changed while the cache was built"
                else:
                    self._data[offset : offset + nbytes] = pixels.reshape(-1)
            done.append((i, problem, stored))
        return done


def _build(
    samples: Samples,
    short: int,
    kind: str,
    directory: Path,
    workers: int,
    env: DistEnv,
    interpolation: str = "bilinear",
) -> list:
    """This rank's share of its node's build: every local_world-th entry from its local
    rank on. Returns (key, why) of the unreadable."""
    local_rank, local_world = env.local_rank, env.local_world_size
    mine = list(range(local_rank, len(samples), local_world))
    loader = DataLoader(
        _Decode(samples, mine, short, directory, kind, interpolation),
        batch_size=None,
        num_workers=workers,
        worker_init_fn=leave_stop_signals_to_the_rank,
    )
    bad, rows = [], []
    out = open(directory / f"part-{local_rank:03d}.jpg", "wb") if kind == PACKED else None
    offset = 0
    with tqdm(
        total=len(samples),
        desc="building image cache",
        unit="img",
        delay=1.0,
        disable=local_rank != 0 or not sys.stderr.isatty(),
        leave=False,
    ) as bar:
        try:
            for done in loader:
                for i, problem, stored in done:
                    if problem:
                        bad.append((samples.keys[i], problem))
                    elif stored is not None and out is not None:
                        height, width, encoded = stored
                        out.write(encoded)
                        rows.append((i, local_rank, offset, len(encoded), height, width))
                        offset += len(encoded)
                bar.update(local_world * len(done))
        finally:
            if out is not None:
                out.close()
    if kind == PACKED:
        np.save(directory / f"rows-{local_rank:03d}.npy", np.array(rows, np.int64).reshape(-1, 6))
    return bad


# ---------------------------------------------------------------------------- datasets


class CachedImages(AugmentedSamples):
    """Samples read from the cache, each from the row its entry was stored in."""

    def __init__(self, samples, cache: DecodedCache, transform: Callable | None = None):
        super().__init__(samples, transform)
        self.cache = cache
        self.rows = cache.slots(self.samples)

    def load(self, index: int) -> torch.Tensor:
        """The sample's pixels from the cache instead of its file."""
        return self.cache.image(int(self.rows[index]))


def _to_float(image: torch.Tensor) -> torch.Tensor:
    return image.float().div(255)  # as ToTensor does, so both paths agree bit for bit


def cached_eval_transform(
    size: int, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The evaluation transform on cached uint8 images: the same tensors as the decode path's."""
    return v2.Compose([v2.CenterCrop(size), _to_float, v2.Normalize(list(mean), list(std))])
