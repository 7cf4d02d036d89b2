"""--budget's arithmetic, --progressive's sizes, and their settings."""

from __future__ import annotations

from dataclasses import replace

import pytest

from paratrain.config import resolve_train
from paratrain.config.train import TrainConfig, seconds_of
from paratrain.engine.prerun import budget as budget_module
from paratrain.engine.prerun.budget import Budget, duration
from paratrain.engine.run.schedule import Schedule, train_size_at
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
    # the first epoch's cost is left out once there is another (it pays for first times)
    assert plan.after_epoch(2.0, 12.0) == pytest.approx(2 + (left - 30) / 12)
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


def test_a_re_plan_within_the_slack_keeps_the_plan_and_a_new_end_is_said(monkeypatch):
    """The epoch counter's total moves only when the plan does, and the line says why."""
    said = _Said()
    monkeypatch.setattr(budget_module, "get_logger", lambda: said)
    clock = {"now": 10.0}
    monkeypatch.setattr(budget_module, "since_start", lambda: clock["now"])
    plan = Budget(100.0, steps_per_epoch=10, val_batches=3)
    first = plan.after_epoch(1.0, 10.0)  # 1 + left / 10
    clock["now"] = 20.0
    told = len(said.lines)  # the first plan's line
    # 10.05 s an epoch: the end moves by less than the slack: kept, and nothing said
    assert plan.after_epoch(2.0, 10.05) == first
    assert len(said.lines) == told
    clock["now"] = 35.0  # 15 s an epoch: the end comes nearer by whole epochs
    moved = plan.after_epoch(3.0, 15.0)
    text = said.lines[-1]
    assert moved == pytest.approx(3 + plan.left() / 12.525)  # the mean of 10.05 and 15
    assert f"{moved:.2f} epochs fit, not {first:.2f}" in text
    assert "12.53 s an epoch" in text and "ends after epoch 8" in text


def test_a_budget_that_fits_no_whole_epoch_says_so_and_trains_what_fits(monkeypatch):
    said = _Said()
    monkeypatch.setattr(budget_module, "get_logger", lambda: said)
    monkeypatch.setattr(budget_module, "since_start", lambda: 5.0)
    plan = Budget(30.0, steps_per_epoch=100, val_batches=10)
    planned = plan.first_plan(0.1, train_seconds=6.0, steps=10)  # 0.6 s a step
    assert planned is not None and 0 < planned < 1
    assert "not one epoch fits" in said.lines[0]
    assert f"training {planned:.2f} of an epoch" in said.lines[0]
    assert plan.first_plan(0.2, 1.0, 1) is None  # planned already: once


def test_auto_keeps_the_sizes_where_low_res_would_train_too_small(monkeypatch):
    import torch

    from paratrain.distributed.env import DistEnv
    from paratrain.distributed.runtime import Runtime

    cfg = TrainConfig(data="d", image_size=32, budget="30s")
    assert budget_module.may_choose(cfg)
    assert budget_module.low_res(cfg).train_size < budget_module.SMALLEST
    said = _Said()
    monkeypatch.setattr(budget_module, "get_logger", lambda: said)
    runtime = Runtime(env=DistEnv(), device=torch.device("cpu"), backend=None)
    chosen = budget_module.choose_recipe(cfg, runtime, _split(1000, 100), None)
    assert chosen.budget_recipe == "fixed"
    assert said.lines == ["budget 30s: the sizes as given (low-res would train at 16 px, below 32)"]


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


# ------------------------------------------------------------------ --budget-recipe


