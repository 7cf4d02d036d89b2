"""--logger: every tracker records the settings, the per-step and per-epoch scalars, the
curves and the final checkpoint's path, from rank 0 alone; read back from what each
wrote offline (TensorBoard's events, MLflow's local store, W&B's offline run, the CSV)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from imagefolders import make_image_folder
from paratrain.cli import main
from paratrain.config.train import resolve_train
from paratrain.errors import UserError
from trainruns import run_cli
from wandb_records import recorded

FAST = ["--model", "resnet18", "--image-size", "16", "--batch-size", "4", "--workers", "0"]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """Two processes, two epochs, every tracker; then resumed for a third epoch."""
    root = tmp_path_factory.mktemp("trackers")
    data = make_image_folder(root / "data", classes=3, per_class=10)
    common = ["train", "--data", str(data), "--nproc", "2", "--name", "t", *FAST,
              "--output-dir", str(root / "runs"), "--logger", "tensorboard,mlflow,wandb,csv,jsonl"]  # fmt: skip
    env = {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": None, "MLFLOW_EXPERIMENT_NAME": None}
    first = run_cli(*common, "--epochs", "2", cwd=root, **env)
    ids = json.loads((root / "runs/t/trackers.json").read_text())
    second = run_cli(*common, "--epochs", "3", "--resume", "auto", cwd=root, **env)
    assert (first.returncode, second.returncode) == (0, 0), first.stderr + second.stderr
    return root / "runs", ids


def _metrics(runs: Path) -> list[dict]:
    return [json.loads(x) for x in (runs / "t/metrics.jsonl").read_text().splitlines()]


def _steps(runs: Path) -> list[int]:
    with (runs / "t/steps.csv").open() as handle:
        return [int(row["step"]) for row in csv.DictReader(handle)]


def test_csv_has_every_step_once_from_one_rank(tracked):
    runs, _ = tracked
    steps = _steps(runs)
    assert steps == list(range(1, len(steps) + 1))  # one writer, resumed without repeats
    assert len(steps) == 3 * 3  # 24 training images, 2 x 4 a step: 3 steps an epoch


def test_jsonl_holds_the_settings_every_step_and_epoch_and_the_end(tracked):
    """The tracker added as one file and one registry line (report/trackers/jsonl.py)."""
    runs, _ = tracked
    lines = [json.loads(x) for x in (runs / "t/trackers.jsonl").read_text().splitlines()]
    assert lines[0]["kind"] == "settings" and lines[0]["settings"]["model"] == "resnet18"
    assert [r["kind"] for r in lines].count("settings") == 1  # the resumed run appended
    assert [r["step"] for r in lines if r["kind"] == "step"] == _steps(runs)
    epochs = [r for r in lines if r["kind"] == "epoch"]
    assert [r["epoch"] for r in epochs] == [1, 2, 3]
    assert [r["epoch/val_top1"] for r in epochs] == pytest.approx(
        [r["val_top1"] for r in _metrics(runs)]
    )
    finish = [r for r in lines if r["kind"] == "finish"]
    assert finish[-1]["checkpoint"] == str(runs / "t/checkpoints/last.pt")
    assert all(isinstance(r["time"], float) for r in lines)


def test_mlflow_holds_one_run_with_settings_scalars_curves_and_checkpoint(tracked, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store so

    runs, ids = tracked
    client = MlflowClient((runs / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("paratrain")
    found = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in found] == [ids["mlflow"]]  # resumed into the same run
    run = found[0]
    assert run.info.run_name == "t" and run.info.status == "FINISHED"
    assert run.data.params["model"] == "resnet18" and run.data.params["batch_size"] == "4"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == _steps(runs)
    top1 = client.get_metric_history(run.info.run_id, "epoch/val_top1")
    assert [m.step for m in top1] == [1, 2, 3]
    assert [m.value for m in top1] == pytest.approx([r["val_top1"] for r in _metrics(runs)])
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["curves.png"]
    assert run.data.tags["final_checkpoint"] == str(runs / "t/checkpoints/last.pt")


def test_wandb_offline_run_holds_settings_scalars_curves_and_checkpoint(tracked):
    runs, ids = tracked
    files = sorted((runs / "t/wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # the run and its resumption: one process each time
    first, resumed = (recorded(f) for f in files)
    assert first["id"] == resumed["id"] == ids["wandb"]
    assert (first["name"], first["project"]) == ("t", "paratrain")
    assert first["config"]["model"] == "resnet18" and first["config"]["batch_size"] == 4
    history = first["history"] + resumed["history"]
    steps = [row["_step"] for row in history if "train/loss" in row]
    assert steps == _steps(runs)
    epochs = [row for row in history if "epoch/val_top1" in row]
    assert [row["epoch"] for row in epochs] == [1, 2, 3]
    assert [row["epoch/val_top1"] for row in epochs] == pytest.approx(
        [r["val_top1"] for r in _metrics(runs)]
    )
    (image,) = [row for row in resumed["history"] if "curves/path" in row]
    assert image["curves/_type"] == "image-file"
    assert (files[1].parent / "files" / image["curves/path"]).read_bytes()[:4] == b"\x89PNG"
    assert resumed["summary"]["final_checkpoint"] == str(runs / "t/checkpoints/last.pt")


def test_tensorboard_gets_the_settings_and_the_scalars(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs, _ = tracked
    events = EventAccumulator(str(runs / "t/tensorboard"))
    events.Reload()
    assert {"train/loss", "epoch/val_top1"} <= set(events.Tags()["scalars"])
    assert "config/text_summary" in events.Tags()["tensors"]
    assert [e.step for e in events.Scalars("epoch/val_top1")] == [1, 2, 3]


@pytest.mark.parametrize("name", ["mlflow", "wandb"])
def test_a_tracker_without_its_package_names_the_extra(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda m, *a: None if m == name else real(m, *a)
    )
    from paratrain import train

    data = make_image_folder(tmp_path / "data", classes=2, per_class=4)
    with pytest.raises(UserError) as error:
        train(resolve_train({"data": str(data), "logger": f"csv,{name}"}), dry_run=True)
    from paratrain.version import install_extra

    assert str(error.value) == f"--logger {name} needs the {name} package: {install_extra(name)}"


def test_an_unknown_tracker_is_one_line(capsys):
    assert main(["train", "--logger", "tensorboard,comet", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("paratrain: error: --logger") and "\n" not in err
    assert "one or more of tensorboard, mlflow, wandb, csv, jsonl, comma-separated" in err


def test_an_online_wandb_server_that_does_not_answer_is_found_before_the_launch(monkeypatch):
    """W&B online (an API key, no WANDB_MODE) is reached within --tracker-timeout; offline
    there is nothing to reach. MLflow over HTTP likewise; a file store never."""
    import socket

    from paratrain.report.loggers import unreachable

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", dead)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    found = unreachable(("wandb", "mlflow", "csv", "tensorboard"), 1.0)
    assert sorted(found) == ["mlflow", "wandb"]
    assert found["wandb"].startswith(f"{dead} did not answer within 1 s")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "file:///tmp/mlruns")
    assert unreachable(("wandb", "mlflow"), 1.0) == {}
