"""Building the cache on every node of the job (``prepare``). The local rank 0 of each node
plans for its node (``choose``); a builder takes a file lock, so runs and nodes that share
the folder build once while the others wait and reuse it. Ranks decode disjoint shares
in parallel into a temporary folder; the node's first rank writes the manifest and renames
the folder into place. A build that is interrupted or fails removes its own folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from paratrain.data.cache.base import cache_base, cache_key, kind, resized
from paratrain.data.cache.choose import ready, survey
from paratrain.data.cache.read import DecodedCache
from paratrain.data.cache.verify import write_manifest
from paratrain.data.folder import leave_stop_signals_to_the_rank
from paratrain.data.samples import Samples, as_samples
from paratrain.data.transforms import eval_resize
from paratrain.distributed import comm
from paratrain.distributed.env import DistEnv
from paratrain.errors import AgreedUserError, DiskFull, is_disk_full, told_if_full
from paratrain.files import fsync, swap_in, try_lock
from paratrain.log import get_logger

if TYPE_CHECKING:
    from filelock import BaseFileLock

_held_locks: dict[str, BaseFileLock] = {}  # cache key -> its build lock, while building
_planned_bytes: dict[str, int] = {}  # a build's temporary folder -> the space it planned


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
    epochs), whether or not the nodes share a file system. A cache that fails its cheap
    checks is rebuilt, and the run says why; ``check``: the node's first rank checks the
    blocks' checksums in the background. The cache is used on every node or on none.

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
    short = short or eval_resize(image_size)
    base, told = cache_base(root), False
    while True:
        mine = None
        if env.local_rank == 0:
            mine = _plan_node(samples, short, mode, max_gb, base, interpolation)
        plans = {n: plan for n, plan in comm.all_gather_object((env.node_rank, mine)) if plan}
        done, cache = _settled(plans, env, samples, check)
        if done:
            return cache
        action, kind_name, directory, reason = plans[env.node_rank]
        told = _say(action, reason, directory, env, told, plans)
        _build_or_join(action == "build", samples, short, kind_name, directory, workers, env,
                       interpolation, base)  # fmt: skip
        comm.barrier()


def _settled(
    plans: dict, env: DistEnv, samples: Samples, check: bool
) -> tuple[bool, DecodedCache | None]:
    """Whether the nodes' plans end the loop (an error, a node that skips, every node
    ready), and the cache then."""
    for action, _, _, reason in plans.values():
        if action == "error":
            raise AgreedUserError(reason)
    skipped = [reason for action, _, _, reason in plans.values() if action == "skip"]
    if skipped:
        get_logger().info(f"decoded-image cache off: {skipped[0]}")
        return True, None
    if not all(action == "ready" for action, _, _, _ in plans.values()):
        return False, None
    cache = DecodedCache(Path(plans[env.node_rank][2]), samples)
    if check and env.local_rank == 0:
        cache.start_check()
    return True, cache


def _say(action: str, reason: str, directory: str, env: DistEnv, told: bool, plans: dict) -> bool:
    """The node's first rank says why it builds, or that it waits (once); whether told."""
    if env.local_rank != 0:
        return told
    if action == "build" and reason:
        say = get_logger().warning if reason.startswith("it failed") else get_logger().info
        say(f"decoded-image cache in {Path(directory).parent}: {reason}")
    if action == "wait":
        if not told:
            get_logger().info(f"{reason}; waiting for it")
            told = True
        if not any(a == "build" for a, _, _, _ in plans.values()):
            time.sleep(1.0)  # another run builds it: look again in a moment
    return told


def _build_or_join(
    building: bool,
    samples: Samples,
    short: int,
    kind_name: str,
    directory: str,
    workers: int,
    env: DistEnv,
    interpolation: str,
    base: Path,
) -> None:
    owner = building and env.local_rank == 0  # made the temporary folder, holds the lock
    try:
        bad = _built(building, samples, short, kind_name, directory, workers, env, interpolation)
        if owner:
            final = base / cache_key(samples, short, kind_name, interpolation)
            with told_if_full(directory, _planned_bytes.get(directory)):
                _finish(Path(directory), final, kind_name, len(samples), short, bad)
    except BaseException:  # Ctrl-C, a full disk, a lost peer: no half-built folder left
        if owner:
            abandon(Path(directory))
        raise


