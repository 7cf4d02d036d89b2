"""What every data source shares: the ``Source`` interface, the ``Listing`` it makes, the
``SourceKind`` each module declares, and ``open_source``, which finds the one ``--data`` names.

A source is an adapter in front of the one pipeline (timm's ``create_dataset`` shape): it
lists its entries once (a key, a label, a size and a version for each, in arrays:
data/samples.py) and opens one by key. The split, the screen, the decoded cache, the
samplers and exact evaluation are the same for every source. Each kind is a module of
this package, registered in its ``__init__``.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from paratrain.data.samples import PackedStrings, Samples
from paratrain.data.sources import SOURCES
from paratrain.errors import UserError

if TYPE_CHECKING:
    from paratrain.config import TrainConfig

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


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
    # several labels per image: each sample's label is a row of this 0/1 table of label
    # sets [sets, classes] (data/label_sets.py); None: one class per image
    label_sets: np.ndarray | None = None


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
        label_sets=listing.label_sets if listing.label_sets is not None else np.zeros(0, np.uint8),
        several=np.array(listing.label_sets is not None),
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
            label_sets = kept["label_sets"] if bool(kept["several"]) else None
    except (OSError, ValueError, KeyError):
        return None
    missing = [(str(key), str(why)) for key, why in meta["missing"]]
    return Listing(
        meta["classes"], samples, sides, meta["layout"], meta["ignored"], missing, label_sets
    )


# ---------------------------------------------------------------------------- Hugging Face


# ---------------------------------------------------------------------------- the kinds


@dataclass(frozen=True)
class SourceOptions:
    """What the settings say about reaching a source, besides ``--data`` itself."""

    cache_dir: Path | None = None  # where remote shards and indexes are kept
    data_split: str | None = None  # the split to train on (a dataset's)
    val_split: str | None = None  # the split (or shards) to validate on
    image_column: str | None = None
    label_column: str | None = None
    labels: Path | None = None  # --labels: a file naming --data's images and classes


@dataclass(frozen=True)
class SourceKind:
    """A module's declaration of its source: ``--data PREFIX...`` opens it, as does a local
    folder that ``claims`` recognises (None: none), or ``--labels`` with a file of one of
    the ``labels`` suffixes; ``open`` makes the source."""

    open: Callable[[str, SourceOptions], Source]
    prefix: str | None = None
    claims: Callable[[Path], bool] | None = None
    labels: tuple[str, ...] = ()


def kind(name: str) -> SourceKind:
    """The registered source ``name`` (its module's ``SOURCE``)."""
    if name not in SOURCES:
        raise KeyError(f"no data source {name!r} (sources: {', '.join(SOURCES)})")
    declared: SourceKind = importlib.import_module(f"paratrain.data.sources.{name}").SOURCE
    return declared


def prefixes() -> tuple[str, ...]:
    """Every prefix a source declares (``hf:``, ``wds:``...)."""
    return tuple(p for p in (kind(n).prefix for n in SOURCES) if p)


def names_a_source(data: str) -> bool:
    """Whether ``--data`` names a source by its prefix (not a local folder)."""
    return data.startswith(prefixes())


def source_of(cfg: TrainConfig) -> Source:
    """What --data names, opened, with the run's options."""
    return open_source(
        cfg.dataset,
        memory_folder(cfg),
        cfg.data_split,
        cfg.val_split,
        cfg.image_column,
        cfg.label_column,
        cfg.labels,
    )


def memory_folder(cfg: TrainConfig) -> Path:
    """Where the screen's verdicts are kept: beside the decoded cache."""
    from paratrain.data.builtin import default_cache_dir

    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()


def open_source(
    data: str,
    cache_dir: Path | None = None,
    data_split: str | None = None,
    val_split: str | None = None,
    image_column: str | None = None,
    label_column: str | None = None,
    labels: str | Path | None = None,
) -> Source:
    """The source ``--data`` names: with ``labels`` (--labels FILE) the kind that reads
    that file, over the folder; else by its prefix, else the first kind (in the
    registry's order) that claims the folder."""
    listed = Path(labels).expanduser() if labels is not None else None
    options = SourceOptions(cache_dir, data_split, val_split, image_column, label_column, listed)
    kinds = [kind(name) for name in SOURCES]
    if listed is not None:
        reader = next((k for k in kinds if listed.suffix.lower() in k.labels), None)
        if reader is None:
            takes = sorted({s for k in kinds for s in k.labels})
            raise UserError(f"--labels {labels}: a labels file is one of {', '.join(takes)}")
        if not Path(data).expanduser().is_dir():
            raise UserError(f"--data {data}: --labels names images in a folder, and this is none")
        return reader.open(str(Path(data).expanduser()), options)
    for each in kinds:
        if each.prefix and data.startswith(each.prefix):
            return each.open(data, options)
    path = Path(data).expanduser()
    if not path.exists():
        raise UserError(f"--data directory does not exist: {data}")
    if not path.is_dir():
        raise UserError(f"--data directory is a file, not a directory: {data}")
    for each in kinds:
        if each.claims is not None and each.claims(path):
            return each.open(str(path), options)
    raise UserError(f"--data {data}: no data source reads this folder")  # pragma: no cover
