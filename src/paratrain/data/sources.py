"""Where a run's images come from: a folder, a Hugging Face dataset, WebDataset shards.

A source is an adapter in front of the one pipeline (timm's ``create_dataset`` shape):
it lists its entries once — a key, a label, a size and a version for each, in arrays
(data/samples.py) — and opens one by key. The split, the screen, the decoded cache, the
samplers and exact evaluation are the same for every source.

* a folder: ``DIR/<class>/*`` or ``DIR/{train,val}/<class>/*``; a key is a file's path;
* ``hf:NAME``, or a folder written by ``datasets``' ``save_to_disk`` or holding parquet
  files: the image and label columns found (an ``Image`` feature, a ``ClassLabel``) or
  named (``--image-column``, ``--label-column``); ``--data-split`` and ``--val-split``
  name the splits (pip install 'paratrain[datasets]');
* ``wds:PATTERN``: WebDataset tar shards, local paths or any URL fsspec opens (``{000..099}``
  expands); each sample's image member and its class from a ``.cls`` member (a number,
  or a class name; names from ``classes.txt`` beside the shards); shards not on this
  machine are copied once into the cache folder, and each node copies only the shards
  its ranks read (pip install 'paratrain[webdataset]').
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from paratrain.data.samples import PackedStrings, Samples
from paratrain.errors import UserError
from paratrain.files import write_atomic

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
HF, WDS = "hf:", "wds:"


def is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


# what archivers and file managers leave beside the data: macOS's zip resource forks
# (__MACOSX/, whose ._name.jpg files are no images), and folders of their own
JUNK_FOLDERS = frozenset({"__MACOSX", "__pycache__", "@eaDir", "$RECYCLE.BIN"})


def is_junk(name: str) -> bool:
    """A hidden file or folder, or an archiver's debris: never a class or an image."""
    return name.startswith(".") or name in JUNK_FOLDERS


@dataclass
class Listing:
    """Every entry of a source, as listed once."""

    classes: list[str]
    samples: Samples  # every readable entry, class by class
    sides: np.ndarray | None = None  # where the source gives its split: 1 for val
    layout: str = "split"  # "split" (split here) or "given" (by the source)
    ignored: int = 0  # files without an image extension, left out
    missing: list[tuple[str, str]] = field(default_factory=list)  # (key, why): unreadable


class Source:
    """A place a run reads images from; subclasses list and open their entries."""

    name: str
    sharded = False  # entries in shards: nodes read disjoint shards (data/loaders.py)

    def identity(self) -> str:
        """What the cache and the screen's memory fold into their keys besides the
        entries' own (a dataset's fingerprint)."""
        return self.name

    def listing(self, node: int = 0, nodes: int = 1) -> Listing:
        """Every entry (of this node's shards, for a sharded source): the listing this
        start's launcher made where it handed one over (``handed_over``), else listed."""
        path = os.environ.get(LISTING)
        if path and nodes == 1:
            found = read_listing(Path(path), self)
            if found is not None:
                return found
        return self.list_entries(node, nodes)

    def list_entries(self, node: int, nodes: int) -> Listing:
        raise NotImplementedError

    def open(self, key: str) -> str | BinaryIO:
        """A path (PIL opens it) or a file object of the entry's bytes."""
        raise NotImplementedError

    def read(self, key: str) -> bytes:
        """The entry's bytes."""
        opened = self.open(key)
        if isinstance(opened, str):
            with open(opened, "rb") as handle:
                return handle.read()
        return opened.read()


# ---------------------------------------------------------------------------- folder