def _built(
    building: bool,
    samples: Samples,
    short: int,
    kind_name: str,
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
            bad = _build(samples, short, kind_name, Path(directory), workers, env, interpolation)
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
    problems = ready(samples, short, mode, base, interpolation)
    for name, problem in problems.items():
        if problem is None:
            return "ready", name, str(base / cache_key(samples, short, name, interpolation)), ""
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
    for name, problem in ready(samples, short, mode, base, interpolation).items():
        if problem is None:
            handle.release()  # finished while we looked
            return "ready", name, str(base / cache_key(samples, short, name, interpolation)), ""
    planned = _start_build(samples, short, mode, max_gb, base, interpolation, handle)
    if planned[0] == "build" and problems.get(planned[1]):
        why = f"it failed its check: {problems[planned[1]]}; building it again"
        planned = (*planned[:3], why)
    return planned


def _start_build(
    samples: Samples,
    short: int,
    mode: str,
    max_gb: float,
    base: Path,
    interpolation: str,
    handle: Any,
) -> tuple:
    """With the lock held: the plan made, the temporary folder laid out (and the lock
    kept) for a build; else the lock let go and why not."""
    refused = "error" if mode != "auto" else "skip"
    remove_stale_builds(base)  # before the free space is counted: theirs is back
    free = shutil.disk_usage(base).free
    plan = survey(samples, 0, mode, max_gb, str(base.parent), short, free, interpolation)
    lacking = None
    if plan.action == "skip":
        handle.release()
        return "skip", "", "", plan.reason
    if free < plan.nbytes + 64 * 2**20:
        lacking = (
            f"the {plan.kind} cache needs {plan.nbytes / 2**30:.2f} GB and {base} has "
            f"{free / 2**30:.2f} GB free"
        )
    assert plan.directory is not None
    key = plan.directory.name
    tmp = base / f".{key}.tmp-{socket.gethostname()}-{os.getpid()}"
    if lacking is None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        lacking = kind(plan.kind).lay_out(tmp, plan.shapes, plan.nbytes)
    if lacking is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        handle.release()
        return refused, "", "", f"--cache {mode}: {lacking}" if refused == "error" else lacking
    _held_locks[key] = handle
    _planned_bytes[str(tmp)] = plan.nbytes
    return "build", plan.kind, str(tmp), plan.reason


def _finish(tmp: Path, final: Path, kind_name: str, images: int, short: int, bad: list) -> None:
    """The node's builder: the index whole, the data on disk, the manifest last, the
    folder renamed into place (an invalid old one out of the way first), the lock let go."""
    kind(kind_name).finish(tmp, images)
    for part in kind(kind_name).part_names(tmp):
        fsync(tmp / part)  # every process's writes reach the disk before the manifest
    write_manifest(tmp, kind_name, images, short, [list(pair) for pair in bad])
    swap_in(tmp, final)
    handle = _held_locks.pop(final.name, None)
    if handle is not None:
        handle.release()


class _Decode(Dataset):
    """Item k: decode the k-th chunk of entries and store each as its kind does; only
    (index, problem, payload) come back (raw writes each image into its slot of the data
    file, so only the problem does: sending every decoded image back through the loader's
    shared-memory queue cost more than decoding it, 3,000 images of 400x300 took 5.0 s
    with two workers, the same as one process alone; packed sends its small JPEG back)."""

    CHUNK = 16

    def __init__(
        self,
        samples: Samples,
        ids: list[int],
        short: int,
        directory: Path,
        kind_name: str,
        interpolation: str = "bilinear",
    ):
        self.samples, self.directory, self.short = samples, directory, short
        self.kind_name, self.interpolation = kind_name, interpolation
        self.chunks = [ids[k : k + self.CHUNK] for k in range(0, len(ids), self.CHUNK)]
        self._stored: Any = None  # made in the process that writes

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, k: int) -> list[tuple[int, str | None, Any]]:
        if self._stored is None:
            self._stored = kind(self.kind_name).stored(self.directory)
        done = []
        for i in self.chunks[k]:
            pixels, problem = resized(self.samples, i, self.short, self.interpolation)
            payload = None
            if pixels is not None:
                problem, payload = self._stored.store(i, pixels)
            done.append((i, problem, payload))
        return done


def _build(
    samples: Samples,
    short: int,
    kind_name: str,
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
        _Decode(samples, mine, short, directory, kind_name, interpolation),
        batch_size=None,
        num_workers=workers,
        worker_init_fn=leave_stop_signals_to_the_rank,
    )
    bad = []
    collected = kind(kind_name).collected(directory, local_rank)
    shown = local_rank == 0 and sys.stderr.isatty()
    with tqdm(total=len(samples), desc="building image cache", unit="img", delay=1.0,
              disable=not shown, leave=False) as bar:  # fmt: skip
        try:
            for done in loader:
                for i, problem, payload in done:
                    if problem:
                        bad.append((samples.keys[i], problem))
                    elif payload is not None:
                        collected.add(i, payload)
                bar.update(local_world * len(done))
        finally:
            collected.close()
    return bad
