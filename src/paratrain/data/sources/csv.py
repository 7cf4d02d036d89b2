"""Images listed in a labels file, as Kaggle and many in-house sets ship them:
``--data csv:FILE.csv`` (paths relative to the file's folder), or ``--data DIR --labels
FILE.csv|.jsonl`` (paths relative to DIR). A row names an image and its class:

* CSV: a header, then the image's path and its class; the columns are found by name
  (``image``/``path``/``file``/``filename``/``id`` and ``label``/``labels``/``tags``/
  ``class``/``target``/``category``), else the first two; or, in place of the class, one
  0/1 column per class (the header names the classes);
* JSON lines: an object a line with the same keys (the label a name or a list of names).

A row may carry several labels: names separated by ``;`` or ``|``, several 1s, or a JSON
list. Where any row does, the listing is multi-label (data/label_sets.py). A ``split``
column (``train``/``val``) gives the split; without one it is made here. A row that names
no file on disk, has no label, or a label that no training row has, stops the listing
with one line naming the file and the row. A key is a file's path.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from paratrain.data.label_sets import encode
from paratrain.data.samples import PackedStrings, Samples
from paratrain.data.sources.base import Listing, Source, SourceKind, SourceOptions
from paratrain.errors import UserError

PREFIX = "csv:"
IMAGE_COLUMNS = ("image", "path", "file", "filename", "id")
LABEL_COLUMNS = ("label", "labels", "tags", "class", "target", "category")
SIDES = {"train": 0, "val": 1, "valid": 1, "validation": 1}
SEVERAL = (";", "|")  # what separates several labels in one cell
SIDE = "split"  # the column (or key) that gives each row its side


@dataclass
class _Row:
    number: int
    path: str
    label: str
    side: str

    @cached_property
    def names(self) -> list[str]:
        """The row's label names (several where separated by ``;`` or ``|``)."""
        text = self.label
        for mark in SEVERAL[1:]:
            text = text.replace(mark, SEVERAL[0])
        return list(dict.fromkeys(n.strip() for n in text.split(SEVERAL[0]) if n.strip()))


def class_order(names: set[str]) -> list[str]:
    """Class names sorted, numbers by value (2 before 10)."""
    return sorted(names, key=lambda c: (0, int(c), "") if c.isdigit() else (1, 0, c))


def _column(header: list[str], names: tuple[str, ...], fallback: int) -> int:
    lowered = [h.strip().lower() for h in header]
    return next((lowered.index(n) for n in names if n in lowered), fallback)


