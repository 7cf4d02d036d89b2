"""`paratrain eval` reports: per-class accuracy, confusion matrix (CSV and PNG), mistakes."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import torch

from paratrain.data.folder import DataSplit
from paratrain.report.plots import plot_confusion
from paratrain.report.scores import SCORES
from paratrain.report.scores.base import shown


def format_report(report: dict) -> str:
    """`paratrain eval`'s lines: the totals, then each class's accuracy."""

    def share(value) -> str:
        return "-" if value is None else f"{value:.2%}"

    figures = "  ".join(
        shown(name, report[name]) for name in SCORES if report.get(name) is not None
    )  # every registered score the evaluation has (report/scores)
    lines = [f"{report['count']} images on {report['world_size']} process(es): {figures}"]
    width = max(len("class"), *(len(name) for name in report["per_class"]))
    scores = report.get("per_class_scores", {})
    several = report.get("threshold") is not None  # several labels an image: AP, not accuracy
    first = "      AP" if several else "accuracy"
    lines.append(f"  {'class'.ljust(width)}  {first}  precision  recall  F1")
    for name, accuracy in report["per_class"].items():
        if accuracy is None:
            lines.append(f"  {name.ljust(width)}  no images")
            continue
        row = scores.get(name, {})
        lines.append(
            f"  {name.ljust(width)}  {accuracy:8.2%}  {share(row.get('precision')):>9}  "
            f"{share(row.get('recall')):>6}  {share(row.get('f1'))}"
        )
    lines.append(
        f"per-class AP and F1 at threshold {report['threshold']:g}, and each image's labels, "
        f"in {report['report_dir']}"
        if several
        else f"per-class accuracy, confusion matrix and misclassified files in {report['report_dir']}"
    )
    return "\n".join(lines)


def write_label_sets_evaluation(result: Any, split: DataSplit, out: Path) -> Path:
    """Several labels an image (``result``: an EvalResult with every image's
    probabilities): per_class.csv (AP; precision, recall, F1 and support at the chosen
    threshold) and labels.csv (each validation image's labels and those said)."""
    out.mkdir(parents=True, exist_ok=True)
    rows = result.per_class()
    with open(out / "per_class.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["class", "ap", "precision", "recall", "f1", "support"])
        for name, ap, row in zip(split.classes, result.per_class_ap(), rows, strict=True):
            cells = [ap, row["precision"], row["recall"], row["f1"]]
            writer.writerow(
                [name, *("" if v is None else f"{v:.6f}" for v in cells), row["support"]]
            )
    said = result.outputs >= result.threshold
    with open(out / "labels.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "labels", "predicted"])
        for i, (path, _) in enumerate(split.val):
            truth, guess = result.truth[i].tolist(), said[i].tolist()
            writer.writerow([
                path,
                ";".join(c for c, t in zip(split.classes, truth, strict=True) if t),
                ";".join(c for c, g in zip(split.classes, guess, strict=True) if g),
            ])  # fmt: skip
    return out


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
            path, label = split.val[int(index)]
            if predicted != label:
                writer.writerow([path, classes[label], classes[predicted]])
    return out
