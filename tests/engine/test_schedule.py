"""Learning-rate schedules: a function of training progress in epochs, set every step."""

import json
import math

import pytest

from imagefolders import make_image_folder
from paratrain import TrainConfig, train
from paratrain.cli import main
from paratrain.config.train import read_recipe, resolve_train
from paratrain.engine.run.schedule import Schedule, build_schedule, describe_schedule


def test_cosine_runs_from_the_peak_to_lrf():
    s = Schedule(peak=0.2, epochs=10, kind="cosine", lrf=0.1)
    values = [s.factor(e) for e in range(11)]
    assert values[0] == pytest.approx(1.0) and values[10] == pytest.approx(0.1)
    assert values[5] == pytest.approx((1 + math.cos(math.pi / 2)) / 2 * 0.9 + 0.1)
    assert all(a > b for a, b in zip(values, values[1:], strict=False))
    assert s.lr(2.5) == pytest.approx(0.2 * s.factor(2.5))  # within an epoch, per step


def test_linear_falls_by_the_same_amount_every_epoch_after_its_warm_up_to_lrf():
    s = Schedule(peak=0.2, epochs=10, kind="linear", lrf=0.0, warmup=2, warmup_start=0.01)
    assert s.factor(2) == pytest.approx(1.0) and s.factor(10) == pytest.approx(0.0)
    assert [s.factor(e) for e in (4, 6, 8)] == pytest.approx([0.75, 0.5, 0.25])
    assert s.factor(12) == pytest.approx(0.0)  # a budget that overruns holds the end
    assert Schedule(peak=1.0, epochs=4, kind="linear", lrf=0.2).factor(2) == pytest.approx(0.6)


def test_warmup_ramps_linearly_from_its_start_then_the_main_schedule_begins():
    s = Schedule(peak=1.0, epochs=10, kind="cosine", lrf=0.0, warmup=2, warmup_start=0.01)
    assert s.factor(0) == pytest.approx(0.01)
    assert s.factor(1) == pytest.approx(0.01 + 0.99 / 2)
    assert s.factor(2) == pytest.approx(1.0)
    assert s.factor(10) == pytest.approx(0.0)


def test_a_step_schedule_changes_the_rate_exactly_where_it_says():
    s = Schedule(peak=1.0, epochs=9, kind="step", step_size=3, gamma=0.1)
    assert [s.factor(e) for e in (0, 2.999, 3, 5.9, 6, 8.5)] == pytest.approx(
        [1, 1, 0.1, 0.1, 0.01, 0.01]
    )
    m = Schedule(peak=1.0, epochs=9, kind="multistep", milestones=(2, 7), gamma=0.5)
    assert [m.factor(e) for e in (1.99, 2, 6.99, 7)] == pytest.approx([1, 0.5, 0.5, 0.25])
    assert Schedule(peak=0.3, epochs=5, kind="constant").lr(4.2) == pytest.approx(0.3)


def test_warmup_in_steps_is_converted_with_this_runs_steps_an_epoch():
    cfg = TrainConfig(warmup_steps=5, epochs=4, lr=0.1)
    assert build_schedule(cfg, replicas=1, steps_per_epoch=10).warmup == pytest.approx(0.5)


def test_lr_is_the_rate_used_and_lr_base_scales_with_the_global_batch():
    """timm's convention: --lr as given at any world size; else --lr-base for a global
    batch of --lr-base-size, linear in the global batch (batch x replicas x accum)."""
    given = TrainConfig(lr=0.5, batch_size=128)
    assert [given.rate(n) for n in (1, 8)] == [0.5, 0.5]
    assert "--lr as given" in describe_schedule(given, 8)
    based = TrainConfig(lr_base=0.1, lr_base_size=256, batch_size=64, grad_accum=2)
    assert based.rate(4) == pytest.approx(0.1 * 64 * 4 * 2 / 256)
    assert "--lr-base 0.1 x global batch 512 / 256" in describe_schedule(based, 4)
    assert TrainConfig(batch_size=16).rate(1) == pytest.approx(0.01)  # the default


