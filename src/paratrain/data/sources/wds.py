"""WebDataset shards: ``wds:PATTERN``, local paths or any URL fsspec opens (``{000..099}``
expands), or a shard index (``wds:shards.json``). Each sample's image member and its class
from a ``.cls`` member (a number, or a class name; names from ``classes.txt`` beside the
shards); shards not on this machine are copied once into the cache folder, and each node
copies only the shards its ranks read (pip install 'paratrain[webdataset]').
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import BinaryIO

import numpy as np

from paratrain.data.samples import PackedStrings, Samples
from paratrain.data.sources.base import Listing, Source, SourceKind, SourceOptions, is_image
from paratrain.errors import UserError
from paratrain.files import replaced, write_atomic

PREFIX = "wds:"

LABEL_MEMBERS = ("cls", "label", "target", "cls2")


def expand_pattern(pattern: str) -> list[str]:
    """A shard pattern's URLs: ``{000..099}`` and ``{a,b}`` expanded (braceexpand, as
    webdataset expands them)."""
    try:
        from braceexpand import braceexpand
    except ImportError:
        from paratrain.version import install_extra

        raise UserError(
            f"--data wds:... needs the webdataset package: {install_extra('webdataset')}"
        ) from None
    return list(braceexpand(pattern))


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _unfinished(path: str, end: int, samples: int) -> str:
    """Why a tar shard is unfinished ('' if it is whole): an archive ends in two zero
    blocks after its last member, and a writer killed mid-shard leaves none. Python's
    tarfile reads the end of the file at a header as a normal end, so without this a
    shard cut between two members reads as a shorter one."""
    with open(path, "rb") as handle:
        handle.seek(end)
        tail = handle.read(2 * tarfile.BLOCKSIZE)
    if len(tail) == 2 * tarfile.BLOCKSIZE and not tail.strip(b"\0"):
        return ""
    return (
        f"unfinished: no end-of-archive blocks after its {samples} samples "
        "(a writer stopped mid-shard?)"
    )


class WebDatasetSource(Source):
    """WebDataset shards (tar files): each sample is the members sharing a key. Its key
    here is ``<shard>:<offset>:<size>`` (where the image member's bytes lie), so a sample
    is read with one seek; each shard's index is made once and kept in the cache folder."""

    sharded = True

    def __init__(self, spec: str, cache_dir: Path, val_pattern: str | None = None):
        self.name, self.cache_dir = spec, Path(cache_dir)
        self.counts: dict[str, int] = {}  # a shard's sample count, where an index says it
        self.urls = self._expand(spec[len(PREFIX) :])
        if val_pattern and val_pattern.startswith(PREFIX):
            val_pattern = val_pattern[len(PREFIX) :]
        self.val_urls = self._expand(val_pattern) if val_pattern else []
        if not self.urls:
            raise UserError(f"--data {spec}: the pattern names no shard")
        self.local: dict[int, str] = {}  # shard number -> a path on this machine

    def _expand(self, pattern: str) -> list[str]:
        """A pattern's shards, or those of a shard index (``wds:shards.json``, the
        ``shardlist`` of ``{"url", "nsamples"}`` that webdataset's wids writes; a relative
        url is beside the index), whose counts each shard is then checked against."""
        if not pattern.endswith(".json"):
            return expand_pattern(pattern)
        path = Path(pattern[len("file://") :] if pattern.startswith("file://") else pattern)
        try:
            shards = json.loads(path.read_text())["shardlist"]
            urls = [u if "://" in u else str(path.parent / u) for u in (s["url"] for s in shards)]
            self.counts.update(
                {
                    u: int(s["nsamples"])
                    for u, s in zip(urls, shards, strict=True)
                    if "nsamples" in s
                }
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise UserError(f"--data wds: {path} is not a readable shard index ({exc})") from None
        return urls

    def identity(self) -> str:
        return f"wds:{','.join(self.urls + self.val_urls)}"

    def _shards(self, node: int, nodes: int) -> list[tuple[int, str, int]]:
        """(shard number, URL, side) of the shards this node reads: every nodes-th from
        node on, training shards first, then validation shards."""
        every = [(i, url, 0) for i, url in enumerate(self.urls)]
        every += [(len(self.urls) + i, url, 1) for i, url in enumerate(self.val_urls)]
        return [s for k, s in enumerate(every) if k % nodes == node] if nodes > 1 else every

    def _fetch(self, url: str) -> str:
        """A path on this machine: the URL's own, or a copy in the cache folder made once
        (under a lock: runs and ranks started together copy it once)."""
        if _is_local(url):
            path = url[len("file://") :] if url.startswith("file://") else url
            if not Path(path).is_file():
                raise UserError(f"--data wds: shard not found: {path}")
            return path
        import fsspec
        from filelock import FileLock

        folder = self.cache_dir / "shards" / hashlib.sha256(url.encode()).hexdigest()[:16]
        target = folder / Path(url.split("?")[0]).name
        if target.is_file():
            return str(target)
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder / ".lock")):
            if not target.is_file():
                try:
                    with fsspec.open(url, "rb") as remote, replaced(target) as local:
                        while chunk := remote.read(8 << 20):
                            local.write(chunk)
                except OSError as exc:
                    raise UserError(f"--data wds: cannot fetch {url}: {exc}") from None
        return str(target)

    def _index(self, path: str) -> tuple[list[tuple[str, int, int, str]], str]:
        """(sample key, offset, size, label text) of each sample with an image in a shard,
        read from its tar headers once and kept beside it in the cache folder; and what
        is wrong with the shard ('' when nothing: see :func:`_unfinished`)."""
        stat = os.stat(path)
        tag = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[
            :16
        ]
        kept = self.cache_dir / "shard-index" / f"{tag}.v2.json"
        if kept.is_file():
            found = json.loads(kept.read_text())
            rows = [(str(k), int(o), int(n), str(c)) for k, o, n, c in found["rows"]]
            return rows, str(found["defect"])
        images: dict[str, tuple[int, int]] = {}
        labels: dict[str, str] = {}
        try:
            with tarfile.open(path) as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    base = os.path.basename(member.name)
                    folder = os.path.dirname(member.name)
                    stem, _, extension = base.partition(".")
                    key = f"{folder}/{stem}" if folder else stem
                    if is_image(base) and key not in images:
                        images[key] = (member.offset_data, member.size)
                    elif extension in LABEL_MEMBERS and key not in labels:
                        handle = tar.extractfile(member)
                        labels[key] = handle.read().decode().strip() if handle else ""
                defect = _unfinished(path, tar.offset, len(images))
        except (tarfile.TarError, OSError) as exc:
            raise UserError(f"--data wds: {path} is not a readable tar shard ({exc})") from None
        rows = [
            (key, offset, size, labels.get(key, ""))
            for key, (offset, size) in sorted(images.items())
        ]
        kept.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(kept, json.dumps({"rows": rows, "defect": defect}).encode())
        return rows, defect

    def list_entries(self, node: int = 0, nodes: int = 1) -> Listing:
        shards = self._shards(node, nodes)
        entries: list[
            tuple[int, str, int, int, str, int]
        ] = []  # shard, key, offset, size, label, side
        changed: list[int] = []  # each sample's shard's modification time
        bad: list[tuple[str, str]] = []  # (shard, why): left out, or refused, by --bad-images
        for number, url, side in shards:
            path = self._fetch(url)
            self.local[number] = path
            mtime = os.stat(path).st_mtime_ns
            rows, defect = self._index(path)
            if not defect and url in self.counts and self.counts[url] != len(rows):
                defect = f"{len(rows)} samples where its index says {self.counts[url]}"
            if defect:
                bad.append((f"shard {path}", defect))
                continue
            for key, offset, size, label in rows:
                entries.append((number, key, offset, size, label, side))
                changed.append(mtime)
        missing = [e for e in entries if not e[4]]
        if missing:
            raise UserError(
                f"--data {self.name}: {len(missing)} sample(s) have no class member "
                f"(.{', .'.join(LABEL_MEMBERS)}), e.g. {missing[0][1]}"
            )
        classes = self._classes(sorted({e[4] for e in entries}))
        index = {name: i for i, name in enumerate(classes)}
        numeric = all(label.isdigit() for *_, label, _ in entries)
        keys = PackedStrings.of(f"{n}:{offset}:{size}" for n, _, offset, size, _, _ in entries)
        labels = np.array(
            [
                int(label) if numeric and label not in index else index[label]
                for *_, label, _ in entries
            ],
            np.int32,
        )
        sides = np.array([side for *_, side in entries], np.int8)
        samples = Samples(keys, labels, self, np.array([e[3] for e in entries]), np.array(changed))
        given = bool(self.val_urls)
        layout = "given" if given else "split"
        return Listing(classes, samples, sides if given else None, layout, missing=bad)

    def _classes(self, labels: list[str]) -> list[str]:
        """Class names: classes.txt beside the first shard (one a line, in index order),
        else the labels themselves (numbers: 0..max)."""
        table = None
        first = self.urls[0]
        if _is_local(first):
            candidate = Path(
                first[len("file://") :] if first.startswith("file://") else first
            ).with_name("classes.txt")
            if candidate.is_file():
                table = [
                    line.strip() for line in candidate.read_text().splitlines() if line.strip()
                ]
        if table is not None:
            return table
        if all(label.isdigit() for label in labels):
            return [str(i) for i in range(max(int(label) for label in labels) + 1)]
        return labels

    def open(self, key: str) -> BinaryIO:
        number, offset, size = (int(part) for part in key.split(":"))
        path = self.local.get(number)
        if path is None:  # a loader worker started before listing: find the copy again
            urls = self.urls + self.val_urls
            path = self.local[number] = self._fetch(urls[number])
        with open(path, "rb") as handle:
            handle.seek(offset)
            return io.BytesIO(handle.read(size))


def _open(data: str, options: SourceOptions) -> WebDatasetSource:
    from paratrain.data.builtin import default_cache_dir

    return WebDatasetSource(data, options.cache_dir or default_cache_dir(), options.val_split)


SOURCE = SourceKind(open=_open, prefix=PREFIX)
