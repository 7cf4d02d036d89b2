"""`paratrain eval` reports: per-class accuracy, confusion matrix (CSV and PNG), mistakes."""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from paratrain.data.folder import DataSplit
from paratrain.report.plots import plot_confusion


def write_evaluation(
    confusion: torch.Tensor, predictions: list[tuple[int, int]], split: DataSplit, out: Path
) -> Path:
    """``confusion``: [true, predicted] counts; ``predictions``: (val index, predicted
    class) for every validation image."""
    out.mkdir(parents=True, exist_ok=True)
    classes, matrix = split.classes, confusion
    with open(out / "per_class.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["class", "correct", "total", "accuracy"])
        for i, name in enumerate(classes):
            total = int(matrix[i].sum())
            correct = int(matrix[i, i])
            writer.writerow([name, correct, total, f"{correct / total:.6f}" if total else ""])
    with open(out / "confusion_matrix.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["true \\ predicted", *classes])
        for i, name in enumerate(classes):
            writer.writerow([name, *matrix[i].tolist()])
    plot_confusion(matrix.numpy(), classes, out / "confusion_matrix.png")
    with open(out / "misclassified.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "true", "predicted"])
        for index, predicted in predictions:
            path, label = split.val[index]
            if predicted != label:
                writer.writerow([path, classes[label], classes[predicted]])
    return out
