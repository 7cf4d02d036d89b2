"""Images listed in a CSV file: ``csv:FILE.csv``, a header, then one row per image: its
path (relative to the file's folder, or absolute) and its class, as many collections
ship them. The columns are found by name (``image``/``path``/``file``/``filename``/``id``
and ``label``/``class``/``target``/``category``), else the first two. A ``split`` column
(``train``/``val``) gives the split; without one it is made here. A key is a file's path.
A row that names no file on disk, or has no class, stops the listing with its row
number.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

from paratrain.data.samples import PackedStrings, Samples
from paratrain.data.sources.base import Listing, Source, SourceKind, SourceOptions
from paratrain.errors import UserError

PREFIX = "csv:"
IMAGE_COLUMNS = ("image", "path", "file", "filename", "id")
LABEL_COLUMNS = ("label", "class", "target", "category")
SIDES = {"train": 0, "val": 1, "valid": 1, "validation": 1}


def _column(header: list[str], names: tuple[str, ...], fallback: int) -> int:
    lowered = [h.strip().lower() for h in header]
    return next((lowered.index(n) for n in names if n in lowered), fallback)


def class_order(names: set[str]) -> list[str]:
    """Class names sorted, numbers by value (2 before 10)."""
    return sorted(names, key=lambda c: (0, int(c), "") if c.isdigit() else (1, 0, c))


class CsvSource(Source):
    """The images a CSV file lists, with their classes."""

    def __init__(self, spec: str):
        self.name = spec
        self.file = Path(spec[len(PREFIX) :]).expanduser()
        if not self.file.is_file():
            raise UserError(f"--data {spec}: no such file {self.file}")

    def identity(self) -> str:
        return f"csv:{self.file.resolve()}"

    def open(self, key: str) -> str:
        return key

    def _rows(self) -> tuple[list[tuple[int, str, str, str]], bool]:
        """(row number, path, class, side) of every row, and whether a split is given."""
        with open(self.file, newline="", encoding="utf-8-sig") as handle:
            reader = csv.reader(handle)
            header = next(reader, None)
            if not header or len(header) < 2:
                raise UserError(
                    f"{self.file}: needs a header and two columns (an image path, a class)"
                )
            image = _column(header, IMAGE_COLUMNS, 0)
            label = _column(header, LABEL_COLUMNS, 1 if image == 0 else 0)
            split = _column(header, ("split",), -1)
            rows = []
            for number, row in enumerate(reader, start=2):
                if not any(cell.strip() for cell in row):
                    continue  # a blank line is no row
                cells = [c.strip() for c in row] + [""] * len(header)
                side = cells[split].lower() if split >= 0 else "train"
                if side not in SIDES:
                    raise UserError(
                        f"{self.file}, row {number}: split {side!r} is not train or val"
                    )
                if not cells[image]:
                    raise UserError(f"{self.file}, row {number}: no image path")
                if not cells[label]:
                    raise UserError(f"{self.file}, row {number}: no class for {cells[image]}")
                rows.append((number, cells[image], cells[label], side))
        if not rows:
            raise UserError(f"{self.file}: lists no image")
        return rows, split >= 0

    def list_entries(self, node: int = 0, nodes: int = 1) -> Listing:
        rows, given = self._rows()
        classes = class_order({label for _, _, label, _ in rows})
        if len(classes) < 2:
            raise UserError(f"{self.file}: one class ({classes[0]}); a classifier needs 2")
        index = {name: i for i, name in enumerate(classes)}
        folder = self.file.parent
        keys, sizes, versions = [], [], []
        for number, path, _, _ in rows:
            full = os.path.join(folder, os.path.expanduser(path))
            try:
                info = os.stat(full)
            except OSError:
                raise UserError(f"{self.file}, row {number}: no image file {full}") from None
            keys.append(full)
            sizes.append(info.st_size)
            versions.append(info.st_mtime_ns)
        samples = Samples(
            PackedStrings.of(keys),
            np.array([index[label] for _, _, label, _ in rows], np.int32),
            self,
            np.array(sizes, np.int64),
            np.array(versions, np.int64),
        )
        sides = np.array([SIDES[side] for *_, side in rows], np.int8)
        return Listing(classes, samples, sides if given else None, "given" if given else "split")


def _open(data: str, options: SourceOptions) -> CsvSource:
    return CsvSource(data)


SOURCE = SourceKind(open=_open, prefix=PREFIX)
