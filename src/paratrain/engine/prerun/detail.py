"""Whether a lower resolution keeps what tells the classes apart (--budget-recipe auto).

The low-resolution recipe trains and evaluates at about 5/8 and 3/4 of the sizes given.
Where the classes differ in detail that such a resize averages away (a fine texture, a
print, a small mark), the recipe cannot reach the accuracy of the sizes given, however
many epochs it fits. Before choosing it, a few training images are looked at both ways,
as validation sees them (resized, center-cropped): each image becomes the mean and the
spread of every channel in a 4x4 grid of cells, and a nearest-class-mean classifier,
fitted on half of the images, is scored on the other half and the other way round. When
the sizes given tell the classes apart clearly better than the low ones (by
``MARGIN``), the detail carries the class, and the run keeps its sizes.

Cheap (a few hundred small decodes and a few matrix products), and blind to what only
training would find; it is there to catch the set whose signal the resize destroys,
and the start line says both scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torchvision.transforms.v2.functional as F

from paratrain.config import TrainConfig
from paratrain.data.folder import load_rgb
from paratrain.data.samples import Samples
from paratrain.data.transforms import to_chw

__all__ = ["DetailCheck", "check_detail"]

PER_CLASS = 24  # images a class, at most, looked at
MOST = 256  # images in all, at most (at least 4 a class)
GRID = 4
MARGIN = 0.15  # the sizes given must beat the low ones by this much to be kept


@dataclass(frozen=True)
class DetailCheck:
    given: float  # nearest-class-mean accuracy at the sizes given
    low: float  # at the low-resolution recipe's
    images: int

    @property
    def lost(self) -> bool:
        return self.given - self.low > MARGIN

    def words(self, given: int, low: int) -> str:
        return (
            f"the classes told apart by {self.given:.0%} of {self.images} images at {given} "
            f"px and {self.low:.0%} at {low} px (nearest class mean of each cell's colour "
            "and contrast)"
        )


def check_detail(
    samples: Samples, cfg: TrainConfig, low: TrainConfig, seed: int = 0
) -> DetailCheck:
    """How well a few training images' cells tell their classes apart, at ``cfg``'s
    validation sizes and at ``low``'s."""
    picked = _picked(samples.labels, seed)
    labels = samples.labels[picked]
    # decoded no larger than validation needs (a JPEG at a fraction of its size)
    at_least = max(cfg.eval_resize, low.eval_resize)
    pictures = [to_chw(load_rgb(samples.keys[i], at_least, samples.source)) for i in picked]
    given = _accuracy(np.stack([_cells(p, cfg) for p in pictures]), labels)
    lowered = _accuracy(np.stack([_cells(p, low) for p in pictures]), labels)
    return DetailCheck(given, lowered, len(picked))


def _picked(labels: np.ndarray, seed: int) -> np.ndarray:
    """Up to PER_CLASS images of each class, drawn by ``seed``."""
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    each = max(4, min(PER_CLASS, MOST // len(classes)))
    chosen = [rng.permutation(np.flatnonzero(labels == label))[:each] for label in classes]
    return np.sort(np.concatenate(chosen))


def _cells(image: torch.Tensor, cfg: TrainConfig) -> np.ndarray:
    """Each cell's mean and standard deviation per channel, of the image as validated."""
    view = F.center_crop(F.resize(image, [cfg.eval_resize], antialias=True), [cfg.eval_crop])
    x = view.float().unsqueeze(0)
    mean = torch.nn.functional.adaptive_avg_pool2d(x, GRID)
    spread = torch.nn.functional.adaptive_avg_pool2d(x * x, GRID) - mean * mean
    return torch.cat([mean, spread.clamp_min(0).sqrt()], 1).flatten().numpy()


def _accuracy(features: np.ndarray, labels: np.ndarray) -> float:
    """Two-fold nearest-class-mean accuracy on standardised features."""
    z = (features - features.mean(0)) / (features.std(0) + 1e-6)
    halves = np.arange(len(labels)) % 2
    right = 0
    for fold in (0, 1):
        fit, test = halves != fold, halves == fold
        classes = np.unique(labels[fit])
        means = np.stack([z[fit & (labels == c)].mean(0) for c in classes])
        distance = ((z[test][:, None, :] - means[None]) ** 2).sum(-1)
        right += int((classes[distance.argmin(1)] == labels[test]).sum())
    return right / len(labels)
