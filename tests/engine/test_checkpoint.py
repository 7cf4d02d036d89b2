"""The checkpoint is typed and versioned: files written by an earlier paratrain (kept under
tests/fixtures/checkpoint-v1) are read, migrated and resumed from."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from imagefolders import make_image_folder
from paratrain.cli import main
from paratrain.engine.checkpointing import checkpoint
from paratrain.engine.checkpointing.checkpoint import FORMAT, Checkpoint
from paratrain.errors import UserError

V1 = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint-v1"


def test_a_format_1_file_reads_as_a_typed_checkpoint():
    state = checkpoint.load(V1 / "ema.pt")
    assert isinstance(state, Checkpoint) and state.format == FORMAT
    assert state.progress["epoch"] == 1 and state.progress["step_in_epoch"] == 0
    assert state.classes == ["class_0", "class_1", "class_2"]
    assert state.ema is not None and state.ema["n_averaged"] == 6  # 24 images, batch 4
    assert set(state.weights(V1 / "ema.pt", ema=True)) == set(state.model)
    cfg = state.train_config()
    assert cfg.model == "timm/test_efficientnet" and cfg.ema_decay == 0.9


def test_a_format_1_mid_epoch_file_keeps_where_training_stood():
    state = checkpoint.load(V1 / "mid-epoch.pt")
    progress = state.progress
    assert (progress["epoch"], progress["step_in_epoch"], progress["consumed"]) == (1, 1, 8)
    assert progress["global_step"] == 4 and progress["totals"].tolist() == pytest.approx(
        [2.03, 3.0, 4.0], abs=1e-3
    )
    assert state.replicas == 2 and state.processes == 2 and state.strategy == "ddp"
    assert len(state.parts["rng"]) == 2 and state.optimizer is not None


def test_a_format_1_sharded_checkpoint_consolidates():
    whole = checkpoint.load(V1 / "fsdp")
    assert whole.sharded and whole.progress["epoch"] == 1
    assert set(whole.model) == set(checkpoint.load(V1 / "ema.pt").model)
    assert whole.optimizer is not None and len(whole.optimizer["state"]) > 0


def test_saving_and_reading_back_keeps_every_part():
    state = checkpoint.load(V1 / "mid-epoch.pt")
    again = Checkpoint.from_dict(state.to_dict())
    assert (
        again.parts.keys() == state.parts.keys() and again.progress.keys() == state.progress.keys()
    )
    assert again.progress["consumed"] == 8 and again.replicas == 2
    for key, value in state.model.items():
        assert torch.equal(again.model[key], value)


def test_a_newer_format_is_refused_in_one_line():
    raw = checkpoint.load(V1 / "ema.pt").to_dict()
    with pytest.raises(UserError, match="checkpoint format 99; this paratrain reads up to"):
        Checkpoint.from_dict({**raw, "format": 99}, "future.pt")


def test_a_run_resumes_from_a_format_1_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    make_image_folder(tmp_path / "data", classes=3, per_class=10, size=(20, 16))
    shutil.copy(V1 / "mid-epoch.pt", tmp_path / "old.pt")
    args = ["train", "--data", "data", "--model", "timm/test_efficientnet", "--image-size"]
    args += ["16", "--epochs", "2", "--batch-size", "4", "--cache", "off", "--workers", "0"]
    args += ["--name", "again", "--resume", "old.pt"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "resumed from old.pt at epoch 2, step 2" in out  # 8 images of 2 x 4 a step
    resumed = checkpoint.load(tmp_path / "runs/again/checkpoints/last.pt")
    assert resumed.format == FORMAT and resumed.progress["epoch"] == 2


V2 = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint-v2"


def test_a_format_2_file_migrates_its_parts_and_its_best_with_the_monitor():
    state = checkpoint.load(V2 / "mid-epoch.pt")
    assert state.format == FORMAT == 3
    assert (state.progress.epoch, state.progress.step_in_epoch, state.progress.consumed) == (
        1,
        1,
        8,
    )
    assert "best_top1" not in state.progress  # the best is a part of its own now
    assert state.monitor == "macro_f1" and state.best_score == pytest.approx(2 / 9)
    assert state.ema is not None and state.ema["n_averaged"] > 0
    assert len(state.parts["rng"]) == 2 and state.parts["end"]["schedule"]["epochs"] == 2
    assert state.score is None  # saved mid-epoch, after no evaluation
    again = Checkpoint.from_dict(state.to_dict())  # format 3 reads back as itself
    assert again.parts.keys() == state.parts.keys() and again.best_score == state.best_score


def test_a_checkpoint_from_before_task_trained_one_class_an_image():
    raw = checkpoint.load(V2 / "mid-epoch.pt").to_dict()
    raw["config"] = {k: v for k, v in raw["config"].items() if k != "task"}
    assert Checkpoint.from_dict(raw).config["task"] == "multiclass"
    raw["config"]["task"] = "multilabel"  # a newer one keeps its own
    assert Checkpoint.from_dict(raw).config["task"] == "multilabel"


def test_a_format_2_sharded_checkpoint_consolidates():
    whole = checkpoint.load(V2 / "fsdp")
    assert whole.sharded and whole.progress.epoch == 1 and whole.monitor == "top1"
    assert set(whole.model) == set(checkpoint.load(V2 / "mid-epoch.pt").model)


def _resume_v2(tmp_path, capsys, *extra):
    make_image_folder(tmp_path / "data", classes=3, per_class=10, size=(20, 16))
    shutil.copy(V2 / "mid-epoch.pt", tmp_path / "old.pt")
    args = ["train", "--data", "data", "--model", "timm/test_efficientnet", "--image-size"]
    args += ["16", "--epochs", "2", "--batch-size", "4", "--cache", "off", "--workers", "0"]
    args += ["--ema-decay", "0.9", "--resume", "old.pt", *extra]
    assert main(args) == 0
    return capsys.readouterr().out


def test_a_run_resumes_from_a_format_2_checkpoint_keeping_its_best(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = _resume_v2(tmp_path, capsys, "--monitor", "macro_f1", "--name", "again")
    assert "resumed from old.pt at epoch 2, step 2" in out  # 8 images of 2 x 4 a step
    resumed = checkpoint.load(tmp_path / "runs/again/checkpoints/last.pt")
    assert resumed.format == FORMAT and resumed.progress.epoch == 2
    assert resumed.monitor == "macro_f1" and resumed.best_score >= 2 / 9 - 1e-9
    assert "set aside" not in out


def test_a_resume_under_another_monitor_says_what_it_does_with_the_old_best(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    out = _resume_v2(tmp_path, capsys, "--monitor", "loss", "--name", "other")
    assert "the checkpoint's best was by macro_f1 (0.2222): set aside" in out
    best = checkpoint.load(tmp_path / "runs/other/checkpoints/best.pt")
    assert best.monitor == "loss" and best.best_score == pytest.approx(best.score)


@pytest.mark.slow
def test_background_step_saves_resume_bit_exact_after_a_crash(tmp_path, monkeypatch):
    """--async-save: the step checkpoints are written while training goes on; a rank
    that fails at step 9 still leaves step 8's checkpoint whole (the run waits for it
    before ending), and the resumed run ends bit for bit as the uninterrupted one."""
    from spawn import RanksFailed, fit_on_rank, run_distributed

    make_image_folder(tmp_path / "data", classes=3, per_class=20)
    values = dict(
        data=str(tmp_path / "data"), output_dir=str(tmp_path / "runs"), model="resnet18",
        image_size=16, batch_size=4, workers=0, epochs=2, deterministic=True,
        save_every_steps=2, async_save=True, cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    run_distributed(fit_on_rank, 2, {**values, "name": "straight"})
    monkeypatch.setenv("PARATRAIN_INJECT", "rank=1,step=9,kind=raise")
    with pytest.raises(RanksFailed, match=r"(?s)rank 1: .*injected failure at step 9"):
        run_distributed(fit_on_rank, 2, {**values, "name": "broken"})
    monkeypatch.delenv("PARATRAIN_INJECT")
    saved = checkpoint.load(tmp_path / "runs/broken/checkpoints/last.pt")
    assert saved.progress.global_step == 8
    run_distributed(fit_on_rank, 2, {**values, "name": "broken", "resume": "auto"})
    ends = [
        checkpoint.load(tmp_path / f"runs/{n}/checkpoints/last.pt").model
        for n in ("straight", "broken")
    ]
    assert ends[0].keys() == ends[1].keys()
    assert all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])


@pytest.mark.slow
def test_an_fsdp_run_with_background_step_saves_ends_with_its_last_step_written(tmp_path):
    """--async-save under fsdp: step checkpoints through DCP's async save, finished by the
    next save; the run's end leaves a whole sharded checkpoint of its last step."""
    from spawn import fit_on_rank, run_distributed

    make_image_folder(tmp_path / "data", classes=3, per_class=20)
    values = dict(
        data=str(tmp_path / "data"), output_dir=str(tmp_path / "runs"), model="resnet18",
        image_size=16, batch_size=4, workers=0, epochs=1, strategy="fsdp", name="a",
        save_every_steps=2, async_save=True, cache_dir=str(tmp_path / "cache"),
    )  # fmt: skip
    run_distributed(fit_on_rank, 2, values)
    folder = tmp_path / "runs/a/checkpoints/last"
    saved = checkpoint.load(folder)
    assert saved.sharded and saved.progress.global_step == 6  # 48 training images / (4 x 2)
    assert not list(folder.parent.glob(".*.tmp"))  # no save left half-way
