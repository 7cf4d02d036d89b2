"""Runs a user can trust: resume that checks, checkpoints that are data, run folders that
are never overwritten, no batch of one, bad images listed, frozen layers frozen, a
skipped non-finite step that leaves everything as it was."""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torchvision
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torch import nn

from imagefolders import make_image_folder
from paratrain import TrainConfig, train
from paratrain.cli import main
from paratrain.data.samplers import FEWEST, TrainBatches, TrainSampler
from paratrain.data.scan import find_bad_images
from paratrain.data.transforms import DecodedSamples
from paratrain.distributed.env import DistEnv
from paratrain.distributed.runtime import Runtime
from paratrain.engine.checkpointing import checkpoint
from paratrain.engine.run.control import StepControl
from paratrain.engine.run.precision import Precision
from paratrain.engine.run.preempt import PreemptionGuard
from paratrain.engine.run.recipe import Recipe
from paratrain.engine.run.state import Progress
from paratrain.engine.run.step import Stepper
from paratrain.engine.trainer import train_step
from paratrain.errors import UserError
from paratrain.models.registry import create_model, freeze_backbone
from paratrain.parallel import checkpoint_io
from paratrain.parallel.parts import ModelParts
from paratrain.report.loggers import Loggers

FAST = dict(model="resnet18", image_size=16, batch_size=4, workers=0, precision="32")


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def trained(tiny_run):
    """One epoch of a tiny run (conftest's, trained once a session): its folder, its
    data and its last checkpoint."""
    return tiny_run


def _flags(root: Path, data: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(data),
        "--model",
        "resnet18",
        "--image-size",
        "16",
        "--batch-size",
        "4",
        "--workers",
        "0",
        "--precision",
        "32",
        "--cache",
        "off",
        "--output-dir",
        str(root / "runs"),
        *extra,
    ]


def test_resume_refuses_what_cannot_continue_in_one_line(trained, tmp_path):
    root, data, last = trained
    code, _, err = _run(
        [
            *_flags(root, data, "--epochs", "2", "--resume", str(last)),
            "--model",
            "resnet34",
            "--opt",
            "adamw",
        ]
    )
    assert code == 2
    line = _one_error_line(err)
    assert "--model resnet34 but the checkpoint has resnet18" in line
    assert "--opt adamw but the checkpoint has sgd" in line
    assert f"--weights {last}" in line  # what to do instead
    renamed = make_image_folder(tmp_path / "other", classes=3, per_class=12)
    for i, folder in enumerate(sorted(renamed.iterdir())):
        folder.rename(renamed / f"kind_{i}")  # as many classes, other names
    code, _, err = _run(_flags(root, renamed, "--epochs", "2", "--resume", str(last)))
    assert code == 2 and "are not the checkpoint's" in _one_error_line(err)


def test_resume_with_other_rates_and_more_epochs_says_what_changed(trained, capsys):
    root, data, last = trained
    code, out, err = _run(
        _flags(
            root,
            data,
            "--epochs",
            "2",
            "--resume",
            str(last),
            "--lr",
            "0.02",
            "--weight-decay",
            "0.01",
            "--name",
            "more",
        )
    )
    assert code == 0, err
    assert "settings changed since the checkpoint:" in out
    assert "lr unset -> 0.02" in out and "weight_decay 0.005 -> 0.01" in out
    assert "peak lr 0.0025 -> 0.02" in out  # --lr-base 0.16 x batch 4 / 256, then --lr
    state = checkpoint.load(root / "runs/more/checkpoints/last.pt")
    assert state.optimizer["param_groups"][0]["weight_decay"] == 0.01
    assert state.progress["epoch"] == 2


def test_a_run_that_exists_is_not_overwritten(trained):
    root, data, _ = trained
    code, _, err = _run(_flags(root, data, "--epochs", "1", "--name", "r"))
    line = _one_error_line(err)
    assert code == 2 and "already holds a run" in line
    assert "--resume auto" in line and "--name" in line


