"""Scores of several labels an image, from every validation image's probabilities,
gathered from every rank in the images' order (so the same at any world size): average
precision per class and its mean (mAP), and micro-F1 at the threshold chosen on the
same images (the one of THRESHOLDS with the highest micro-F1, ties to the one nearest
0.5). Per-class precision, recall and F1 at that threshold are report/scores/per_class's.
"""

from __future__ import annotations

import torch

from paratrain.report.scores.base import Score, Totals

THRESHOLDS = tuple(round(0.05 * i, 2) for i in range(1, 20))  # 0.05 .. 0.95


def average_precision(scores: torch.Tensor, truth: torch.Tensor) -> float | None:
    """The mean, over the positives, of the precision among the images scored at least
    as high (tied scores count together: scikit-learn's average_precision_score). None
    without a positive."""
    positives = int(truth.sum())
    if positives == 0:
        return None
    order = torch.argsort(scores.double(), descending=True, stable=True)
    ranked, hits = scores.double()[order], truth[order].double()
    true_pos, seen = hits.cumsum(0), torch.arange(1, len(hits) + 1, dtype=torch.float64)
    last = torch.ones(len(ranked), dtype=torch.bool)  # the last of each run of tied scores
    last[:-1] = ranked[1:] != ranked[:-1]
    true_pos, seen = true_pos[last], seen[last]
    gained = torch.diff(true_pos, prepend=torch.zeros(1, dtype=torch.float64))
    return float((gained * true_pos / seen).sum() / positives)


def per_class_ap(totals: Totals) -> list[float | None]:
    """Each class's average precision (None: no positive among the validation images)."""
    if totals.outputs is None or totals.truth is None:
        return []
    return [
        average_precision(totals.outputs[:, c], totals.truth[:, c])
        for c in range(totals.outputs.shape[1])
    ]


def counts_at(
    outputs: torch.Tensor, truth: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per class: true positives, false positives and false negatives at ``threshold``."""
    said, real = outputs >= threshold, truth.bool()
    return (
        (said & real).sum(0).double(),
        (said & ~real).sum(0).double(),
        (~said & real).sum(0).double(),
    )


def _micro_f1(outputs: torch.Tensor, truth: torch.Tensor, threshold: float) -> float:
    tp, fp, fn = (float(x.sum()) for x in counts_at(outputs, truth, threshold))
    return 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0


def choose_threshold(outputs: torch.Tensor, truth: torch.Tensor) -> float:
    """The threshold of THRESHOLDS with the highest micro-F1 (ties: nearest 0.5)."""
    return max(THRESHOLDS, key=lambda t: (_micro_f1(outputs, truth, t), -abs(t - 0.5)))


def _map(totals: Totals) -> float | None:
    found = [ap for ap in per_class_ap(totals) if ap is not None]
    return sum(found) / len(found) if found else None


def _micro(totals: Totals) -> float | None:
    """Micro-F1: of several labels, at the chosen threshold; of one class an image, the
    share right at the first guess (every miss is one false positive and one false
    negative)."""
    if totals.outputs is None or totals.truth is None or totals.threshold is None:
        return totals.top1
    return _micro_f1(totals.outputs, totals.truth, totals.threshold)


SCORES = {
    "map": Score("map", _map, label="mAP"),
    "micro_f1": Score("micro_f1", _micro, label="micro-F1"),
}
