"""What a label means to the loss and to the train accuracy: one class an image
(``multiclass``: cross-entropy over the classes) or several (``multilabel``: a sigmoid per
class with binary cross-entropy, the label sets of data/label_sets.py looked up on the
device as 0/1 targets). MixUp/CutMix and label smoothing act on the 0/1 targets as they
act on one-hot ones; the train accuracy of a multi-label step is the share of (image,
class) pairs right at probability 0.5.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn


class MultiClass:
    """One class an image: the labels are the targets."""

    name = "multiclass"
    threshold: float | None = None  # a probability above which a label is said

    def observe(self, result: Any) -> None:
        """An evaluation's result (engine/inference/evaluate.EvalResult): nothing to keep."""

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        return labels

    def correct(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The images whose highest-scored class is right."""
        return (logits.argmax(1) == labels).sum()


class MultiLabel:
    """Several labels an image: a label numbers a row of ``table`` (label sets x classes)."""

    name = "multilabel"

    def __init__(self, table: np.ndarray, device: torch.device):
        self.table = torch.as_tensor(table, dtype=torch.float32, device=device)
        self.threshold: float | None = 0.5  # until an evaluation chooses one

    def observe(self, result: Any) -> None:
        """The threshold the evaluation chose: what the checkpoint keeps for predict."""
        if result.threshold is not None:
            self.threshold = result.threshold

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        """Each image's 0/1 row over the classes (one gather on the device)."""
        return self.table.to(labels.device)[labels.long()]

    def correct(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The images' shares of classes right at probability 0.5, summed."""
        truth = self.targets(labels) > 0.5
        return ((logits > 0) == truth).float().mean(dim=1).sum()


Task = MultiClass | MultiLabel


def task_of(table: np.ndarray | None, device: torch.device) -> Task:
    """The task of a split's labels: multi-label where it has label sets."""
    return MultiClass() if table is None else MultiLabel(table, device)


class MultiLabelLoss(nn.Module):
    """Binary cross-entropy of a sigmoid per class against 0/1 (or mixed) targets, the
    mean over images and classes; ``smoothing`` moves each target towards 1/classes as
    timm's BinaryCrossEntropy does (1 -> 1 - s + s/C, 0 -> s/C)."""

    def __init__(self, smoothing: float = 0.0):
        super().__init__()
        self.smoothing = smoothing

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        targets = targets.to(logits.dtype)
        if self.smoothing:
            targets = targets * (1 - self.smoothing) + self.smoothing / targets.shape[1]
        return nn.functional.binary_cross_entropy_with_logits(logits, targets)


def multilabel_mixer(mixup: float, cutmix: float) -> Callable | None:
    """MixUp / CutMix of images and their 0/1 targets (one of the two per batch when both
    are on): the batch mixed with itself rolled by one, as torchvision's v2 mixers do,
    the targets in the same proportion (CutMix: the pasted box's share of the image)."""
    alphas = [(kind, alpha) for kind, alpha in (("mixup", mixup), ("cutmix", cutmix)) if alpha]
    if not alphas:
        return None

    def mix(images: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kind, alpha = alphas[int(torch.randint(len(alphas), ()))]
        lam = float(torch.distributions.Beta(alpha, alpha).sample())
        rolled = images.roll(1, 0)
        if kind == "mixup":
            images = images * lam + rolled * (1 - lam)
        else:
            height, width = images.shape[-2:]
            cut_h, cut_w = int(height * (1 - lam) ** 0.5), int(width * (1 - lam) ** 0.5)
            y, x = int(torch.randint(height, ())), int(torch.randint(width, ()))
            top, bottom = max(y - cut_h // 2, 0), min(y + cut_h // 2, height)
            left, right = max(x - cut_w // 2, 0), min(x + cut_w // 2, width)
            images = images.clone()
            images[..., top:bottom, left:right] = rolled[..., top:bottom, left:right]
            lam = 1 - (bottom - top) * (right - left) / (height * width)
        targets = targets.float()
        return images, targets * lam + targets.roll(1, 0) * (1 - lam)

    return mix
