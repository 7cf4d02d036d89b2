"""Several labels per image, carried as one number per image.

A multi-label listing keeps each image's labels as the number of its *label set*: the
distinct combinations of labels, each a row of 0/1 over the classes (``table``). The
samples, the split, the screen, the cache and the samplers then carry one int32 per
image as they do for one class per image, and the step turns the numbers into 0/1
targets with one lookup on the device (engine/run/task.py). Real sets hold far fewer
combinations than images (a million images of 20 labels: a few thousand rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def encode(labels: Sequence[Sequence[int]], classes: int) -> tuple[np.ndarray, np.ndarray]:
    """(each image's label-set number, the table of label sets [sets, classes] of 0/1)
    for ``labels``: each image's class indices."""
    numbers: dict[tuple[int, ...], int] = {}
    ids = np.empty(len(labels), np.int32)
    for i, row in enumerate(labels):
        key = tuple(sorted(set(row)))
        ids[i] = numbers.setdefault(key, len(numbers))
    table = np.zeros((len(numbers), classes), np.uint8)
    for key, number in numbers.items():
        table[number, list(key)] = 1
    return ids, table


def label_counts(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    """How many of the images ``ids`` carry each class."""
    sets = np.bincount(ids, minlength=len(table)) if len(ids) else np.zeros(len(table), np.int64)
    return sets @ table.astype(np.int64)
