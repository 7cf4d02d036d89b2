"""Scores over the classes, from the exact confusion matrix: each class's precision,
recall and F1, and their means over the classes that have validation images."""

from __future__ import annotations

from paratrain.report.scores.base import Score, Totals
from paratrain.report.scores.multilabel import counts_at


def per_class(totals: Totals) -> list[dict[str, float | int | None]]:
    """Each class's precision, recall, F1 and support; None where undefined (no image of
    the class, or none predicted as it). Several labels an image: at the threshold."""
    if totals.outputs is not None and totals.truth is not None and totals.threshold is not None:
        hits, false_pos, false_neg = counts_at(totals.outputs, totals.truth, totals.threshold)
        return _rows(hits, hits + false_neg, hits + false_pos)
    if totals.confusion is None:
        return []
    matrix = totals.confusion.double()
    return _rows(matrix.diagonal(), matrix.sum(dim=1), matrix.sum(dim=0))


def _rows(hits, support, predicted) -> list[dict[str, float | int | None]]:
    rows: list[dict[str, float | int | None]] = []
    for i in range(len(hits)):
        precision = float(hits[i] / predicted[i]) if predicted[i] else None
        recall = float(hits[i] / support[i]) if support[i] else None
        f1 = (
            2 * precision * recall / (precision + recall)
            if precision is not None and recall is not None and precision + recall > 0
            else (0.0 if support[i] else None)
        )
        rows.append(
            {"precision": precision, "recall": recall, "f1": f1, "support": int(support[i])}
        )
    return rows


def _mean_over_classes(key: str):
    def compute(totals: Totals) -> float | None:
        values = [r[key] for r in per_class(totals) if r["support"]]
        return sum(values) / len(values) if values else None  # type: ignore[arg-type]

    return compute


SCORES = {
    "macro_f1": Score("macro_f1", _mean_over_classes("f1"), label="macro-F1"),
    "balanced_acc": Score("balanced_acc", _mean_over_classes("recall"), label="balanced accuracy"),
}
