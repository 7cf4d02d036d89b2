"""Metrics users report (per-class precision, recall and F1, macro-F1, balanced
accuracy, --monitor), and the flags they type (-b, -j, -c, --print-config, --max-steps,
--limit-val-batches); a ViT's embeddings kept out of weight decay."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from paratrain import TrainConfig, train
from paratrain.cli import main
from paratrain.engine.checkpointing import checkpoint
from paratrain.engine.inference.evaluate import EvalResult
from paratrain.models.registry import create_model
from paratrain.parallel import optim_state


def test_per_class_scores_macro_f1_and_balanced_accuracy_from_the_confusion_matrix():
    confusion = torch.tensor([[8, 2, 0], [1, 3, 0], [0, 0, 0]])  # class 2: no images
    result = EvalResult(loss=0.5, top1=11 / 14, top5=None, count=14, confusion=confusion)
    rows = result.per_class()
    assert rows[0]["precision"] == pytest.approx(8 / 9) and rows[0]["recall"] == 0.8
    assert rows[1]["precision"] == pytest.approx(3 / 5) and rows[1]["recall"] == 0.75
    assert rows[2] == {"precision": None, "recall": None, "f1": None, "support": 0}
    f1 = [2 * p * r / (p + r) for p, r in ((8 / 9, 0.8), (3 / 5, 0.75))]
    assert result.macro_f1 == pytest.approx(sum(f1) / 2)
    assert result.balanced_accuracy == pytest.approx((0.8 + 0.75) / 2)
    assert result.score("loss") == -0.5 and result.score("top1") == 11 / 14


def test_short_flags_and_print_config(image_folder, capsys, tmp_path):
    settings = tmp_path / "c.yaml"
    settings.write_text("batch_size: 12\n")
    assert main(["train", "--data", str(image_folder), "-j", "0", "-c", str(settings)]
                + ["--print-config"]) == 0  # fmt: skip
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["batch_size"], printed["workers"]) == (12, 0)
    assert TrainConfig.from_dict(printed).validate() is not None  # ready for --config
    assert main(["train", "--data", str(image_folder), "-b", "8", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["batch_size"] == 8


def test_a_smoke_run_stops_at_max_steps_and_monitors_what_it_is_told(image_folder, tmp_path):
    summary = train(
        TrainConfig(
            data=str(image_folder), image_size=16, batch_size=4, workers=0, epochs=5,
            max_steps=3, limit_val_batches=1, monitor="macro_f1",
            output_dir=str(tmp_path / "runs"), name="smoke",
        )
    )  # fmt: skip
    state = checkpoint.load(tmp_path / "runs" / "smoke" / "checkpoints" / "last.pt")
    assert state.progress["global_step"] == 3 and summary["epochs"] == 1
    rows = [
        json.loads(r)
        for r in (tmp_path / "runs" / "smoke" / "metrics.jsonl").read_text().splitlines()
    ]
    assert rows[-1]["val_count"] == 4  # one batch of 4, not the 9 validation images
    assert rows[-1]["val_macro_f1"] is not None and rows[-1]["val_balanced_acc"] is not None
    best = checkpoint.load(tmp_path / "runs" / "smoke" / "checkpoints" / "best.pt")
    assert best.best_score == pytest.approx(rows[-1]["val_macro_f1"]) and best.monitor == "macro_f1"


def test_a_run_stopped_at_max_steps_resumes_the_rest_of_its_epoch(image_folder, tmp_path):
    """--max-steps 3 of a 7-step epoch is a mid-epoch checkpoint: the resumed run trains
    the epoch's last 4 steps (its last 16 images), then the next epoch; before, the
    checkpoint said epoch 1 was done and the resume skipped them."""
    common = dict(
        data=str(image_folder), image_size=16, batch_size=4, workers=0, epochs=2,
        output_dir=str(tmp_path / "runs"), name="cut", val_fraction=0.25,
    )  # fmt: skip
    train(TrainConfig(**common, max_steps=3))  # 27 training images: 7 steps an epoch
    last = tmp_path / "runs" / "cut" / "checkpoints" / "last.pt"
    cut = checkpoint.load(last).progress
    assert (cut.epoch, cut.step_in_epoch, cut.consumed, cut.global_step) == (0, 3, 12, 3)
    train(TrainConfig(**common, resume="auto"))
    done = checkpoint.load(last).progress
    assert (done.epoch, done.global_step) == (2, 3 + 4 + 7)
    rows = (tmp_path / "runs" / "cut" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["epoch"] for r in rows] == [1, 2]  # the cut epoch's row replaced


def test_a_vits_embeddings_and_class_token_join_the_norms_without_decay():
    model = create_model("vit_b_16", 3, 32)
    cfg = TrainConfig(model="vit_b_16", norm_weight_decay=0.0)
    groups = {kind: names for kind, _, names in optim_state.named_groups(
        model, optim_state.grouping(cfg, model))}  # fmt: skip
    assert "class_token" in groups["norm"] and "encoder.pos_embedding" in groups["norm"]
    assert "conv_proj.weight" in groups["decay"]


def test_monitor_loss_writes_best_at_the_first_evaluation_whatever_the_loss(image_folder, tmp_path):
    """The best starts below every score: under --monitor loss the score is minus the
    loss, far below 0 at the start, and best.pt is still written by the first epoch."""
    common = dict(
        data=str(image_folder), image_size=16, batch_size=4, workers=0, epochs=1,
        output_dir=str(tmp_path / "runs"), name="loss", val_fraction=0.25, monitor="loss",
        lr=5.0,
    )  # fmt: skip
    train(TrainConfig(**common))  # a rate that large leaves the loss far above 1
    rows = [json.loads(r) for r in (tmp_path / "runs/loss/metrics.jsonl").read_text().splitlines()]
    best = checkpoint.load(tmp_path / "runs" / "loss" / "checkpoints" / "best.pt")
    # judged by the EMA weights' loss (kept by default; the raw weights' beside it)
    last = rows[-1]
    assert last["val_loss"] > 1 and last["val_loss_ema"] > 1
    assert best.best_score == pytest.approx(-last["val_loss_ema"])
