"""Screen a data set for unreadable images before training: in parallel, and only what
changed since the last screen.

Every rank decodes a disjoint share of the entries to screen (rank r takes r, r+W, ...)
with its loader workers, and the findings are gathered, so every rank ends with the same
list of bad files and, under ``--bad-images skip``, the same list of good ones.

The verdicts are kept (``<cache dir>/screened/``, one file per source), keyed like the
decoded cache: an entry's key, size and modification time. A start over unchanged data
finds the whole set's digest there and screens nothing (an elastic restart included); a
changed or added entry is screened alone. A sharded source whose nodes read different
entries screens each node's own, with the node's ranks.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from paratrain.data.folder import DataSplit, image_problem, leave_stop_signals_to_the_rank
from paratrain.data.samples import Samples, as_samples
from paratrain.distributed import comm
from paratrain.errors import AgreedUserError
from paratrain.files import replaced
from paratrain.log import get_logger

MEMORY_FORMAT = 1


class _Probe(Dataset):
    def __init__(self, samples: Samples, rows: np.ndarray):
        self.samples, self.rows = samples, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[str, str]:
        key = self.samples.keys[int(self.rows[index])]
        return key, image_problem(key, self.samples.source) or ""


def find_bad_images(
    samples: Samples | Sequence[str],
    rank: int,
    world: int,
    workers: int,
    show: bool,
    rows: np.ndarray | None = None,
) -> list[tuple[str, str]]:
    """(key, reason) for every unreadable entry among ``rows`` (default: all), the same
    list on every rank (a collective: every rank of the job calls it). ``samples``: or
    files' paths."""
    if not isinstance(samples, Samples):
        samples = Samples.of((path, 0) for path in samples)
    rows = np.arange(len(samples)) if rows is None else rows
    loader = DataLoader(
        _Probe(samples, rows[rank::world]),
        batch_size=None,
        num_workers=workers,
        worker_init_fn=leave_stop_signals_to_the_rank,
    )
    found = []
    with tqdm(
        total=len(rows),
        desc="checking images",
        unit="img",
        delay=1.0,
        disable=not (show and sys.stderr.isatty()),
        leave=False,
    ) as bar:
        for key, problem in loader:
            if problem:
                found.append((key, problem))
            bar.update(world)
    return sorted(pair for part in comm.all_gather_object(found) for pair in part)


# ---------------------------------------------------------------------------- memory


def entry_hashes(samples: Samples) -> np.ndarray:
    """A 64-bit hash of each entry's key, size and modification time."""
    sizes, versions = samples.sizes.tolist(), samples.versions.tolist()
    return np.array(
        [
            int.from_bytes(
                hashlib.blake2b(f"{key}\0{size}\0{version}".encode(), digest_size=8).digest(),
                "little",
            )
            for key, size, version in zip(samples.keys, sizes, versions, strict=True)
        ],
        dtype=np.uint64,
    )


@dataclass
class Recalled:
    """What the screen's memory knows of a data set: the rows it has no verdict for (new
    or changed entries), and the known bad among the others."""

    unknown: np.ndarray
    bad: list[tuple[str, str]]
    hashes: np.ndarray | None  # every entry's (None when the whole set was known)


class ScreenMemory:
    """The kept verdicts of one source, in ``folder/screened/<source hash>.npz``."""

    def __init__(self, folder: Path | None, samples: Samples):
        self.samples = samples
        self.digest = samples.digest()
        identity = samples.source.identity() if samples.source is not None else "files"
        name = hashlib.sha256(identity.encode()).hexdigest()[:24]
        self.path = folder / "screened" / f"{name}.npz" if folder is not None else None

    def _read(self) -> dict | None:
        if self.path is None or not self.path.is_file():
            return None
        try:
            with np.load(self.path, allow_pickle=False) as kept:
                record = {name: kept[name] for name in kept.files}
        except (OSError, ValueError, KeyError, EOFError):
            return None  # unreadable memory is no memory: screen again
        if int(record.get("format", -1)) != MEMORY_FORMAT:
            return None
        return record

    def recall(self) -> Recalled:
        record = self._read()
        if record is None:
            return Recalled(np.arange(len(self.samples)), [], None)
        if str(record["digest"]) == self.digest:  # nothing changed: no per-entry work
            keys, why = record["set_bad_keys"].tolist(), record["set_bad_why"].tolist()
            return Recalled(np.zeros(0, np.int64), list(zip(keys, why, strict=True)), None)
        hashes = entry_hashes(self.samples)
        known = np.isin(hashes, record["hashes"])
        bad_hashes = dict(
            zip(record["bad_hashes"].tolist(), record["bad_why"].tolist(), strict=True)
        )
        bad = [
            (self.samples.keys[i], bad_hashes[h])
            for i, h in enumerate(hashes.tolist())
            if known[i] and h in bad_hashes
        ]
        return Recalled(np.flatnonzero(~known), bad, hashes)

    def keep(self, bad: list[tuple[str, str]], hashes: np.ndarray | None) -> None:
        """Remember ``bad`` as the verdicts on every entry, with what was known of other
        entries of the source (a verdict on a key, size and time never changes); written
        whole or not at all: a folder that cannot be written only costs the next start
        its screen."""
        if self.path is None:
            return
        hashes = entry_hashes(self.samples) if hashes is None else hashes
        named = {key for key, _ in bad}
        rows = [i for i, key in enumerate(self.samples.keys) if key in named] if bad else []
        keys = [self.samples.keys[i] for i in rows]
        why = dict(bad)
        every, every_bad, every_why = hashes, hashes[rows], [why[k] for k in keys]
        before = self._read()
        if before is not None:
            every = np.union1d(before["hashes"], hashes)
            kept = ~np.isin(before["bad_hashes"], every_bad)
            every_bad = np.concatenate([before["bad_hashes"][kept], every_bad])
            every_why = before["bad_why"][kept].tolist() + every_why
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with replaced(self.path) as out:
                np.savez(
                    out,
                    format=np.array(MEMORY_FORMAT),
                    digest=np.array(self.digest),
                    set_bad_keys=np.array(keys, dtype=str),
                    set_bad_why=np.array([why[k] for k in keys], dtype=str),
                    hashes=np.unique(every).astype(np.uint64),
                    bad_hashes=np.asarray(every_bad, np.uint64),
                    bad_why=np.array(every_why, dtype=str),
                )
        except OSError as exc:
            get_logger().info(f"the screen's verdicts are not kept ({exc.strerror or exc})")