@pytest.mark.parametrize("world", [1, 2, 8])
def test_the_shipped_recipes_and_presets_keep_their_rates(world):
    """The rates the recipes and presets gave when --lr was one process's rate, scaled
    linearly with the world size: lr x world at their own batch."""
    before = {  # name: (given, recipe, the per-process lr it had)
        "digits": ({}, None, 0.02),
        "adamw": ({"data": "d", "opt": "adamw"}, None, 0.001),
        "default": ({"data": "d"}, None, 0.01),
        "flower-photos": ({"data": "d"}, read_recipe("flower-photos"), 0.01),
        "fine-tune": ({"data": "d"}, read_recipe("fine-tune"), 0.001),
        "torchvision": ({"data": "d"}, read_recipe("torchvision-resnet50-v2"), 0.0625),
    }
    for name, (given, recipe, lr) in before.items():
        cfg = resolve_train(given, recipe=recipe)
        assert cfg.rate(world) == pytest.approx(lr * world), name


def test_an_old_config_with_the_per_process_lr_is_refused_saying_how(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text("lr: 0.02\nlr_scaling: linear\nbatch_size: 32\n")
    assert main(["train", "--config", str(old), "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"paratrain: error: --config {old}: lr_scaling is gone: --lr is now the rate used at "
        "any world size (timm's convention); to keep this file's rates, replace 'lr: 0.02' "
        "and 'lr_scaling: linear' with 'lr_base: 0.02' and 'lr_base_size: 32' (the same "
        "rates at every world size)"
    )
    old.write_text("lr_scaling: linear\n")  # the defaults of that time: 0.01 at 16
    assert main(["train", "--config", str(old), "--dry-run"]) == 2
    assert "with 'lr_base: 0.01' and 'lr_base_size: 16'" in capsys.readouterr().err
    old.write_text("lr: 0.02\nlr_scaling: none\n")
    assert main(["train", "--config", str(old), "--dry-run"]) == 2
    assert "delete the lr_scaling line" in capsys.readouterr().err
    # the converted file gives the rates the old one gave: 0.02 a process
    old.write_text("lr_base: 0.02\nlr_base_size: 32\nbatch_size: 32\n")
    cfg = TrainConfig.from_yaml(old)
    assert [cfg.rate(n) for n in (1, 3)] == pytest.approx([0.02, 0.06])


def test_a_checkpoint_of_the_per_process_lr_resumes_at_its_rates():
    from pathlib import Path

    from paratrain.engine.checkpointing import checkpoint

    v1 = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint-v1"
    state = checkpoint.load(v1 / "mid-epoch.pt")  # lr 0.01, lr_scaling linear, batch 4
    cfg = state.train_config()
    assert cfg.lr is None and (cfg.lr_base, cfg.lr_base_size) == (0.01, 4)
    assert [cfg.rate(n) for n in (1, 2)] == pytest.approx([0.01, 0.02])


def test_a_run_sets_the_rate_every_step(tmp_path):
    """--sched step --lr-step-size 2: the epochs' rates change at epoch 2, the steps'
    rates (TensorBoard's train/lr) at the first step of epoch 2."""
    data = make_image_folder(tmp_path / "data", classes=2, per_class=10)  # 16 train
    train(
        TrainConfig(
            data=str(data),
            image_size=16,
            batch_size=8,
            workers=0,
            epochs=3,
            sched="step",
            lr_step_size=2,
            lr_gamma=0.1,
            lr=0.1,
            output_dir=str(tmp_path / "runs"),
            name="s",
            tensorboard=True,
        )
    )
    rows = [json.loads(x) for x in (tmp_path / "runs/s/metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == pytest.approx([0.1, 0.1, 0.01])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "runs/s/tensorboard"))
    events.Reload()
    rates = [(e.step, e.value) for e in events.Scalars("train/lr")]
    assert rates == [
        (1, pytest.approx(0.1)),
        (2, pytest.approx(0.1)),
        (3, pytest.approx(0.1)),
        (4, pytest.approx(0.1)),
        (5, pytest.approx(0.01)),
        (6, pytest.approx(0.01)),
    ]