class FolderSource(Source):
    """``DIR/<class>/*`` (split here) or ``DIR/train/<class>`` and ``DIR/val/<class>``."""

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.name = str(root)

    def identity(self) -> str:
        return f"folder:{self.root.resolve()}"

    def open(self, key: str) -> str:
        return key

    def read(self, key: str) -> bytes:
        with open(key, "rb") as handle:
            return handle.read()

    def list_entries(self, node: int = 0, nodes: int = 1) -> Listing:
        root = self.root
        given = (root / "train").is_dir() and (root / "val").is_dir()
        found = _Found()
        if given:
            train = _scan_classes(root / "train", found)
            val = _scan_classes(root / "val", found)
            if set(train) != set(val):
                only_train = sorted(set(train) - set(val))
                only_val = sorted(set(val) - set(train))
                raise UserError(
                    f"train/val class folders differ in {root}: "
                    f"only in train: {only_train or 'none'}; only in val: {only_val or 'none'}"
                )
            classes = sorted(train)
            parts = [(train, 0), (val, 1)]
        else:
            by_class = _scan_classes(root, found)
            classes = sorted(by_class)
            parts = [(by_class, 0)]
        keys: list[str] = []
        labels, sizes, versions, sides = [], [], [], []
        for by_class, side in parts:
            for index, name in enumerate(classes):
                found_here = by_class[name]
                keys += found_here.paths
                sizes.append(np.frombuffer(found_here.sizes, np.int64))
                versions.append(np.frombuffer(found_here.versions, np.int64))
                labels.append(np.full(len(found_here.paths), index, np.int32))
                sides.append(np.full(len(found_here.paths), side, np.int8))
        samples = Samples(
            PackedStrings.of(keys),
            np.concatenate(labels),
            self,
            np.concatenate(sizes),
            np.concatenate(versions),
        )
        return Listing(
            classes,
            samples,
            np.concatenate(sides) if given else None,
            "given" if given else "split",
            found.ignored,
            found.missing,
        )


@dataclass
class _Found:
    ignored: int = 0
    missing: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class _Images:
    """One class folder's images: sorted paths, and their sizes and modification times
    (arrays of int64 as they are appended: no tuple per file)."""

    paths: list[str]
    sizes: array
    versions: array


def _scan_classes(root: Path, found: _Found) -> dict[str, _Images]:
    """Each class folder under ``root`` -> its images, sorted by path; a file that
    cannot be statted (a broken link) goes to ``found.missing``, one without an image
    extension is counted in ``found.ignored``. One stat per image: at a million files
    that is most of a second start's listing (2-4 us each)."""
    if not root.exists():
        raise UserError(f"data directory does not exist: {root}")
    if not root.is_dir():
        raise UserError(f"data path is not a directory: {root}")
    entries = sorted(os.scandir(root), key=lambda e: e.name)
    class_dirs = [e for e in entries if e.is_dir() and not is_junk(e.name)]
    if not class_dirs:
        if not entries:
            raise UserError(f"data directory is empty: {root}")
        raise UserError(f"no class folders in {root} (expected {root}/<class>/<image>)")
    classes: dict[str, _Images] = {}
    stat = os.stat
    for entry in class_dirs:
        paths: list[str] = []
        folders = [entry.path]
        while folders:  # every folder below, links followed (os.walk's followlinks)
            with os.scandir(folders.pop()) as listed:
                for item in listed:
                    if is_junk(item.name):
                        continue
                    if item.is_dir():
                        folders.append(item.path)
                    elif is_image(item.name):
                        paths.append(item.path)
                    else:
                        found.ignored += 1
        paths.sort()
        images = _Images([], array("q"), array("q"))
        kept, sizes, versions = images.paths.append, images.sizes.append, images.versions.append
        missing_before = len(found.missing)
        for path in paths:
            try:
                info = stat(path)
            except OSError as exc:  # a broken link, a file gone meanwhile
                found.missing.append((path, f"missing ({exc.strerror or exc})"))
                continue
            kept(path)
            sizes(info.st_size)
            versions(info.st_mtime_ns)
        if not images.paths and len(found.missing) == missing_before:
            raise UserError(f"class folder has no images: {entry.path}")
        classes[entry.name] = images
    if len(classes) < 2:
        raise UserError(
            f"{root} holds one class folder ({next(iter(classes))}); a classifier needs at "
            f"least 2 ({root}/<class>/<image>, one folder per class)"
        )
    return classes


# ---------------------------------------------------------------------------- handing over

LISTING = "PARATRAIN_LISTING"  # a listing file the launcher made, for the run's processes
_offered: tuple[Source, Listing] | None = None


def offer(source: Source, listing: Listing) -> None:
    """Keep the listing the checks before a run made, for ``handed_over``."""
    global _offered
    _offered = (source, listing)


@contextmanager
def handed_over() -> Iterator[None]:
    """While a run that this process starts (here, or in processes it launches) lists
    its source: the listing offered before, from a file, so a million files are listed
    and statted once per start rather than once more by every process."""
    global _offered
    if _offered is None:
        yield
        return
    source, listing = _offered
    _offered = None
    folder = Path(tempfile.mkdtemp(prefix="paratrain-listing-"))
    try:
        os.environ[LISTING] = str(write_listing(folder / "listing.npz", source, listing))
        yield
    finally:
        os.environ.pop(LISTING, None)
        shutil.rmtree(folder, ignore_errors=True)


