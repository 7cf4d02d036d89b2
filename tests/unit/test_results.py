"""After training: curves, per-class evaluation, predictions that agree with eval."""

from __future__ import annotations

import csv
import json

import pytest

from imagefolders import make_image_folder
from paratrain import TrainConfig, train
from paratrain.cli import main
from paratrain.data.folder import build_split


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    data = make_image_folder(root / "data", classes=3, per_class=15)
    summary = train(
        TrainConfig(
            data=str(data),
            model="resnet18",
            image_size=16,
            epochs=2,
            batch_size=8,
            workers=0,
            output_dir=str(root / "runs"),
            name="r",
            lr=0.05,
        )
    )
    return root, data, summary


def test_curves_png_is_written_every_epoch(trained_run):
    root, _, summary = trained_run
    assert summary["epochs"] == 2
    curves = root / "runs/r/curves.png"
    assert curves.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_reports_per_class_and_confusion(trained_run, capsys):
    root, data, _ = trained_run
    checkpoint = str(root / "runs/r/checkpoints/last.pt")
    assert main(["eval", "--checkpoint", checkpoint, "--data", str(data), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    report = root / "runs/r/eval"
    assert result["report_dir"] == str(report)
    with open(report / "confusion_matrix.csv") as handle:
        rows = list(csv.reader(handle))
    matrix = [[int(x) for x in row[1:]] for row in rows[1:]]
    assert rows[0][1:] == ["class_0", "class_1", "class_2"]
    assert sum(map(sum, matrix)) == result["count"] == 9
    assert sum(matrix[i][i] for i in range(3)) == round(result["top1"] * 9)
    for i, name in enumerate(rows[0][1:]):
        assert result["per_class"][name] == pytest.approx(matrix[i][i] / sum(matrix[i]))
    with open(report / "misclassified.csv") as handle:
        wrong = list(csv.DictReader(handle))
    assert len(wrong) == 9 - sum(matrix[i][i] for i in range(3))
    assert all(r["true"] != r["predicted"] for r in wrong)
    assert (report / "confusion_matrix.png").read_bytes()[:4] == b"\x89PNG"


def test_predict_agrees_with_eval(trained_run, capsys, tmp_path):
    root, data, _ = trained_run
    checkpoint = str(root / "runs/r/checkpoints/last.pt")
    assert main(["eval", "--checkpoint", checkpoint, "--data", str(data), "--json"]) == 0
    top1 = json.loads(capsys.readouterr().out)["top1"]
    val = build_split(data).val
    out_csv = tmp_path / "pred.csv"
    code = main(
        [
            "predict",
            "--checkpoint",
            checkpoint,
            *[p for p, _ in val],
            "--top-k",
            "2",
            "--csv",
            str(out_csv),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == len(val)
    with open(out_csv) as handle:
        rows = list(csv.DictReader(handle))
    assert list(rows[0]) == ["path", "class_1", "prob_1", "class_2", "prob_2"]
    truth = {p: f"class_{label}" for p, label in val}
    hits = sum(row["class_1"] == truth[row["path"]] for row in rows)
    assert hits / len(val) == top1
    assert all(float(r["prob_1"]) >= float(r["prob_2"]) for r in rows)


def test_predict_takes_folders_and_rejects_missing_paths(trained_run, capsys):
    root, data, _ = trained_run
    checkpoint = str(root / "runs/r/checkpoints/last.pt")
    assert main(["predict", "--checkpoint", checkpoint, str(data / "class_1")]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 15
    assert main(["predict", "--checkpoint", checkpoint, str(root / "nope.jpg")]) == 2
    assert "no such image or folder" in capsys.readouterr().err
