"""After training: curves, per-class evaluation, predictions that agree with eval."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch
from PIL import Image

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


def test_predict_skips_unreadable_and_hidden_images_and_says_so(trained_run, capsys, tmp_path):
    import shutil

    root, data, _ = trained_run
    checkpoint = str(root / "runs/r/checkpoints/last.pt")
    folder = tmp_path / "mixed"
    shutil.copytree(data / "class_1", folder)
    (folder / "broken.jpg").write_bytes(b"not an image")
    (folder / ".hidden.jpg").write_bytes(b"editor droppings")  # as training's scan: left out
    out_csv = tmp_path / "pred.csv"
    assert main(["predict", "--checkpoint", checkpoint, str(folder), "--csv", str(out_csv)]) == 2
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 15  # every readable image still predicted
    assert len(out_csv.read_text().splitlines()) == 16  # header and those 15
    errors = captured.err.splitlines()
    assert errors[0].startswith(f"paratrain: skipped {folder / 'broken.jpg'}: ")
    assert ".hidden.jpg" not in captured.err
    assert errors[-1] == (
        "paratrain: error: 1 of 16 image(s) could not be read (listed above); the others "
        "were predicted"
    )


def test_export_pt2_round_trips(trained_run, tmp_path, capsys):
    from paratrain.engine.inference.predict import load_for_inference, load_program

    root, _, _ = trained_run
    checkpoint = str(root / "runs/r/checkpoints/last.pt")
    assert main(["export", "--checkpoint", checkpoint, "--format", "pt2"]) == 0
    out = root / "runs/r/export/model.pt2"
    assert str(out) in capsys.readouterr().out
    program, meta = load_program(out)
    model, _, classes = load_for_inference(checkpoint, torch.device("cpu"))
    assert meta["classes"] == classes and meta["image_size"] == 16
    for batch in (1, 3):  # the batch dimension stays dynamic
        images = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            torch.testing.assert_close(program(images), model(images), rtol=1e-5, atol=1e-5)
    index = json.loads((root / "runs/r/export/class_indices.json").read_text())
    assert index == {"0": "class_0", "1": "class_1", "2": "class_2"}


def test_export_onnx_runs_in_onnxruntime_like_torch_and_predict_takes_it(trained_run, capsys):
    pytest.importorskip("onnxruntime")  # the [onnx] extra; the test extras install it
    import onnx
    import onnxruntime

    from paratrain.data.transforms import eval_transform
    from paratrain.engine.inference.predict import load_for_inference

    root, data, _ = trained_run
    checkpoint = str(root / "runs/r/checkpoints/last.pt")
    assert main(["export", "--checkpoint", checkpoint, "--format", "onnx"]) == 0
    out = root / "runs/r/export/model.onnx"
    assert str(out) in capsys.readouterr().out
    meta = json.loads({p.key: p.value for p in onnx.load(str(out)).metadata_props}["paratrain"])
    model, cfg, classes = load_for_inference(checkpoint, torch.device("cpu"))
    assert meta["classes"] == classes and meta["image_size"] == cfg.eval_crop == 16
    assert (meta["mean"], meta["std"]) == (list(cfg.norm_mean), list(cfg.norm_std))
    # a few real images through the eval transform the metadata describes, batch dynamic
    transform = eval_transform(
        meta["image_size"], meta["resize"], meta["interpolation"], meta["mean"], meta["std"]
    )
    images = [Image.open(p).convert("RGB") for p in sorted((data / "class_2").iterdir())[:5]]
    batch = torch.stack([transform(image) for image in images])
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["images"]
    for n in (1, 5):
        got = session.run(None, {"images": batch[:n].numpy()})[0]
        with torch.no_grad():
            torch.testing.assert_close(
                torch.from_numpy(got), model(batch[:n]), rtol=1e-4, atol=1e-4
            )
    # predict reads the .onnx (and the .pt2) as it reads the checkpoint: same answers
    folder = str(data / "class_2")
    assert main(["export", "--checkpoint", checkpoint, "--format", "pt2"]) == 0
    capsys.readouterr()
    said = {}
    for source in (checkpoint, str(out), str(root / "runs/r/export/model.pt2")):
        assert main(["predict", "--checkpoint", source, folder, "--top-k", "1"]) == 0
        said[source] = [line.rsplit(" ", 2) for line in capsys.readouterr().out.splitlines()]
    first, *others = said.values()
    assert len(first) == 15
    for rows in others:
        assert [r[:2] for r in rows] == [r[:2] for r in first]  # same image, same class
        for a, b in zip(rows, first, strict=True):
            assert float(a[2]) == pytest.approx(float(b[2]), abs=2e-3)


def test_predict_refuses_a_file_that_is_no_model_and_ema_on_an_export(trained_run, capsys):
    root, data, _ = trained_run
    bogus = root / "bogus.onnx"
    bogus.write_bytes(b"not a model")
    assert main(["predict", "--checkpoint", str(bogus), str(data / "class_0")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"paratrain: error: {bogus} is not an ONNX model") and "\n" not in err
    checkpoint = str(root / "runs/r/checkpoints/last.pt")
    assert (
        main(
            ["export", "--checkpoint", checkpoint, "--format", "pt2", "--out", str(root / "m.pt2")]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["predict", "--checkpoint", str(root / "m.pt2"), "--ema", str(data)]) == 2
    assert "--ema needs a checkpoint" in capsys.readouterr().err


def test_onnx_without_its_packages_names_the_extra(trained_run, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "onnxscript" else real(name, *a),
    )
    root, _, _ = trained_run
    checkpoint = str(root / "runs/r/checkpoints/last.pt")
    for dry in ([], ["--dry-run"]):
        assert main(["export", "--checkpoint", checkpoint, "--format", "onnx", *dry]) == 2
        from paratrain.version import install_extra

        assert capsys.readouterr().err.strip() == (
            f"paratrain: error: export --format onnx needs onnxscript: {install_extra('onnx')}"
        )


def test_export_safetensors_round_trips_and_trains_from(trained_run, tmp_path, capsys):
    from safetensors import safe_open

    from paratrain.engine.inference.predict import load_for_inference
    from paratrain.models.registry import create_model, load_weights, read_state_dict

    root, _, _ = trained_run
    checkpoint = str(root / "runs/r/checkpoints/last.pt")
    out = tmp_path / "weights.safetensors"
    assert (
        main(["export", "--checkpoint", checkpoint, "--format", "safetensors", "--out", str(out)])
        == 0
    )
    with safe_open(str(out), framework="pt") as handle:
        assert json.loads(handle.metadata()["paratrain.classes"]) == [
            "class_0",
            "class_1",
            "class_2",
        ]
    assert (tmp_path / "class_indices.json").is_file()
    model, _, _ = load_for_inference(checkpoint, torch.device("cpu"))
    again = create_model("resnet18", 3, 16)
    report = load_weights(again, read_state_dict(out), strict=True)  # also what --weights reads
    assert report.exact
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(again.eval()(images), model(images))


def test_runs_table_lists_finished_and_unfinished_runs(trained_run, tmp_path, capsys):
    import shutil

    root, _, summary = trained_run
    runs = tmp_path / "runs"
    shutil.copytree(root / "runs/r", runs / "r", ignore=shutil.ignore_patterns("*.pt"))
    (runs / "cut").mkdir()
    shutil.copy(runs / "r/config.yaml", runs / "cut/config.yaml")
    (runs / "cut/metrics.jsonl").write_text(
        (runs / "r/metrics.jsonl").read_text().splitlines()[0] + "\n"
    )
    (runs / "resumed").mkdir()  # resumed into a new folder: its rows begin at epoch 2
    shutil.copy(runs / "r/config.yaml", runs / "resumed/config.yaml")
    shutil.copy(runs / "r/summary.json", runs / "resumed/summary.json")
    (runs / "resumed/metrics.jsonl").write_text(
        (runs / "r/metrics.jsonl").read_text().splitlines()[1] + "\n"
    )
    (runs / "not-a-run").mkdir()
    assert main(["runs", str(runs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [
        "run",
        "model",
        "data",
        "world",
        "best_top1",
        "epochs",
        "time",
        "status",
    ]
    row = next(line for line in lines if line.startswith("r "))
    assert row.split()[:6] == [
        "r",
        "resnet18",
        "data",
        "1",
        f"{summary['best_val_top1']:.2%}",
        "2/2",
    ]
    assert row.endswith("done")
    assert any(line.startswith("cut ") and "stopped after epoch 1" in line for line in lines)
    resumed = next(line for line in lines if line.startswith("resumed "))
    assert resumed.split()[5] == "2/2" and resumed.endswith("done")
    assert len(lines) == 4
    assert main(["runs", str(runs), "--json"]) == 0
    assert {r["run"] for r in json.loads(capsys.readouterr().out)} == {"r", "cut", "resumed"}
    assert main(["runs", str(tmp_path / "nowhere")]) == 2
    assert "no such run folder" in capsys.readouterr().err


def test_ema_flag_without_ema_weights_is_one_clear_error(trained_run, tmp_path, capsys):
    root, data, _ = trained_run
    train(TrainConfig(data=str(data), image_size=16, epochs=1, batch_size=8, workers=0,
                      output_dir=str(tmp_path), name="plain", ema_decay=0.0))  # fmt: skip
    checkpoint = str(tmp_path / "plain/checkpoints/last.pt")
    for command in ("export", "eval", "predict"):
        extra = [str(root / "data")] if command == "predict" else []
        assert main([command, "--checkpoint", checkpoint, "--ema", *extra]) == 2
        assert "holds no EMA weights (its run kept none: --ema-decay 0" in (capsys.readouterr().err)


def test_a_class_without_validation_images_has_no_accuracy_rather_than_zero():
    from paratrain.engine.inference.evaluate import EvalResult
    from paratrain.report.evaluation import format_report

    confusion = torch.tensor([[3, 1, 0], [0, 0, 0], [1, 0, 1]])
    result = EvalResult(loss=0.5, top1=4 / 6, top5=None, count=6, confusion=confusion)
    assert result.per_class_accuracy() == [0.75, None, 0.5]
    report = {
        **result.as_dict(),
        "world_size": 1,
        "per_class": dict(zip(["a", "b", "c"], result.per_class_accuracy(), strict=True)),
        "per_class_scores": dict(zip(["a", "b", "c"], result.per_class(), strict=True)),
        "report_dir": "eval",
    }
    lines = format_report(report).splitlines()
    assert "macro-F1 70.83%" in lines[0] and "balanced accuracy 62.50%" in lines[0]
    assert lines[1].split() == ["class", "accuracy", "precision", "recall", "F1"]
    assert lines[2].split() == ["a", "75.00%", "75.00%", "75.00%", "75.00%"]
    assert lines[3].split() == ["b", "no", "images"]
    assert lines[4].split() == ["c", "50.00%", "100.00%", "50.00%", "66.67%"]


@pytest.mark.parametrize("cache", ["on", "off"])
def test_a_broken_link_in_the_data_is_a_bad_image_on_every_path(
    tmp_path, cache, capsys, monkeypatch
):
    """With the cache on or off, under --bad-images skip the dangling link is left out
    and named as missing; under error it is one line, never a FileNotFoundError."""
    from imagefolders import make_image_folder

    data = make_image_folder(tmp_path / "d", classes=2, per_class=8)
    (data / "class_0" / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    common = ["train", "--data", str(data), "--image-size", "16", "--epochs", "1"]
    common += ["--batch-size", "4", "--workers", "0", "--cache", cache]
    common += ["--output-dir", str(tmp_path / "runs")]
    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "c"))
    assert main([*common, "--bad-images", "skip", "--name", "s"]) == 0
    assert "skipping 1 unreadable image(s)" in capsys.readouterr().out
    listed = next((tmp_path / "runs" / "s").glob("bad_im*")).read_text()
    assert "gone.jpg" in listed and "missing" in listed
    assert main([*common, "--name", "e"]) == 2
    err = capsys.readouterr().err
    assert "FileNotFoundError" not in err and "Traceback" not in err
    assert "gone.jpg" in err


def test_the_curves_mark_whole_epochs_only(tmp_path):
    """Two epochs drew ticks at 1.5 and 2.5 on curves.png's x-axes; epochs are whole."""
    from paratrain.report import plots

    rows = [
        {"epoch": e, "train_loss": 1.0 / e, "val_loss": 1.2 / e, "val_top1": 0.3 * e, "lr": 0.1}
        for e in (1, 2)
    ]
    plots.plot_curves(rows, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for ax in plots.curves_figure(rows).axes:
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_a_runs_pictures_are_drawn_without_pyplot(tmp_path):
    """Pictures are files: drawn by a Figure alone, with no pyplot (whose open figures
    had each to be closed, and which on a desktop picks a window backend)."""
    code = (
        "import sys, numpy as np; from pathlib import Path; from paratrain.report import plots\n"
        "rows = [{'epoch': 1, 'train_loss': 1.0, 'val_loss': 1.1, 'val_top1': 0.5, 'lr': 0.1}]\n"
        "plots.plot_curves(rows, Path(sys.argv[1]) / 'curves.png')\n"
        "plots.plot_confusion(np.eye(2, dtype=int), ['a', 'b'], Path(sys.argv[1]) / 'cm.png')\n"
        "print('matplotlib.pyplot' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
    for name in ("curves.png", "cm.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_log_lines_go_above_the_epoch_bar_not_into_it(capsys):
    """On a terminal the bar (stderr) and the log (stdout) share a line: "first step ..."
    was printed into the bar's line. While a bar is open the run's log lines go through
    tqdm, which clears the bar, writes the line whole, and draws the bar again."""
    import logging

    from paratrain.log import get_logger, setup_logging
    from paratrain.report.run_files import EpochBar

    setup_logging()
    logger = get_logger()
    plain = list(logger.handlers)
    bar = EpochBar(total=10, desc="epoch 1/1")
    try:
        routed = [type(h).__name__ for h in logger.handlers]
        assert routed == ["_TqdmLoggingHandler"]
        logger.info("first step 1.0 s after the command started")
    finally:
        bar.close()
    bar.close()  # closing twice (tqdm does at exit) puts nothing back twice
    assert logger.handlers == plain and isinstance(plain[0], logging.StreamHandler)
    out = capsys.readouterr().out
    assert "first step 1.0 s after the command started\n" in out