def write_listing(path: Path, source: Source, listing: Listing) -> Path:
    samples = listing.samples
    meta = {
        "identity": source.identity(),
        "classes": listing.classes,
        "layout": listing.layout,
        "ignored": listing.ignored,
        "missing": listing.missing,
    }
    np.savez(
        path,
        meta=np.array(json.dumps(meta)),
        keys=samples.keys.data,
        offsets=samples.keys.offsets,
        labels=samples.labels,
        sizes=samples.sizes,
        versions=samples.versions,
        sides=listing.sides if listing.sides is not None else np.zeros(0, np.int8),
        given=np.array(listing.sides is not None),
    )
    return path


def read_listing(path: Path, source: Source) -> Listing | None:
    """The listing in ``path`` when it is ``source``'s, else None."""
    try:
        with np.load(path, allow_pickle=False) as kept:
            meta = json.loads(str(kept["meta"]))
            if meta["identity"] != source.identity():
                return None
            keys = PackedStrings(kept["keys"], kept["offsets"])
            samples = Samples(keys, kept["labels"], source, kept["sizes"], kept["versions"])
            sides = kept["sides"] if bool(kept["given"]) else None
    except (OSError, ValueError, KeyError):
        return None
    missing = [(str(key), str(why)) for key, why in meta["missing"]]
    return Listing(meta["classes"], samples, sides, meta["layout"], meta["ignored"], missing)


# ---------------------------------------------------------------------------- Hugging Face


def _datasets():
    try:
        import datasets
    except ImportError:
        from paratrain.version import install_extra

        raise UserError(
            "--data hf:... and dataset folders need the datasets package: "
            + install_extra("datasets")
        ) from None
    return datasets


def is_hf_folder(path: Path) -> bool:
    """A folder written by ``save_to_disk`` (or of parquet files) rather than of classes."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or (path / "state.json").is_file()
        or _has_parquet(path)
        or _has_parquet(path / "data")  # the hub's layout: data/<split>-*.parquet
    )


def _has_parquet(folder: Path) -> bool:
    """Whether ``folder`` itself holds a parquet file (an image folder's class folders
    are not looked into: they may hold a million files)."""
    if not folder.is_dir():
        return False
    with os.scandir(folder) as entries:
        return any(entry.name.endswith(".parquet") for entry in entries)


VAL_SPLITS = ("validation", "valid", "val", "test")
LABEL_COLUMNS = ("label", "labels", "target", "class", "fine_label")


class HFSource(Source):
    """A Hugging Face dataset: from the hub (``hf:NAME``, into the usual cache) or from a
    folder on disk. Keys are ``<split>/<row>``; an image is its column's bytes (or path)."""

    def __init__(
        self,
        spec: str,
        data_split: str | None = None,
        val_split: str | None = None,
        image_column: str | None = None,
        label_column: str | None = None,
    ):
        self.name, self.spec = spec, spec
        self.data_split, self.val_split = data_split, val_split
        self.image_column, self.label_column = image_column, label_column
        self._splits: Any = None

    def __getstate__(self) -> dict:  # loader workers open the dataset again (memory-mapped)
        return {**self.__dict__, "_splits": None}

    def _load(self) -> Any:
        if self._splits is not None:
            return self._splits
        datasets = _datasets()
        try:
            if self.spec.startswith(HF):
                loaded = datasets.load_dataset(self.spec[len(HF) :])
            else:
                path = Path(self.spec).expanduser()
                if _has_parquet(path) or _has_parquet(path / "data"):
                    loaded = datasets.load_dataset("parquet", data_dir=str(path))
                else:
                    loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError, OSError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(
                f"--data {self.spec}: cannot load the dataset ({first[:200]})"
            ) from None
        if isinstance(loaded, datasets.Dataset):
            loaded = datasets.DatasetDict({"train": loaded})
        self._splits = loaded
        return loaded

    def _columns(self, split: Any) -> tuple[str, str]:
        datasets = _datasets()
        features = split.features
        image = self.image_column or next(
            (n for n, f in features.items() if isinstance(f, datasets.Image)), None
        )
        label = self.label_column or next(
            (n for n, f in features.items() if isinstance(f, datasets.ClassLabel)), None
        )
        label = label or next((n for n in LABEL_COLUMNS if n in features), None)
        for what, flag, column in (
            ("image", "--image-column", image),
            ("label", "--label-column", label),
        ):
            if column is None or column not in features:
                raise UserError(
                    f"--data {self.spec}: no {what} column found (columns: "
                    f"{', '.join(features)}); name it with {flag}"
                )
        return image, label  # type: ignore[return-value]

    def _split(self, name: str) -> Any:
        splits = self._load()
        if name not in splits:
            raise UserError(
                f"--data {self.spec}: no split {name!r} (splits: {', '.join(splits)}); "
                "choose one with --data-split / --val-split"
            )
        split = splits[name]
        image, _ = self._columns(split)
        return split.cast_column(image, _datasets().Image(decode=False))

    def identity(self) -> str:
        splits = self._load()
        prints = ",".join(f"{n}={getattr(splits[n], '_fingerprint', '')}" for n in splits)
        return f"hf:{self.spec}:{prints}"

    def list_entries(self, node: int = 0, nodes: int = 1) -> Listing:
        splits = self._load()
        train_name = self.data_split or "train"
        val_name = self.val_split or next((n for n in VAL_SPLITS if n in splits), None)
        names = [train_name] + ([val_name] if val_name else [])
        datasets = _datasets()
        first = self._split(train_name)
        _, label_column = self._columns(first)
        feature = first.features[label_column]
        if isinstance(feature, datasets.ClassLabel):
            classes = list(feature.names)
        else:
            seen: set[str] = set()
            for name in names:
                seen.update(str(v) for v in self._split(name)[label_column])
            classes = sorted(seen, key=lambda c: (len(c), c) if c.isdigit() else (0, c))
        index = {c: i for i, c in enumerate(classes)}
        keys, labels, sides = [], [], []
        for side, name in enumerate(names):
            column = self._split(name)[label_column]
            for row, value in enumerate(column):
                keys.append(f"{name}/{row}")
                labels.append(
                    int(value) if isinstance(feature, datasets.ClassLabel) else index[str(value)]
                )
                sides.append(side)
        samples = Samples(PackedStrings.of(keys), np.array(labels, np.int32), self)
        if len(classes) < 2:
            raise UserError(
                f"--data {self.spec}: one class in {label_column}; a classifier needs 2"
            )
        given = val_name is not None
        return Listing(classes, samples, np.array(sides, np.int8) if given else None,
                       "given" if given else "split")  # fmt: skip

    def open(self, key: str) -> str | BinaryIO:
        name, row = key.rsplit("/", 1)
        split = self._split_cached(name)
        image, _ = self._columns(split)
        value = split[int(row)][image]
        if value.get("bytes") is not None:
            return io.BytesIO(value["bytes"])
        return str(value["path"])

    def _split_cached(self, name: str) -> Any:
        cache = self.__dict__.setdefault("_opened", {})
        if name not in cache:
            cache[name] = self._split(name)
        return cache[name]


