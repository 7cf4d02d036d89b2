"""Autopilot: each automatic choice is tested for what it decides."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from imagefolders import make_image_folder
from paratrain import TrainConfig
from paratrain.bench import autopilot
from paratrain.cli import main
from paratrain.errors import UserError


def test_nproc_follows_the_timings_it_measured_and_keeps_them(tmp_path):
    assert autopilot.decide_nproc({1: 120.0, 2: 95.0}) == 1  # 2 cores: one process wins
    assert autopilot.decide_nproc({1: 120.0, 4: 300.0}) == 4
    assert autopilot.decide_nproc({1: 100.0, 2: 100.0}) == 1  # a tie: fewer processes
    calls = []

    def fake(cfg, cores):
        calls.append(cores)
        return {1: [100.0, 104.0], cores: [180.0, 176.0]}

    cfg = TrainConfig(nproc="auto", cache_dir=str(tmp_path), device="cpu")
    first = autopilot.choose_nproc(cfg, measure=fake, load=lambda: 0.02)
    again = autopilot.choose_nproc(cfg, measure=fake, load=lambda: 0.02)
    cores = calls[0]
    assert first.value == again.value == cores and len(calls) == 1  # measured once
    assert "measured now in 2 alternating rounds, kept in" in first.why
    assert "measured on this machine 20" in again.why  # the date it was measured
    assert f"kept in {tmp_path / 'autopilot.json'}: delete it to measure again" in again.why


@pytest.mark.parametrize(
    ("load", "rounds", "why"),
    [
        (0.6, {1: [4.8, 5.0], 2: [180.0, 188.0]}, "the machine was busy (60% of its cores"),
        (0.0, {1: [4.8, 430.0], 2: [250.0, 240.0]}, "1 process(es) measured 5 and 430 img/s"),
        (0.0, {1: [4.8, 5.0], 2: [186.0, 188.0]}, "5 against 187 img/s is further apart than 2"),
    ],
    ids=["busy", "rounds-disagree", "implausible"],
)
def test_a_measurement_taken_under_load_or_out_of_line_is_not_kept(
    tmp_path, monkeypatch, load, rounds, why
):
    """1 process at 4.8 images/s against 188 for 2 was measured on a busy machine and
    kept for every later run; an unloaded rerun gave 430 against 250. Such a figure is
    used for this run only, and said so; the next run measures again."""
    monkeypatch.setattr(autopilot, "usable_cores", lambda: 2)
    calls = []

    def fake(cfg, cores):
        calls.append(cores)
        return rounds

    cfg = TrainConfig(nproc="auto", cache_dir=str(tmp_path), device="cpu")
    first = autopilot.choose_nproc(cfg, measure=fake, load=lambda: load)
    assert f"not kept: {why}" in first.why, first.why
    autopilot.choose_nproc(cfg, measure=fake, load=lambda: load)
    assert len(calls) == 2  # nothing kept: measured again
    # a kept figure far out of line (kept before these checks) is measured again too
    (tmp_path / "autopilot.json").write_text(
        json.dumps({autopilot._machine_key(cfg): {"1": 4.8, "2": 188.0}})
    )
    quiet = {1: [430.0, 425.0], 2: [250.0, 252.0]}
    fresh = autopilot.choose_nproc(cfg, measure=lambda c, n: quiet, load=lambda: 0.0)
    assert fresh.value == 1 and "measured now" in fresh.why


def test_a_model_too_large_for_the_memory_gets_fsdp_or_pipeline():
    cfg = TrainConfig(model="resnet18", image_size=32, batch_size=16)
    rows = autopilot._estimate(cfg, 2)
    ddp = next(r for r in rows if r.strategy == "ddp").total
    roomy = autopilot.choose_strategy(cfg, 2, int(ddp * 1.5), "test", rows=rows)
    assert roomy.value == "ddp"
    # between ddp's need and the lesser of fsdp's and the pipeline's (the pipeline's cut
    # is chosen by timing, so its share of the weights differs between machines)
    least = min(r.total for r in rows if r.strategy in ("fsdp", "pipeline"))
    assert least < ddp
    tight = autopilot.choose_strategy(cfg, 2, (least + ddp) // 2, "test", rows=rows)
    assert tight.value in ("fsdp", "pipeline") and "fits" in tight.why
    with pytest.raises(UserError, match="nothing fits"):
        autopilot.choose_strategy(cfg, 2, min(r.total for r in rows) - 1, "test", rows=rows)


def test_batch_auto_never_exceeds_the_memory_it_was_given():
    fixed, per_sample = 200 * 2**20, 3 * 2**20
    for memory in (1 * 2**30, 3 * 2**30, 10 * 2**30):
        batch = autopilot.batch_from_estimate(fixed, per_sample, memory)
        assert batch % 8 == 0 and fixed + batch * per_sample <= memory * autopilot.MARGIN
        assert fixed + (batch + 8) * per_sample > memory * autopilot.MARGIN  # the largest

    def try_batch(b):  # the device runs out of memory above 200
        if b > 200:
            raise torch.OutOfMemoryError("fake")

    assert autopilot.largest_batch_that_trains(try_batch) == 200
    cpu = autopilot.choose_batch(
        TrainConfig(model="resnet18", image_size=32), "ddp", 1, 2 * 2**30, "2 GiB"
    )
    assert cpu.value % 8 == 0 and cpu.value >= 8


def test_the_range_test_recovers_the_rate_of_a_synthetic_loss_curve():
    """A loss that falls fastest at lr 1e-2 (a logistic in log lr), then blows up."""
    lrs = [1e-6 * (1e7) ** (i / 299) for i in range(300)]

    def loss(lr):
        x = math.log10(lr)
        return 2.0 / (1 + math.exp(4 * (x + 2))) + 0.1 + (50.0 if x > 0 else 0.0)

    chosen, steepest = autopilot.pick_lr(lrs, [loss(lr) for lr in lrs])
    assert steepest == pytest.approx(1e-2, rel=0.35)
    assert chosen == pytest.approx(steepest / autopilot.SAFETY)


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_dry_run_shows_every_choice_and_a_run_records_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = make_image_folder(tmp_path / "data", classes=2, per_class=10)
    common = [
        "train",
        "--data",
        str(data),
        "--image-size",
        "16",
        "--epochs",
        "1",
        "--workers",
        "0",
        "--device",
        "cpu",
        "--batch-size",
        "auto",
        "--lr",
        "auto",
        "--strategy",
        "auto",
        "--nproc",
        "1",
    ]
    code, out, err = _run([*common, "--dry-run"])
    assert code == 0, err
    assert "chosen: --batch-size auto -> " in out and "chosen: --lr auto -> " in out
    assert "range test over" in out and "the estimate:" in out
    assert not (tmp_path / "runs").exists()
    code, out, err = _run([*common, "--name", "auto"])
    assert code == 0, err
    saved = yaml.safe_load(Path("runs/auto/config.yaml").read_text())
    assert saved["lr"] is None and isinstance(saved["lr_base"], float)  # scales with the batch
    assert isinstance(saved["batch_size"], int) and saved["lr_base_size"] == saved["batch_size"]
    assert saved["strategy"] == "ddp" and saved["nproc"] == 1
    assert Path("runs/auto/lr_range.png").stat().st_size > 0
    again = TrainConfig.from_yaml("runs/auto/config.yaml")  # reruns exactly
    assert (again.lr_base, again.batch_size) == (saved["lr_base"], saved["batch_size"])