def test_a_run_directory_resumes_from_its_last_checkpoint(trained):
    root, data, last = trained
    run_dir = root / "runs/r"
    argv = _flags(root, data, "--epochs", "2", "--resume", str(run_dir), "--name", "from-dir")
    code, out, err = _run([*argv, "--dry-run"])
    assert code == 0, err
    assert f"resume: {last} at epoch 2" in out
    code, _, err = _run(argv)
    assert code == 0, err
    assert checkpoint.load(root / "runs/from-dir/checkpoints/last.pt").progress["epoch"] == 2
    summary = json.loads((root / "runs/from-dir/summary.json").read_text())
    assert summary["epochs"] == 2  # the epoch reached, though this folder trained one
    code, _, err = _run(["eval", "--checkpoint", str(run_dir), "--data", str(data)])
    line = _one_error_line(err)
    assert code == 2 and "is a run directory" in line and "best.pt" in line
    empty = root / "runs/empty"
    (empty / "checkpoints").mkdir(parents=True)
    code, _, err = _run(_flags(root, data, "--epochs", "2", "--resume", str(empty)))
    assert code == 2 and "no last checkpoint" in _one_error_line(err)


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_that_would_run_code_is_refused_by_every_command(trained, tmp_path):
    root, data, _ = trained
    marker = tmp_path / "it-ran"
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": _RunsCode(marker)}, evil)
    commands = [
        _flags(root, data, "--epochs", "2", "--resume", str(evil), "--name", "evil"),
        _flags(root, data, "--epochs", "1", "--weights", str(evil), "--name", "evil2"),
        ["eval", "--checkpoint", str(evil), "--data", str(data)],
        ["predict", "--checkpoint", str(evil), str(data)],
        ["export", "--checkpoint", str(evil)],
    ]
    for argv in commands:
        code, _, err = _run(argv)
        assert code == 2, (argv, err)
        _one_error_line(err)
        assert not marker.exists(), argv


def test_resuming_mid_epoch_with_another_batch_neither_skips_nor_repeats(tmp_path, monkeypatch):
    """An epoch interrupted after 2 steps of 4 images, resumed with batches of 6: every
    training image of the epoch is trained on exactly once."""
    data = make_image_folder(tmp_path / "data", classes=4, per_class=10)  # 32 train
    seen: list[int] = []  # the training images read, in order
    original = DecodedSamples.load

    def recording(self, index):
        seen.append(index)
        return original(self, index)

    monkeypatch.setattr(DecodedSamples, "load", recording)
    common = dict(
        data=str(data),
        epochs=1,
        output_dir=str(tmp_path / "runs"),
        name="m",
        cache="off",
        save_every_steps=2,
        **{**FAST, "batch_size": 4},
    )
    monkeypatch.setenv("PARATRAIN_INJECT", "rank=0,step=3,kind=raise")
    with pytest.raises(RuntimeError, match="injected failure at step 3"):
        train(TrainConfig(**common))
    first = seen[:8]  # the two saved steps (the third was drawn, then the run failed)
    monkeypatch.delenv("PARATRAIN_INJECT")
    seen.clear()
    state = checkpoint.load(tmp_path / "runs/m/checkpoints/last.pt")
    assert (state.progress["consumed"], state.progress["step_in_epoch"]) == (8, 2)
    for key, value in (("seed", 7), ("ra_reps", 2)):  # they make the epoch's order
        with pytest.raises(UserError, match="the checkpoint's epoch is part done under --"):
            train(TrainConfig(**{**common, key: value, "resume": "auto"}))
    assert not seen  # refused before any image was read
    train(TrainConfig(**{**common, "batch_size": 6, "resume": "auto"}))
    assert sorted(first + seen) == list(range(32))


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 200), batch=st.integers(1, 40), world=st.integers(1, 3))
def test_no_training_batch_holds_less_than_half_a_batch_or_one_image(n, batch, world):
    """Every sample once, in the sampler's order; no batch over the batch size (but the
    one of 3 to 5 that batches of 2 to 4 make of their last two) and, where there is a
    full batch, none under half of one or under FEWEST images (unless the batch size is
    smaller); as many batches as len() says."""
    order = TrainSampler(n, 0, world)
    batches = list(TrainBatches(order, batch))
    sizes = [len(b) for b in batches]
    assert [item for b in batches for item in b] == list(order)
    assert len(TrainBatches(order, batch)) == len(sizes)
    assert max(sizes) <= max(batch, 2 * FEWEST - 1)  # one batch of 3 to 5 from two
    if len(order) >= batch > 1:
        assert min(sizes) >= min(batch, max(batch / 2, FEWEST)), sizes


