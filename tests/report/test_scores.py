"""A validation score is one entry in its family's module plus one registry line
(report/scores): every one is computed from the exact totals, is a metrics column and a
--monitor choice, and nothing outside report/scores dispatches on a score's name."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from paratrain.config import TrainConfig
from paratrain.engine.inference.evaluate import EvalResult
from paratrain.report.metrics import COLUMNS
from paratrain.report.scores import SCORES
from paratrain.report.scores.base import Score, Totals, compute_all, ranking, score

SRC = Path(__file__).resolve().parents[2] / "src" / "paratrain"
# 14 images of 3 classes (the last has none), 11 right at once, 13 within five guesses
TOTALS = Totals(
    loss=0.5, top1=11 / 14, top5=13 / 14, count=14,
    confusion=torch.tensor([[8, 2, 0], [1, 3, 0], [0, 0, 0]]),
)  # fmt: skip


# 4 images of 3 labels: their probabilities and labels; class 2 has no positive
OUTPUTS = torch.tensor([[0.9, 0.2, 0.1], [0.6, 0.7, 0.3], [0.3, 0.8, 0.2], [0.2, 0.4, 0.6]])
TRUTH = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 1, 0]], dtype=torch.bool)
SEVERAL = Totals(loss=0.4, top1=None, top5=None, count=4, outputs=OUTPUTS, truth=TRUTH,
                 threshold=0.5)  # fmt: skip


def test_nothing_outside_the_scores_package_dispatches_on_a_scores_name():
    found = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "scores":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict | ast.Tuple | ast.List | ast.Set):
                names = {
                    n.value
                    for n in ast.walk(node)
                    if isinstance(n, ast.Constant) and n.value in SCORES
                }
                if len(names) >= 3:  # ("loss", "top1") pairs are a row's own fields
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} lists {sorted(names)}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("name", list(SCORES))
def test_every_score_is_registered_computed_a_column_and_a_monitor_choice(name):
    found = score(name)
    assert isinstance(found, Score) and found.name == name
    value = found.compute(SEVERAL if name == "map" else TOTALS)
    assert value is not None and math.isfinite(value)
    assert f"val_{name}" in COLUMNS
    TrainConfig(monitor=name).validate()  # --monitor takes it
    worse = ranking(name, value - 0.1 if found.higher_is_better else value + 0.1)
    assert ranking(name, value) > worse  # --monitor prefers the better value


def test_the_scores_of_known_totals():
    scores = compute_all(TOTALS)
    f1 = [2 * p * r / (p + r) for p, r in ((8 / 9, 0.8), (3 / 5, 0.75))]
    assert scores["top1"] == 11 / 14 and scores["top5"] == 13 / 14
    assert scores["top5_error"] == pytest.approx(1 / 14)  # added as one entry + one line
    assert scores["macro_f1"] == pytest.approx(sum(f1) / 2)
    assert scores["balanced_acc"] == pytest.approx((0.8 + 0.75) / 2)
    assert scores["loss"] == 0.5 and ranking("loss", 0.5) == -0.5
    few = compute_all(Totals(loss=0.5, top1=1.0, top5=None, count=3))
    assert few["top5"] is None and few["top5_error"] is None  # fewer than 5 classes
    assert ranking("top5_error", None) == float("-inf")


def test_the_scores_of_several_labels_an_image():
    """Class 0: positives ranked 1st and 2nd (AP 1); class 1: positives at 0.8, 0.7,
    0.4 with a negative at 0.2 (AP 1). At 0.5: 4 of 5 labels said, and one said wrong
    (image 3's class 2): micro-F1 8/10; per class F1 1 and 0.8; class 2 has no
    positive, so no F1, and no AP."""
    scores = compute_all(SEVERAL)
    assert scores["map"] == 1.0 and scores["top1"] is None and scores["top5"] is None
    assert scores["micro_f1"] == pytest.approx(8 / 10)
    assert scores["macro_f1"] == pytest.approx((1 + 0.8) / 2)
    assert compute_all(TOTALS)["map"] is None  # one class an image: no mAP
    assert compute_all(TOTALS)["micro_f1"] == TOTALS.top1


def test_an_evaluation_result_reports_every_score_and_monitors_by_them():
    result = EvalResult(loss=0.5, top1=11 / 14, top5=13 / 14, count=14, confusion=TOTALS.confusion)
    assert result.as_dict() == {"count": 14, **compute_all(TOTALS)}
    assert result.score("top5_error") == pytest.approx(-1 / 14)
    with pytest.raises(KeyError, match="the scores are loss, top1"):
        score("accuracy")