def test_the_low_res_recipe_trains_smaller_at_twice_the_batch_and_the_same_rate():
    cfg = TrainConfig(data="d", image_size=64, batch_size=16, budget="45s")
    low = budget_module.low_res(cfg)
    assert (low.train_size, low.eval_crop, low.batch) == (40, 48, 32)
    assert low.image_size == 64  # what the cache and the user's size keep
    for replicas in (1, 2, 8):
        assert low.rate(replicas) == pytest.approx(cfg.rate(replicas))
    given = budget_module.low_res(TrainConfig(data="d", image_size=224, lr=0.05, budget="9m"))
    assert (given.train_size, given.eval_crop, given.lr) == (144, 168, 0.05)
    # named in config.yaml, made sizes once: applying it again changes nothing
    named = TrainConfig(
        data="d", image_size=64, batch_size=16, budget="45s", budget_recipe="low-res"
    )
    made = budget_module.concrete(named)
    assert made.train_size == 40 and made.budget_recipe == "fixed"
    assert budget_module.concrete(made) == made
    assert budget_module.concrete(cfg) is cfg  # auto until decided: as given


def test_the_low_res_recipe_is_refused_without_a_budget_or_with_sizes_given():
    with pytest.raises(UserError, match="recipe for --budget"):
        resolve_train({"data": "d", "budget_recipe": "low-res"})
    with pytest.raises(UserError, match="leave out --train-crop, --val-size"):
        resolve_train(
            {"data": "d", "budget": "1m", "budget_recipe": "low-res", "train_crop": 32,
             "val_crop": 40}
        )  # fmt: skip
    with pytest.raises(UserError, match="--budget-recipe"):
        resolve_train({"data": "d", "budget": "1m", "budget_recipe": "half"})


def test_auto_chooses_only_from_scratch_and_where_no_size_is_set():
    base = TrainConfig(data="d", budget="1m")
    assert budget_module.may_choose(base)
    for given in (
        {"weights": "w.pt"},
        {"train_crop": 32},
        {"val_crop": 80},
        {"progressive": "32:64"},
        {"budget_recipe": "fixed"},
    ):
        assert not budget_module.may_choose(replace(base, **given)), given


def _split(train: int, val: int):
    """A split of ``train`` and ``val`` images, by count only (nothing reads them)."""
    from types import SimpleNamespace

    return SimpleNamespace(train=range(train), val=range(val))


@pytest.fixture
def one_process():
    from paratrain.distributed.env import DistEnv
    from paratrain.distributed.runtime import distributed

    with distributed(DistEnv(), "cpu", None, 60) as runtime:
        yield runtime