def test_a_short_last_batch_shares_the_last_two_evenly():
    def sizes(n: int, batch: int, **kw) -> list[int]:
        return [len(b) for b in TrainBatches(TrainSampler(n, 0, 1), batch, **kw)]

    assert sizes(34, 8) == [8, 8, 8, 5, 5]  # 2 left over: the last two share 10
    assert sizes(36, 8) == [8, 8, 8, 8, 4]  # half a batch left over stays a batch
    assert sizes(18, 4) == [4, 4, 4, 3, 3]  # 2 left over: under FEWEST, though half of 4
    assert sizes(18, 5) == [5, 5, 5, 3]  # 3 left over: kept
    assert sizes(5, 2) == [2, 3] and sizes(8, 3) == [3, 5]  # under 6 in all: one batch
    # drop_last (a pipeline's fixed micro-batches) keeps full batches only
    assert sizes(9, 4, drop_last=True) == [4, 4]


@pytest.mark.parametrize("per_class, batch, val", [(11, 13, 6), (15, 17, 9), (13, 4, 9)])
def test_a_last_batch_of_one_or_two_trains_at_16px_to_a_small_validation_loss(
    tmp_path, per_class, batch, val
):
    """27 training images in batches of 13 leave one over (BatchNorm refuses a batch of
    one in training); 36 in batches of 17, and 30 in batches of 4, left a last batch of
    2, whose one step (ResNet-18's last BatchNorm at 16 px seeing two values a channel)
    took the validation loss to 8e14. Their samples now join or share the batches
    before them."""
    data = make_image_folder(tmp_path / "data", classes=3, per_class=per_class)
    summary = train(
        TrainConfig(
            data=str(data),
            epochs=1,
            output_dir=str(tmp_path / "runs"),
            name="short",
            cache="off",
            ema_decay=0,
            **{**FAST, "batch_size": batch},
        )
    )
    assert summary["final"]["val_count"] == val
    assert summary["final"]["val_loss"] < 5, summary["final"]


def test_a_decompression_bomb_is_a_bad_image_with_its_pixel_count(tmp_path, monkeypatch):
    folder = make_image_folder(tmp_path / "data", classes=2, per_class=3)
    Image.new("RGB", (60, 50)).save(folder / "class_0" / "bomb.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 3,000 pixels: over twice this
    found = find_bad_images([str(folder / "class_0" / "bomb.png")], 0, 1, 0, show=False)
    assert len(found) == 1
    assert "3,000 pixels, over Pillow's decompression-bomb limit of 2,000" in found[0][1]


def test_frozen_layers_keep_their_batchnorm_statistics():
    model = create_model("resnet18", 3)
    freeze_backbone(model, "resnet18")
    before = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    model.train()
    out = model(torch.randn(4, 3, 32, 32) * 3 + 1)
    out.sum().backward()
    after = model.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert model.fc.weight.grad is not None and model.conv1.weight.grad is None


def test_eval_runs_on_this_machines_device_not_the_training_runs(trained, tmp_path):
    root, data, last = trained
    state = checkpoint.load(last)
    state.config = {**state.config, "device": "cuda", "backend": "nccl"}
    moved = tmp_path / "from-a-gpu.pt"
    checkpoint_io.save_atomic(state.to_dict(), moved)
    code, out, err = _run(["eval", "--checkpoint", str(moved), "--data", str(data), "--json"])
    assert code == 0, err
    code, _, err = _run(["eval", "--checkpoint", str(moved), "--device", "cpu", "--json"])
    assert code == 0, err


def test_a_real_nonfinite_step_under_skip_leaves_everything_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    )
    parts = ModelParts([model])
    optimizer = torch.optim.SGD(parts.parameters(), lr=0.1, momentum=0.9)
    runtime = Runtime(env=DistEnv(), device=torch.device("cpu"), backend=None)
    cfg = TrainConfig(on_nonfinite="skip")
    recipe = Recipe(criterion=nn.CrossEntropyLoss(), precision=Precision("32", runtime.device))
    control = StepControl(cfg, runtime, save=None, guard=PreemptionGuard())
    run = SimpleNamespace(
        parts=parts,
        recipe=recipe,
        optimizer=optimizer,
        progress=Progress(),
        control=control,
        loggers=Loggers(Path("unused"), (), {}, 1),
        stepper=Stepper(parts, optimizer, recipe, control),
    )
    labels = torch.randint(0, 3, (4,))
    good = [(torch.randn(4, 3, 8, 8), labels)]
    train_step(run, iter(good), 1)  # a good step first: momentum buffers exist
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    poisoned = torch.randn(4, 3, 8, 8)
    poisoned[0, 0, 0, 0] = float("inf")  # a real forward that ends in NaN
    train_step(run, iter([(poisoned, labels)]), 1)
    assert run.progress.skipped_steps == 1 and run.progress.global_step == 2
    for key, value in model.state_dict().items():  # weights and BatchNorm buffers
        assert torch.equal(value, weights[key]), key
    for p, buffer in zip(model.parameters(), momentum, strict=True):
        assert torch.equal(optimizer.state[p]["momentum_buffer"], buffer)


