"""Top-k scores: the shares of images whose right class is among the k highest (summed
over every rank before dividing, so exact at any world size)."""

from __future__ import annotations

from paratrain.report.scores.base import Score, Totals


def _top5_error(totals: Totals) -> float | None:
    return None if totals.top5 is None else 1.0 - totals.top5


SCORES = {
    "top1": Score("top1", lambda t: t.top1),
    "top5": Score("top5", lambda t: t.top5),
    "top5_error": Score("top5_error", _top5_error, higher_is_better=False, label="top-5 error"),
}