class _Said:
    """A logger that keeps what it is told (the run's logger may be set up by an earlier
    test in the same process, not to propagate)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, line: str) -> None:
        self.lines.append(line)


@pytest.mark.parametrize(("budget", "chosen"), [("1s", "low-res"), ("100h", "fixed")])
def test_auto_times_real_steps_and_chooses_low_res_when_few_epochs_fit(
    one_process, monkeypatch, budget, chosen
):
    """The probe trains a copy of the run's model on synthetic batches: a budget
    already spent fits no epoch (low-res); a hundred hours fit thousands (fixed)."""
    said = _Said()
    monkeypatch.setattr(budget_module, "get_logger", lambda: said)
    monkeypatch.setattr(
        budget_module, "_detail_lost", lambda *_: False
    )  # tests/engine/test_detail.py
    cfg = TrainConfig(data="d", model="resnet18", image_size=64, batch_size=4, budget=budget)
    decided = budget_module.choose_recipe(cfg, one_process, _split(400, 100), None)
    assert decided.budget_recipe == chosen
    # said before the probe (its seconds are the budget's), and after it with its cost
    assert len(said.lines) == 2 and "timing a few steps" in said.lines[0], said.lines
    assert "epochs fit at 64 px" in said.lines[1] and "timing took" in said.lines[1]
    assert said.lines[-1].endswith(
        "--budget-recipe low-res" if chosen == "low-res" else "the sizes as given"
    )


def test_auto_reckons_the_epoch_from_the_step_and_the_replicas(monkeypatch, one_process):
    """0.1 s a step, 2 replicas of batch 4: 100 training batches and 25 validation ones
    a replica (a third of a step each), so an epoch is 10.83 s; 60 s minus what the plan
    keeps back fit about 5 of them, fewer than 10; with an epoch of 10 training batches,
    about 50 fit."""
    import paratrain.engine.prerun.probe as probe

    monkeypatch.setattr(probe, "step_seconds", lambda cfg, runtime: (0.1, 2))
    monkeypatch.setattr(budget_module, "since_start", lambda: 0.0)
    monkeypatch.setattr(budget_module, "_detail_lost", lambda *_: False)
    cfg = TrainConfig(data="d", model="resnet18", image_size=64, batch_size=4, budget="60s")
    assert budget_module.epoch_seconds(0.1, cfg, 800, 200, 2) == pytest.approx(0.1 * (100 + 25 / 3))
    assert budget_module.choose_recipe(cfg, one_process, _split(800, 200), None).budget_recipe == (
        "low-res"
    )
    assert (
        budget_module.choose_recipe(cfg, one_process, _split(80, 20), None).budget_recipe == "fixed"
    )


def test_auto_keeps_what_a_resumed_run_recorded_and_never_a_size_the_model_refuses(
    tmp_path, one_process, monkeypatch
):
    import paratrain.engine.prerun.probe as probe

    def never(*_):
        raise AssertionError("a resumed run or a refused size times nothing")

    monkeypatch.setattr(probe, "step_seconds", never)
    cfg = TrainConfig(data="d", model="resnet18", image_size=64, batch_size=4, budget="1s")
    replace(cfg, budget_recipe="low-res").save(tmp_path / "config.yaml")
    assert budget_module.recorded_recipe(tmp_path) == "low-res"
    assert budget_module.choose_recipe(
        cfg, one_process, _split(400, 100), tmp_path
    ).budget_recipe == ("low-res")
    assert budget_module.recorded_recipe(tmp_path / "none") == "fixed"  # no config.yaml
    # a ViT made for 64 px takes no other size: the sizes as given
    vit = replace(cfg, model="vit_b_16")
    assert budget_module.choose_recipe(vit, one_process, _split(400, 100), None).budget_recipe == (
        "fixed"
    )


@pytest.mark.parametrize(
    ("budget", "recipe", "size", "said"),
    [
        ("1s", "auto", 64, "so the run would likely choose --budget-recipe low-res"),
        ("1s", "auto", 32, None),  # low-res would train at 16 px, below SMALLEST
        ("100h", "auto", 64, None),
        ("100h", "low-res", 64, "--budget-recipe low-res: training at 40 px, evaluating at 48"),
    ],
)
def test_a_dry_run_says_the_epochs_that_fit_and_the_recipe(budget, recipe, size, said):
    from paratrain.bench.speed import budget_plan

    cfg = TrainConfig(
        data="d", model="resnet18", image_size=size, batch_size=4, budget=budget,
        budget_recipe=recipe,
    )  # fmt: skip
    line = budget_plan(cfg, 400, 100, 2)
    timed = 40 if recipe == "low-res" else size  # a low-res run's steps are timed at its size
    assert f"epochs at {timed} px" in line, line
    assert (said in line) if said else ("low-res" not in line), line


def test_a_budget_used_up_before_the_first_step_is_refused_and_a_spent_one_says_so(
    image_folder, tmp_path, monkeypatch, capsys
):
    """--budget 1s on a fresh run is refused (exit 2) naming the budget, not "0 of 5
    epochs already trained"; a resumed run whose budget is spent says so and how to go
    on, not --epochs (which --budget ignores)."""
    from paratrain import train
    from paratrain.errors import AgreedUserError
    from paratrain.log import since_start

    common = dict(
        data=str(image_folder), image_size=16, batch_size=4, workers=0, epochs=5,
        output_dir=str(tmp_path / "runs"), name="b", cache="off",
    )  # fmt: skip
    with pytest.raises(AgreedUserError) as refused:
        train(TrainConfig(**common, budget="1s"))
    assert refused.value.exit_code == 2
    assert str(refused.value).startswith("--budget 1s was used up before the first step")
    assert not (tmp_path / "runs" / "b").exists()  # nothing trained, nothing left behind
    train(TrainConfig(**common, max_steps=2))  # a run with a checkpoint to resume
    monkeypatch.setattr(budget_module, "since_start", lambda: since_start() + 3600)
    capsys.readouterr()
    train(TrainConfig(**common, budget="10m", resume="auto"))
    said = [line for line in capsys.readouterr().out.splitlines() if "is spent" in line]
    assert len(said) == 1
    assert said[0].startswith(f"{tmp_path / 'runs' / 'b'}: --budget 10m is spent (1h")
    assert said[0].endswith(
        "trained, the rest kept for saving and ending); a longer --budget trains on"
    )


def test_the_first_epochs_cost_does_not_move_a_plan_made_from_the_steps(monkeypatch):
    """The first epoch pays once for its first evaluation and plot (on the digits 2.65 s
    against 2.30 for the next): the steps' plan stands until the second epoch's cost."""
    clock = {"now": 10.0}
    monkeypatch.setattr(budget_module, "since_start", lambda: clock["now"])
    plan = Budget(100.0, steps_per_epoch=10, val_batches=3)
    planned = plan.first_plan(0.5, train_seconds=5.0, steps=5)  # 1 s a step
    assert planned is not None
    clock["now"] = 30.0
    assert plan.after_epoch(1.0, 20.0) == planned  # twice the steps' guess: not yet
    clock["now"] = 50.0
    assert plan.after_epoch(2.0, 20.0) < planned  # the second confirms it: the end moves


def _plans_on_rank(rank: int, world_size: int) -> tuple[float | None, str | None]:
    """A budget whose ranks' clocks stand 100 s apart (each process counts from its own
    start), at a re-plan whose change lies between the two ranks' thresholds (a tenth
    of the time left), and a resumed run's start where rank 1's clock says spent."""
    from paratrain.engine.end import End

    clocks = {0: 0.0, 1: 100.0}
    budget_module.since_start = lambda: clocks[rank]  # a forked process of its own
    plan = Budget(1000.0, steps_per_epoch=10, val_batches=3)
    left = plan.left() if rank == 0 else plan.left() + 100  # rank 0's: 979.25 s
    cost = (left - 93.0) / 9  # moving the end from 10 epochs to 1 + left / cost: 93 s
    plan.planned, plan.epoch_costs = 10.0, [cost]
    planned = plan.after_epoch(1.0, cost)
    clocks[1] = 990.0  # rank 1 alone sees the budget spent
    end = End(Schedule(peak=0.1, epochs=5.0), budget=Budget(1000.0))
    return planned, end.at_start(2, 40, "1000s")


def test_every_rank_moves_the_plan_and_starts_by_rank_zeros_clock():
    """The ranks' clocks differ by when each process started; a decision made on one's
    own clock (whether a re-plan moves the end, whether a resumed budget is spent) let
    one rank end its epoch a step before another, which then waited for it in the next
    collective for ever (seen once in a resumed --budget run). Rank 0's clock decides."""
    from spawn import run_distributed

    (planned, started), other = run_distributed(_plans_on_rank, 2)
    assert (planned, started) == other
    assert planned == 10.0  # 93 s under rank 0's threshold of 97.9 s: the plan stands
    assert started is None  # rank 0's budget is not spent: both train


@pytest.mark.parametrize(
    "fits, shown, counted",
    [(71.001, "71.01", 72), (71.0, "71.00", 71), (71.0 + 1e-12, "71.00", 71), (2.345, "2.35", 3),
     (0.3, "0.30", 1)],
)  # fmt: skip
def test_the_epochs_said_to_fit_round_as_the_counter_does(fits, shown, counted):
    """The start line's figure, rounded up, is the epoch counter's total, which the run's
    end (engine/end.py) reads too."""
    import math

    from paratrain.engine.end import End
    from paratrain.engine.prerun import budget
    from paratrain.engine.run.schedule import Schedule

    assert budget.shown_fit(fits) == shown
    assert budget.counted(fits) == counted == End(Schedule(peak=0.1, epochs=fits)).whole
    assert max(math.ceil(float(shown)), 1) == counted
