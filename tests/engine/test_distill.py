"""--teacher: knowledge distillation from a trained model. The loss mixes the labels'
cross-entropy with KL(teacher || student) at a temperature; the teacher runs without
gradients, replicated under ddp and sharded under fsdp; its weights count in `plan`;
a teacher that does not fit the data's classes, or no weights, is one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain import TrainConfig, train
from paratrain.bench import memory
from paratrain.cli import main
from paratrain.engine.checkpointing import checkpoint
from paratrain.engine.run.precision import Precision
from paratrain.engine.run.recipe import Distiller
from paratrain.errors import UserError
from paratrain.models.registry import build_teacher, create_model
from spawn import fit_on_rank, run_distributed

SMALL = dict(image_size=16, batch_size=4, workers=0, cache="off", epochs=1, precision="32")


class _Fixed(nn.Module):
    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.logits = logits

    def forward(self, x):
        return self.logits


def test_the_loss_mixes_the_labels_and_the_teachers_softened_distribution():
    base = nn.CrossEntropyLoss()
    student = torch.randn(6, 3, requires_grad=True)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    precision = Precision("32", torch.device("cpu"))
    same = Distiller(_Fixed(student.detach().clone()), 1.0, 4.0).criterion(None, base, precision)
    assert float(same(student, labels).detach()) == pytest.approx(0.0, abs=1e-6)  # nothing to learn
    hard = Distiller(_Fixed(torch.randn(6, 3)), 0.0, 4.0).criterion(None, base, precision)
    assert torch.equal(hard(student, labels), base(student, labels))
    teacher = torch.randn(6, 3) * 3
    mixed = Distiller(_Fixed(teacher), 0.3, 2.0).criterion(None, base, precision)
    kl = nn.functional.kl_div(
        torch.log_softmax(student / 2, 1), torch.softmax(teacher / 2, 1), reduction="batchmean"
    )
    expected = 0.7 * base(student, labels) + 0.3 * 4 * kl
    assert float(mixed(student, labels).detach()) == pytest.approx(float(expected), rel=1e-5)
    mixed(student, labels).backward()
    assert student.grad is not None and student.grad.abs().sum() > 0


def test_a_teacher_of_another_class_count_is_one_line(tiny_run, tmp_path):
    _, _, last = tiny_run  # resnet18 trained on 3 classes
    cfg = TrainConfig(teacher="resnet18", teacher_weights=str(last), image_size=16)
    assert sum(p.numel() for p in build_teacher(cfg, 3).parameters()) > 0
    with pytest.raises(UserError, match=r"its head has 3 outputs and the data 5 classes"):
        build_teacher(cfg, 5)
    wrong = TrainConfig(teacher="resnet34", teacher_weights=str(last), image_size=16)
    with pytest.raises(UserError, match=r"not the weights of resnet34"):
        build_teacher(wrong, 3)


def test_bad_teacher_flags_are_one_line_before_any_work(tiny_run, tmp_path, capsys):
    root, data, last = tiny_run
    base = ["train", "--data", str(data), "--output-dir", str(tmp_path), "--image-size", "16"]
    assert main([*base, "--teacher-weights", str(last)]) == 2
    assert "--teacher-weights needs --teacher" in capsys.readouterr().err
    assert main([*base, "--teacher", "resnet18"]) == 2
    assert "--teacher resnet18 needs --teacher-weights" in capsys.readouterr().err
    assert main([*base, "--teacher", "resnet18", "--teacher-weights", str(last),
                 "--strategy", "pipeline", "--nproc", "2"]) == 2  # fmt: skip
    assert "--teacher works with --strategy" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_student_learns_from_a_trained_teacher_in_one_process(tiny_run, tmp_path):
    root, data, last = tiny_run
    summary = train(
        TrainConfig(
            data=str(data),
            model="resnet18",
            teacher="resnet18",
            teacher_weights=str(last),
            kd_alpha=0.7,
            kd_temperature=2.0,
            output_dir=str(tmp_path),
            name="s",
            **SMALL,
        )  # fmt: skip
    )
    assert summary["final"]["val_count"] == 6 and torch.isfinite(
        torch.tensor(summary["final"]["train_loss"])
    )
    saved = checkpoint.load(tmp_path / "s" / "checkpoints" / "last.pt").train_config()
    assert (saved.teacher, saved.kd_alpha) == ("resnet18", 0.7)


def _sharded_share(rank, world):
    import os

    from torch.distributed.tensor import DTensor

    from paratrain.distributed.env import detect
    from paratrain.distributed.runtime import Runtime
    from paratrain.parallel.base import get

    runtime = Runtime(env=detect(os.environ), device=torch.device("cpu"), backend="gloo")
    model = create_model("resnet18", 3, 16)
    whole = sum(p.numel() for p in model.parameters())
    placed = get("fsdp").place_teacher(model, TrainConfig(strategy="fsdp"), runtime)
    local = sum(p.to_local().numel() for p in placed.parameters() if isinstance(p, DTensor))
    with torch.no_grad():
        out = placed(torch.randn(2, 3, 16, 16))
    return whole, local, tuple(out.shape)


@pytest.mark.slow
def test_under_fsdp_the_teacher_is_sharded_and_a_run_trains_with_it(tiny_run, tmp_path):
    whole, local, shape = run_distributed(_sharded_share, 2)[0]
    assert shape == (2, 3) and whole / 2 <= local < whole * 0.6  # each rank ~half of it
    root, data, last = tiny_run
    values = dict(
        data=str(data), strategy="fsdp", teacher="resnet18", teacher_weights=str(last),
        output_dir=str(tmp_path), name="f", **SMALL,
    )  # fmt: skip
    summaries = run_distributed(fit_on_rank, 2, values)
    assert summaries[0]["final"]["val_count"] == 6


def test_plan_counts_the_teacher_as_each_strategy_places_it():
    student = create_model("resnet18", 10, 32)
    with torch.device("meta"):
        teacher = create_model("resnet50", 10, 32)
    rows = {r.strategy: r for r in memory.estimate(student, 32, 8, 2, 1, teacher=teacher)}
    weights = sum(p.numel() * 4 for p in teacher.parameters())
    assert rows["ddp"].teacher == weights and rows["fsdp"].teacher == -(-weights // 2)
    assert "pipeline" not in rows and "split" not in rows  # they take no teacher
    plain = {r.strategy: r for r in memory.estimate(student, 32, 8, 2, 1)}
    assert rows["ddp"].total - plain["ddp"].total == weights
