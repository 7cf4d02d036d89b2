"""--budget's arithmetic, --progressive's sizes, and their settings."""

from __future__ import annotations

import pytest

from paratrain.config import resolve_train
from paratrain.config.train import TrainConfig, seconds_of
from paratrain.engine import budget as budget_module
from paratrain.engine.budget import Budget, duration
from paratrain.engine.schedule import Schedule, train_size_at
from paratrain.errors import UserError


def test_durations_read_and_write():
    assert [seconds_of(d) for d in ("90s", "15m", "2h", "1h30m", "2.5m")] == [
        90,
        900,
        7200,
        5400,
        150,
    ]
    assert (duration(90), duration(5400), duration(0)) == ("1m30s", "1h30m", "0s")
    with pytest.raises(UserError, match="--budget"):
        resolve_train({"data": "d", "budget": "15 minutes"})
    with pytest.raises(UserError, match="at least a second"):
        resolve_train({"data": "d", "budget": "0s"})


def test_the_plan_fills_what_is_left_and_never_stretches_a_finished_schedule(monkeypatch):
    clock = {"now": 20.0}
    monkeypatch.setattr(budget_module, "since_start", lambda: clock["now"])
    plan = Budget(100.0, spent_before=10.0, steps_per_epoch=10, val_batches=3)
    left = 100 * (1 - budget_module.SAFETY) - budget_module.EXIT - 30
    assert plan.left() == pytest.approx(left)
    assert plan.after_epoch(1.0, 6.0) == pytest.approx(1 + left / 6)
    clock["now"] = 50.0  # the next epochs were slower: the end comes nearer
    assert plan.after_epoch(2.0, 12.0) == pytest.approx(2 + (left - 30) / 9)  # median of 6, 12
    assert not plan.done(2.5) and plan.done(plan.planned)
    clock["now"] = 20.0  # time found again after the end: the schedule stays ended
    assert plan.after_epoch(3.0, 1.0) == plan.planned


def test_the_first_plan_comes_from_the_first_steps(monkeypatch):
    monkeypatch.setattr(budget_module, "since_start", lambda: 0.0)
    ticks = iter([0.0, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5])
    monkeypatch.setattr(budget_module.time, "perf_counter", lambda: next(ticks))
    plan = Budget(60.0, steps_per_epoch=20, val_batches=6)
    planned = [plan.after_step(0.05 * i) for i in range(7)]
    assert planned[:5] == [None] * 5 and planned[6] is None  # planned once
    step = 0.5  # the median: the first interval (warm-up, 1 s) does not move it
    epoch = step * 20 + step * budget_module.EVAL_COST * 6
    assert planned[5] == pytest.approx(0.25 + plan.left() / epoch)


def test_progressive_sizes_rise_late_and_end_at_the_largest():
    cfg = TrainConfig(progressive="32:64", epochs=8)
    sizes = [train_size_at(cfg, e) for e in range(8)]
    assert sizes == sorted(sizes) and sizes[0] == 32 and sizes[-1] == 64
    assert sizes[:4] == [32] * 4  # the first half at the smallest
    assert all(s % 8 == 0 for s in sizes)
    assert cfg.train_size == 64 and cfg.eval_crop == 64  # the cache keeps the largest
    assert train_size_at(TrainConfig(image_size=48), 3) == 48
    with pytest.raises(UserError, match="START at most END"):
        resolve_train({"data": "d", "progressive": "64:32"})


def test_a_fractional_schedule_ends_at_its_length():
    schedule = Schedule(peak=0.1, epochs=2.5, kind="cosine", lrf=0.1)
    assert schedule.lr(2.5) == pytest.approx(0.01) and schedule.lr(0) == pytest.approx(0.1)