# ---------------------------------------------------------------------------- WebDataset

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
        self.urls = self._expand(spec[len(WDS) :])
        if val_pattern and val_pattern.startswith(WDS):
            val_pattern = val_pattern[len(WDS) :]
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
                tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                try:
                    with fsspec.open(url, "rb") as remote, open(tmp, "wb") as local:
                        while chunk := remote.read(8 << 20):
                            local.write(chunk)
                    os.replace(tmp, target)
                except OSError as exc:
                    tmp.unlink(missing_ok=True)
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


# ---------------------------------------------------------------------------- choosing


def open_source(
    data: str,
    cache_dir: Path | None = None,
    data_split: str | None = None,
    val_split: str | None = None,
    image_column: str | None = None,
    label_column: str | None = None,
) -> Source:
    """The source ``--data`` names: ``hf:NAME``, ``wds:PATTERN``, a dataset folder
    (``save_to_disk`` or parquet), or an image folder."""
    if data.startswith(HF):
        return HFSource(data, data_split, val_split, image_column, label_column)
    if data.startswith(WDS):
        from paratrain.data.builtin import default_cache_dir

        return WebDatasetSource(data, cache_dir or default_cache_dir(), val_split)
    path = Path(data).expanduser()
    if not path.exists():
        raise UserError(f"--data directory does not exist: {data}")
    if not path.is_dir():
        raise UserError(f"--data directory is a file, not a directory: {data}")
    if is_hf_folder(path):
        return HFSource(str(path), data_split, val_split, image_column, label_column)
    return FolderSource(path)


__all__ = [
    "HF",
    "IMAGE_EXTENSIONS",
    "WDS",
    "FolderSource",
    "HFSource",
    "Listing",
    "Source",
    "WebDatasetSource",
    "expand_pattern",
    "is_image",
    "open_source",
]
