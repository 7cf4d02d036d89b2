"""Samples held in arrays: keys and labels a million entries long without a million
Python objects.

A list of (path, label) tuples is a Python object per entry, and every loader worker
that reads one touches its reference count: the pages holding them are copied into each
worker, one by one, until each worker holds its own copy (pytorch/pytorch#13246: about
a quarter of a gigabyte per worker at a million entries). Here the keys are one uint8
array of their UTF-8 bytes with an array of offsets, the labels an int32 array, so
forked workers share them and reading one touches nothing.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, BinaryIO, Protocol, overload

import numpy as np


class Origin(Protocol):
    """What samples need of the place they come from (data/sources.Source is one): how
    to open and read an entry, what to fold into keys, whether nodes read apart."""

    sharded: bool

    def identity(self) -> str: ...

    def open(self, key: str) -> str | BinaryIO: ...

    def read(self, key: str) -> bytes: ...


class PackedStrings(Sequence[str]):
    """Strings as one array of UTF-8 bytes and their offsets."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data, self.offsets = data, offsets

    @classmethod
    def of(cls, strings: Iterable[str]) -> PackedStrings:
        """From strings without NUL characters (paths, keys): one encode of them all,
        joined by NULs that then mark where each ends."""
        listed = strings if isinstance(strings, list) else list(strings)
        if not listed:
            return cls(np.zeros(0, np.uint8), np.zeros(1, np.int64))
        joined = np.frombuffer("\0".join(listed).encode(), dtype=np.uint8)
        ends = np.flatnonzero(joined == 0)
        if len(ends) != len(listed) - 1:
            raise ValueError("a string holds a NUL character")
        offsets = np.empty(len(listed) + 1, np.int64)
        offsets[0] = 0
        offsets[1:-1] = ends - np.arange(len(ends))
        offsets[-1] = len(joined) - len(ends)
        return cls(np.delete(joined, ends), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> PackedStrings: ...

    def __getitem__(self, index: int | slice) -> str | PackedStrings:
        if isinstance(index, slice):
            return self.take(np.arange(len(self))[index])
        if index < 0:
            index += len(self)
        start, end = self.offsets[index], self.offsets[index + 1]
        return bytes(self.data[start:end]).decode()

    def __iter__(self) -> Iterator[str]:
        raw = self.data.tobytes()
        offsets = self.offsets.tolist()
        for start, end in zip(offsets[:-1], offsets[1:], strict=True):
            yield raw[start:end].decode()

    def take(self, indices: np.ndarray) -> PackedStrings:
        """The strings at ``indices``, in that order."""
        indices = np.asarray(indices, dtype=np.int64)
        starts, ends = self.offsets[indices], self.offsets[indices + 1]
        lengths = ends - starts
        offsets = np.zeros(len(indices) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        raw = self.data.tobytes()  # slices of bytes: no per-byte index arrays
        joined = b"".join(raw[s:e] for s, e in zip(starts.tolist(), ends.tolist(), strict=True))
        return PackedStrings(np.frombuffer(joined, dtype=np.uint8).copy(), offsets)

    def digest(self) -> bytes:
        """A hash of every string in order (what the cache and the screen key on)."""
        return hashlib.sha256(self.offsets.tobytes() + self.data.tobytes()).digest()


class Samples(Sequence[tuple[str, int]]):
    """(key, label) pairs held in arrays, with where they come from: ``source`` opens a
    key (a file's path for a folder; a row or a shard member for other sources).
    ``sizes`` and ``versions`` (a file's size and modification time in ns) say whether
    an entry changed since it was last seen: what the screen's memory and the decoded
    cache key on. ``ids``: each entry's number in its source's listing, which subsets
    keep (the decoded cache finds an entry's slot by it)."""

    def __init__(
        self,
        keys: PackedStrings,
        labels: np.ndarray,
        source: Origin | None = None,
        sizes: np.ndarray | None = None,
        versions: np.ndarray | None = None,
        ids: np.ndarray | None = None,
    ):
        n = len(keys)
        self.keys = keys
        self.labels = np.asarray(labels, dtype=np.int32)
        self.source = source
        self.sizes = np.zeros(n, np.int64) if sizes is None else np.asarray(sizes, np.int64)
        self.versions = (
            np.zeros(n, np.int64) if versions is None else np.asarray(versions, np.int64)
        )
        self.ids = np.arange(n, dtype=np.int64) if ids is None else np.asarray(ids, np.int64)

    @classmethod
    def of(cls, pairs: Iterable[tuple[str, int]], source: Origin | None = None) -> Samples:
        """From (key, label) pairs; keys that are files get their size and modification
        time (small sets, tests)."""
        listed = list(pairs)
        sizes, versions = np.zeros(len(listed), np.int64), np.zeros(len(listed), np.int64)
        if source is None:
            for i, (key, _) in enumerate(listed):
                try:
                    stat = os.stat(key)
                except OSError:
                    continue
                sizes[i], versions[i] = stat.st_size, stat.st_mtime_ns
        keys = PackedStrings.of(k for k, _ in listed)
        labels = np.array([label for _, label in listed], np.int32)
        return cls(keys, labels, source, sizes, versions)

    def __len__(self) -> int:
        return len(self.labels)

    @overload
    def __getitem__(self, index: int) -> tuple[str, int]: ...

    @overload
    def __getitem__(self, index: slice) -> Samples: ...

    def __getitem__(self, index: int | slice) -> tuple[str, int] | Samples:
        if isinstance(index, slice):
            return self.take(np.arange(len(self))[index])
        return self.keys[index], int(self.labels[index])

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return zip(self.keys, self.labels.tolist(), strict=True)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Samples):
            return (
                np.array_equal(self.labels, other.labels)
                and np.array_equal(self.keys.offsets, other.keys.offsets)
                and np.array_equal(self.keys.data, other.keys.data)
            )
        if isinstance(other, list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __add__(self, other: Any) -> Samples:
        if not isinstance(other, Samples):
            return NotImplemented
        return concat([self, other])

    def take(self, indices: np.ndarray) -> Samples:
        """The samples at ``indices``, in that order."""
        indices = np.asarray(indices, dtype=np.int64)
        return Samples(
            self.keys.take(indices),
            self.labels[indices],
            self.source,
            self.sizes[indices],
            self.versions[indices],
            self.ids[indices],
        )

    def where(self, keep: np.ndarray) -> Samples:
        """The samples where the boolean array ``keep`` is true."""
        return self.take(np.flatnonzero(keep))

    def digest(self) -> str:
        """A hash of every key, size and version, in order: changes when anything does."""
        digest = hashlib.sha256(self.keys.digest())
        digest.update(self.sizes.tobytes())
        digest.update(self.versions.tobytes())
        if self.source is not None:
            digest.update(self.source.identity().encode())
        return digest.hexdigest()

    def rows_in(self, ids: np.ndarray) -> np.ndarray:
        """Where each of ``ids`` stands in these samples (all must be here)."""
        order = np.argsort(self.ids, kind="stable")
        found = np.searchsorted(self.ids[order], ids)
        rows = order[np.minimum(found, len(order) - 1)]
        if len(ids) and (len(order) == 0 or not np.array_equal(self.ids[rows], ids)):
            raise KeyError("samples not among these")
        return rows

    def paths(self) -> list[str]:
        """The keys as a list (for small sets, and messages)."""
        return list(self.keys)


def as_samples(samples: Samples | Iterable[tuple[str, int]]) -> Samples:
    """``samples`` as Samples: (path, label) pairs are read as files'."""
    return samples if isinstance(samples, Samples) else Samples.of(samples)


def concat(parts: Sequence[Samples]) -> Samples:
    """The samples of ``parts`` one after another (the first's source)."""
    if not parts:
        return Samples(PackedStrings.of([]), np.zeros(0, np.int32))
    keys = [p.keys for p in parts]
    lengths = [len(k.data) for k in keys]
    shifts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    offsets = np.concatenate(
        [keys[0].offsets[:1]]
        + [k.offsets[1:] + shift for k, shift in zip(keys, shifts, strict=True)]
    )
    return Samples(
        PackedStrings(np.concatenate([k.data for k in keys]), offsets),
        np.concatenate([p.labels for p in parts]),
        parts[0].source,
        np.concatenate([p.sizes for p in parts]),
        np.concatenate([p.versions for p in parts]),
        np.concatenate([p.ids for p in parts]),
    )