def test_checkpoints_saved_elsewhere_are_told_apart_in_one_line(trained, tmp_path):
    root, data, last = trained
    model = torchvision.models.resnet18(num_classes=3).state_dict()
    saved = checkpoint.load(last)
    files = {
        "bare": ({"model": model}, "is not a paratrain checkpoint (no 'config', 'classes')"),
        "odd": (
            {
                **saved.to_dict(),
                "model": {**model, "fc.weight": torch.zeros(5, 512), "extra": torch.ones(1)},
            },
            "1 not in the model (extra); 1 of another shape (file vs model) "
            "(fc.weight (5, 512) vs (3, 512))",
        ),
        "no-state": (
            {"model": model, "config": saved.config, "classes": saved.classes},
            None,  # weights alone: eval, predict and export take it; resume does not
        ),
    }
    for name, (state, told) in files.items():
        path = tmp_path / f"{name}.pt"
        torch.save(state, path)
        commands = [
            ["eval", "--checkpoint", str(path), "--data", str(data)],
            ["predict", "--checkpoint", str(path), str(data)],
            ["export", "--checkpoint", str(path), "--out", str(tmp_path / f"{name}-x.pt")],
        ]
        for argv in commands:
            code, _, err = _run(argv)
            if told is None:
                assert code == 0, (argv, err)
            else:
                assert code == 2 and told in _one_error_line(err), (argv, err)
        resume = _flags(root, data, "--epochs", "2", "--resume", str(path), "--name", name)
        code, _, err = _run(resume)
        assert code == 2
        if told is None:
            assert "no training state (no 'optimizer'" in _one_error_line(err)


def test_resuming_a_finished_run_trains_nothing_and_rewrites_nothing(trained):
    root, data, last = trained
    run_dir = root / "runs/r"
    before = {name: (run_dir / name).read_bytes() for name in ("summary.json", "config.yaml")}
    argv = _flags(root, data, "--epochs", "1", "--resume", "auto", "--name", "r")
    code, out, err = _run([*argv, "--dry-run"])
    assert code == 0 and "nothing left to train at --epochs 1" in out, err
    code, out, err = _run(argv)
    assert code == 0, err
    assert "1 of 1 epoch(s) already trained, nothing left to train" in out + err
    assert {name: (run_dir / name).read_bytes() for name in before} == before
    assert checkpoint.load(last).progress["epoch"] == 1


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_keeps_the_old_one(tmp_path):
    import resource

    target = tmp_path / "last.pt"
    checkpoint_io.save_atomic({"model": {"w": torch.zeros(4)}}, target)
    before = target.read_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # files of 1 MiB at most
    try:
        with pytest.raises(UserError) as raised:
            checkpoint_io.save_atomic({"model": {"w": torch.zeros(1 << 20)}}, target)  # 4 MiB
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(raised.value) == (
        f"cannot write checkpoint {target}: File too large (the previous one is unchanged)"
    )
    assert target.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no partial file left
