"""`paratrain eval` reports: per-class accuracy, confusion matrix (CSV and PNG), mistakes."""

from __future__ import annotations

import csv
from pathlib import Path

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
    lines.append(f"  {'class'.ljust(width)}  accuracy  precision  recall  F1")
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
        f"per-class accuracy, confusion matrix and misclassified files in {report['report_dir']}"
    )
    return "\n".join(lines)


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
