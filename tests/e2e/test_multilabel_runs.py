"""Several labels an image, as a user meets it: a labels file with several labels a row
trains a multi-label run on 2 processes, best.pt by mAP; eval reports each class's AP;
predict says every label above the threshold the run chose; an export records the task
and the threshold; --task multilabel on a folder is one line."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from imagefolders import make_image_folder, make_multilabel_folder
from paratrain.cli import main
from trainruns import run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("multilabel")
    listing = make_multilabel_folder(root / "data", classes=4, images=60)
    out, _ = run(
        root, "--data", str(root / "data"), "--labels", str(listing), "--nproc", "2",
        "--epochs", "3", "--name", "ml", "--model", "resnet18", "--image-size", "32",
        "--batch-size", "8", "--workers", "0", "--mixup", "0.2", "--label-smoothing", "0.1",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return root, root / "data", root / "runs/ml/checkpoints/best.pt"


def test_a_labels_file_of_several_labels_trains_a_multilabel_run(trained):
    root, _, best = trained
    rows = [json.loads(r) for r in (root / "runs/ml/metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["val_top1"] is None and 0 <= row["val_map"] <= 1
        assert row["val_threshold"] in [round(0.05 * i, 2) for i in range(1, 20)]
        assert 0 <= row["val_micro_f1"] <= 1 and row["val_count"] == 12
    assert rows[-1]["val_map"] > 0.6  # the stripes' colours are learnable
    state = torch.load(best, weights_only=False)
    assert state["config"]["task"] == "multilabel" and state["config"]["monitor"] == "map"
    assert state["parts"]["best"]["monitor"] == "map"
    assert state["parts"]["best"]["score"] == max(r["val_map"] for r in rows)
    chosen = next(r for r in rows if r["val_map"] == state["parts"]["best"]["score"])
    assert state["parts"]["recipe"]["threshold"] == chosen["val_threshold"]


def test_eval_reports_each_class_ap_and_the_labels_said(trained, capsys):
    root, _, best = trained
    assert main(["eval", "--checkpoint", str(best), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["count"] == 12 and report["top1"] is None
    aps = [ap for ap in report["per_class"].values() if ap is not None]
    assert report["map"] == pytest.approx(sum(aps) / len(aps))
    with open(root / "runs/ml/eval/labels.csv") as handle:
        labelled = list(csv.DictReader(handle))
    assert len(labelled) == 12 and all(r["labels"] for r in labelled)
    with open(root / "runs/ml/eval/per_class.csv") as handle:
        assert [r["class"] for r in csv.DictReader(handle)] == [f"label_{i}" for i in range(4)]


def test_predict_says_every_label_above_the_threshold_and_export_records_it(
    trained, capsys, tmp_path
):
    from safetensors import safe_open

    from paratrain.engine.inference.predict import predict

    root, data, best = trained
    threshold = torch.load(best, weights_only=False)["parts"]["recipe"]["threshold"]
    rows, _ = predict(str(best), [str(data / "002.png"), str(data / "007.png")])
    for row in rows:
        assert row["threshold"] == threshold
        assert all(p >= threshold for _, p in row["labels"])
        said = {name for name, _ in row["labels"]}
        assert said == {name for name, p in row["top"] if p >= threshold}  # 4 classes: all
    assert main(["predict", "--checkpoint", str(best), str(data / "002.png")]) == 0
    assert f"(at or above {threshold:g})" in capsys.readouterr().out
    out = tmp_path / "w.safetensors"
    assert (
        main(["export", "--checkpoint", str(best), "--format", "safetensors", "--out", str(out)])
        == 0
    )
    with safe_open(str(out), framework="pt") as handle:
        meta = handle.metadata()
    assert json.loads(meta["paratrain.task"]) == "multilabel"
    assert json.loads(meta["paratrain.threshold"]) == threshold


def test_multilabel_on_a_folder_is_one_line(tmp_path):
    folder = make_image_folder(tmp_path / "data", classes=2, per_class=4)
    out, _ = run(tmp_path, "--data", str(folder), "--task", "multilabel", "--epochs", "1",
                 "--name", "x", "--model", "resnet18", "--image-size", "16", "--workers", "0")  # fmt: skip
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert lines == [
        f"paratrain: error: --task multilabel: --data {folder} gives one class an image (an "
        "image folder's class is its subfolder); several labels an image come from a labels "
        "file (--labels FILE.csv|.jsonl, names separated by ; or |, or 0/1 columns) or a "
        "dataset's Sequence(ClassLabel) column"
    ]