class CsvSource(Source):
    """The images a labels file lists, with their classes."""

    def __init__(self, file: str | Path, root: str | Path | None = None, name: str = ""):
        self.file = Path(file).expanduser()
        self.root = Path(root).expanduser() if root is not None else self.file.parent
        self.name = name or str(self.file)
        if not self.file.is_file():
            raise UserError(f"labels file not found: {self.file}")

    def identity(self) -> str:
        return f"csv:{self.file.resolve()}:{self.root.resolve()}"

    def open(self, key: str) -> str:
        return key

    def _where(self, number: int) -> str:
        return f"{self.file}, row {number}"

    def _rows(self) -> tuple[list[_Row], bool]:
        """Every row (blank lines are no rows), and whether a split is given."""
        rows = self._json_rows() if self.file.suffix.lower() == ".jsonl" else self._csv_rows()
        if not rows:
            raise UserError(f"{self.file}: lists no image")
        for row in rows:
            if row.side not in SIDES:
                raise UserError(
                    f"{self._where(row.number)}: split {row.side!r} is not train or val"
                )
            if not row.path:
                raise UserError(f"{self._where(row.number)}: no image path")
            if not row.names:
                raise UserError(f"{self._where(row.number)}: no label for {row.path}")
        return rows, self._split_given

    def _csv_rows(self) -> list[_Row]:
        with open(self.file, newline="", encoding="utf-8-sig") as handle:
            reader = csv.reader(handle)
            header = next(reader, None)
            if not header or len(header) < 2:
                raise UserError(
                    f"{self.file}: needs a header and two columns (an image path, a class)"
                )
            image = _column(header, IMAGE_COLUMNS, 0)
            split = _column(header, (SIDE,), -1)
            self._split_given = split >= 0
            label = _column(header, LABEL_COLUMNS, -1)
            flags = [i for i in range(len(header)) if i not in (image, split)]
            if label < 0 and len(flags) == 1:
                label = flags[0]
            rows = []
            for number, cells in enumerate(reader, start=2):
                if not any(cell.strip() for cell in cells):
                    continue
                cells = [c.strip() for c in cells] + [""] * len(header)
                text = cells[label] if label >= 0 else self._one_hot(header, flags, cells, number)
                side = cells[split].lower() if split >= 0 else "train"
                rows.append(_Row(number, cells[image], text, side))
        return rows

    def _one_hot(self, header: list[str], flags: list[int], cells: list[str], number: int) -> str:
        """The labels of a row of 0/1 columns, one per class: the columns set."""
        if any(cells[i] not in ("0", "1", "") for i in flags):
            raise UserError(f"{self._where(number)}: the class columns hold other than 0 and 1")
        named = [header[i].strip() for i in flags if cells[i] == "1"]
        return ";".join(named)

    def _json_rows(self) -> list[_Row]:
        rows = []
        self._split_given = False
        with open(self.file, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    raise UserError(f"{self._where(number)}: not a JSON object") from None
                if not isinstance(record, dict):
                    raise UserError(f"{self._where(number)}: not a JSON object")
                path = next((record[k] for k in IMAGE_COLUMNS if k in record), "")
                label = next((record[k] for k in LABEL_COLUMNS if k in record), "")
                if isinstance(label, list):
                    label = ";".join(str(v) for v in label)
                self._split_given = self._split_given or SIDE in record
                side = str(record.get(SIDE, "train")).lower()
                rows.append(_Row(number, str(path).strip(), str(label).strip(), side))
        return rows

    def list_entries(self, node: int = 0, nodes: int = 1) -> Listing:
        rows, given = self._rows()
        named = [row.names for row in rows]
        several = any(len(names) > 1 for names in named)
        training = {
            n for row, names in zip(rows, named, strict=True) if SIDES[row.side] == 0 for n in names
        }
        classes = class_order(training)
        if len(classes) < 2:
            raise UserError(f"{self.file}: one class ({classes[0]}); a classifier needs 2")
        index = {name: i for i, name in enumerate(classes)}
        keys, sizes, versions = [], [], []
        for row, names in zip(rows, named, strict=True):
            unknown = [n for n in names if n not in index]
            if unknown:
                raise UserError(
                    f"{self._where(row.number)}: label {unknown[0]!r} is in no training row"
                )
            full = os.path.join(self.root, os.path.expanduser(row.path))
            try:
                info = os.stat(full)
            except OSError:
                raise UserError(f"{self._where(row.number)}: no image file {full}") from None
            keys.append(full)
            sizes.append(info.st_size)
            versions.append(info.st_mtime_ns)
        numbers = [[index[n] for n in names] for names in named]
        label_sets = None
        if several:
            labels, label_sets = encode(numbers, len(classes))
        else:
            labels = np.array([row[0] for row in numbers], np.int32)
        samples = Samples(
            PackedStrings.of(keys),
            labels,
            self,
            np.array(sizes, np.int64),
            np.array(versions, np.int64),
        )
        sides = np.array([SIDES[row.side] for row in rows], np.int8)
        layout = "given" if given else "split"
        return Listing(classes, samples, sides if given else None, layout, label_sets=label_sets)


def _open(data: str, options: SourceOptions) -> CsvSource:
    if options.labels is not None:  # --data DIR --labels FILE
        return CsvSource(options.labels, data, name=f"{data} (labels {options.labels})")
    return CsvSource(data[len(PREFIX) :], name=data)


SOURCE = SourceKind(open=_open, prefix=PREFIX, labels=(".csv", ".jsonl"))