def screened(
    samples: Samples,
    rank: int,
    world: int,
    workers: int,
    folder: Path | None,
    node: int = 0,
    local: tuple[int, int] | None = None,
) -> list[tuple[str, str]]:
    """(key, reason) of every unreadable entry of ``samples``, the same on every rank:
    what the memory in ``folder`` knows, plus a screen of what it does not.

    A collective. ``local``: (local rank, local world) where each node holds its own
    entries (a sharded source over nodes): each node's ranks screen its entries."""
    memory = ScreenMemory(folder, samples)
    first = (local[0] if local else rank) == 0
    view = memory.recall() if first else None
    views = {n: v for n, v in comm.all_gather_object((node, view)) if v is not None}
    recalled = views[node] if local else views[min(views)]
    total = comm.all_gather_object(len(recalled.unknown))
    if not any(total):
        return sorted(recalled.bad)
    share_rank, share_world = local if local else (rank, world)
    found = find_bad_images(
        samples, share_rank, share_world, workers, show=rank == 0, rows=recalled.unknown
    )
    if local:  # every node's findings came back: keep this node's
        mine = {samples.keys[int(i)] for i in recalled.unknown}
        found = [pair for pair in found if pair[0] in mine]
    bad = sorted(set(recalled.bad) | set(found))
    if first:
        memory.keep(bad, recalled.hashes)
    return bad


def without_unreadable(
    samples: Samples, folder: Path | None = None
) -> tuple[Samples, list[tuple[str, str]]]:
    """The samples whose files can be read, and (key, why) of the others: how a run
    under ``--bad-images skip`` left them out, for `paratrain eval` to do the same."""
    samples = as_samples(samples)
    bad = screened(samples, 0, 1, 0, folder)
    return leave_out(samples, {key for key, _ in bad}), bad


def leave_out(samples: Samples, bad: set[str]) -> Samples:
    if not bad:
        return samples
    return samples.where(np.array([key not in bad for key in samples.keys], dtype=bool))


def screen(
    split: DataSplit,
    policy: str,
    rank: int,
    world: int,
    workers: int,
    run_dir: Path | None,
    found: list[tuple[str, str]] | None = None,
    memory: Path | None = None,
    node: int = 0,
    local: tuple[int, int] | None = None,
) -> DataSplit:
    """Apply ``--bad-images error|skip`` to a split; report ignored non-image files.
    ``found``: the unreadable entries when already known (the cache build decoded them);
    ``memory``: the folder that keeps the screen's verdicts (see ``screened``)."""
    log = get_logger()
    if split.ignored:
        log.info(f"ignored {split.ignored} file(s) without an image extension in {split.root}")
    if found is None:
        found = screened(split.train + split.val, rank, world, workers, memory, node, local)
    bad = sorted(set(found) | set(split.missing))
    if not bad:
        return split
    listing = "; ".join(f"{key} ({why})" for key, why in bad)
    shards = sum(key.startswith("shard ") for key, _ in bad)  # a source's whole shard
    what = f"{len(bad) - shards} unreadable image(s)" + (
        f", {shards} bad shard(s)" if shards else ""
    )
    if policy == "error":
        raise AgreedUserError(f"{what} (--bad-images skip leaves them out): {listing}")
    bad_keys = {key for key, _ in bad}
    if run_dir is not None and rank == 0:
        (run_dir / "bad_images.txt").write_text("".join(f"{k}\t{w}\n" for k, w in bad))
    listed = f"; listed in {run_dir / 'bad_images.txt'}" if run_dir is not None else ""
    log.info(f"skipping {what}{listed}")
    kept = replace(
        split,
        train=leave_out(split.train, bad_keys),
        val=leave_out(split.val, bad_keys),
        missing=[],
    )
    for name, part in (("train", kept.train), ("val", kept.val)):
        present = set(np.unique(part.labels).tolist())
        missing = [c for i, c in enumerate(kept.classes) if i not in present]
        if missing:
            raise AgreedUserError(
                f"after skipping unreadable images, {name} has no images of class(es) {missing}"
            )
    return kept
