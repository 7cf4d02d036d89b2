"""Learning-rate schedules: a function of training progress in epochs, set every step."""

import json
import math

import pytest

from imagefolders import make_image_folder
from paratrain import TrainConfig, train
from paratrain.engine.schedule import Schedule, build_schedule, effective_lr


def test_cosine_runs_from_the_peak_to_lrf():
    s = Schedule(peak=0.2, epochs=10, kind="cosine", lrf=0.1)
    values = [s.factor(e) for e in range(11)]
    assert values[0] == pytest.approx(1.0) and values[10] == pytest.approx(0.1)
    assert values[5] == pytest.approx((1 + math.cos(math.pi / 2)) / 2 * 0.9 + 0.1)
    assert all(a > b for a, b in zip(values, values[1:], strict=False))
    assert s.lr(2.5) == pytest.approx(0.2 * s.factor(2.5))  # within an epoch, per step


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


def test_linear_scaling_rule():
    assert effective_lr(0.01, 4, "linear") == pytest.approx(0.04)
    assert effective_lr(0.01, 4, "none") == pytest.approx(0.01)


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
            lr_scaling="none",
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
