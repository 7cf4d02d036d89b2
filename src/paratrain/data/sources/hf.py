"""A Hugging Face dataset: ``hf:NAME`` (from the hub, into its usual cache), or a folder
written by ``datasets``' ``save_to_disk`` or holding parquet files. The image and label
columns are found (an ``Image`` feature, a ``ClassLabel``) or named (``--image-column``,
``--label-column``; a ``Sequence(ClassLabel)`` gives several labels an image);
``--data-split`` and ``--val-split`` name the splits (pip install
'paratrain[datasets]'). A key is ``<split>/<row>``.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from paratrain.data.label_sets import encode
from paratrain.data.samples import PackedStrings, Samples
from paratrain.data.sources.base import Listing, Source, SourceKind, SourceOptions
from paratrain.errors import UserError

PREFIX = "hf:"


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
            if self.spec.startswith(PREFIX):
                loaded = datasets.load_dataset(self.spec[len(PREFIX) :])
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
            (n for n, f in features.items() if isinstance(_class_label(f), datasets.ClassLabel)),
            None,
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
        several = feature is not _class_label(feature)  # a Sequence(ClassLabel): multi-label
        feature = _class_label(feature)
        if isinstance(feature, datasets.ClassLabel):
            classes = list(feature.names)
        else:
            seen: set[str] = set()
            for name in names:
                seen.update(str(v) for v in self._split(name)[label_column])
            classes = sorted(seen, key=lambda c: (len(c), c) if c.isdigit() else (0, c))
        index = {c: i for i, c in enumerate(classes)}
        keys, sides = [], []
        labels: list[Any] = []
        for side, name in enumerate(names):
            column = self._split(name)[label_column]
            for row, value in enumerate(column):
                keys.append(f"{name}/{row}")
                labels.append(
                    value if isinstance(feature, datasets.ClassLabel) else index[str(value)]
                )
                sides.append(side)
        label_sets = None
        if several:
            numbers, label_sets = encode([[int(v) for v in row] for row in labels], len(classes))
        else:
            numbers = np.array(labels, np.int32)
        samples = Samples(PackedStrings.of(keys), numbers, self)
        if len(classes) < 2:
            raise UserError(
                f"--data {self.spec}: one class in {label_column}; a classifier needs 2"
            )
        given = val_name is not None
        return Listing(classes, samples, np.array(sides, np.int8) if given else None,
                       "given" if given else "split", label_sets=label_sets)  # fmt: skip

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


def _class_label(feature: Any) -> Any:
    """A ``Sequence(ClassLabel)`` column's ClassLabel (several labels an image), else the
    feature itself."""
    inner = getattr(feature, "feature", None)
    return inner if isinstance(inner, _datasets().ClassLabel) else feature


def _open(data: str, options: SourceOptions) -> HFSource:
    return HFSource(
        data, options.data_split, options.val_split, options.image_column, options.label_column
    )


SOURCE = SourceKind(open=_open, prefix=PREFIX, claims=is_hf_folder)
