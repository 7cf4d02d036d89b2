"""An image folder: ``DIR/<class>/*`` (split here) or ``DIR/{train,val}/<class>/*`` (split
given); a key is a file's path. It takes any folder the sources before it do not claim."""

from __future__ import annotations

import os
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from paratrain.data.samples import PackedStrings, Samples
from paratrain.data.sources.base import (
    Listing,
    Source,
    SourceKind,
    SourceOptions,
    is_image,
    is_junk,
)
from paratrain.errors import UserError


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


def _open(data: str, options: SourceOptions) -> FolderSource:
    return FolderSource(data)


SOURCE = SourceKind(open=_open, claims=lambda path: True)
