"""--budget: a run that fits its schedule to the wall-clock it is given.

The clock runs from the command's start (start-up, screening and cache building count)
plus what a resumed run had spent before. After its first few steps the run measures a
step, guesses an evaluation from it, and sets the schedule's length (in epochs, a
fraction allowed) so that training, every epoch's evaluation and checkpoint, and the
last ones end on time; after each epoch it plans again from what the epoch really cost.
Rank 0 decides and every rank follows (their clocks differ a little), so every rank
stops at the same step. The learning rate is a function of how far training is in
epochs (engine/run/schedule.py), so a new length only reshapes what is left of the curve.

Before that, the recipe (``--budget-recipe``): when few epochs would fit at the sizes as
given, more epochs at a lower resolution reach a good model sooner (measured on two sets
in docs/benchmarks.md: the plain loop's best in a third of its time). The choice is made once,
before the cache is built (it keeps the sizes chosen), from a few steps timed on
synthetic batches, and recorded in config.yaml (``--budget-recipe low-res``, the sizes
as given), so a resumed run and ``--config`` keep it.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from paratrain.config import TrainConfig
from paratrain.data.folder import DataSplit
from paratrain.distributed import comm
from paratrain.distributed.runtime import Runtime
from paratrain.log import get_logger, since_start

PART = 1e-9  # less of an epoch than this is none: 71 + 1e-12 epochs are 71, not 72
MEASURED_STEPS = 6  # steps timed before the first plan (the first one left out: warm-up)
EVAL_COST = 1 / 3  # a batch's evaluation, as a share of its training step (forward only)
SAFETY = 0.02  # of the budget, kept back for what the plan cannot see (the last write)
EXIT = 0.75  # seconds kept back for the processes to end (measured: 0.3 s for 2 on a CPU,
# from the last line to the command's exit; the launcher looks every 0.5 s)
SHORT = 10.0  # auto: fewer epochs than this at the sizes as given, the low-res recipe
# auto: no low-res recipe that would train below this many pixels (a ResNet's stride:
# its last stage at one pixel). The suite's digits, 8-px originals given at 32 px, trained
# at 16 by the low-res recipe and learnt nearly nothing (docs/benchmarks.md)
SMALLEST = 32
# a re-plan keeps the plan while the end it predicts is within a tenth of the time left
# (so epoch-to-epoch noise early in a long run does not move the counter), at least 2%
# of the budget and a second; near the end that is what the run may miss by
SLACK, DRIFT = 0.02, 0.1
TRAIN_SHARE, EVAL_SHARE = 5 / 8, 3 / 4  # low-res: of the training and validation sizes
BATCH_FACTOR = 2  # low-res: the batch a process, as a multiple of the one given


def duration(seconds: float) -> str:
    """90 s as 1m30s."""
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return (
        "".join(f"{n}{unit}" for n, unit in ((hours, "h"), (minutes, "m"), (secs, "s")) if n)
        or "0s"
    )


@dataclass
class Budget:
    """The run's wall-clock budget and the plan it makes of it."""

    seconds: float  # the whole budget
    spent_before: float = 0.0  # what a resumed run had spent
    steps_per_epoch: int = 1
    val_batches: int = 0
    planned: float | None = None  # the schedule's length in epochs, once planned
    step_times: list[float] = field(default_factory=list)
    last_step: float | None = None
    epoch_costs: list[float] = field(default_factory=list)  # train + eval + save, per epoch
    finished: bool = False  # the planned length reached
    largest: int = 0  # --progressive: the largest size trained at so far

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the budget: its length, the plan, the costs
        measured, and --progressive's largest size (a resumed run never goes back down)."""
        return {
            "seconds": self.seconds,
            "spent": self.elapsed(),
            "planned": self.planned,
            "epoch_costs": list(self.epoch_costs),
            "largest": self.largest,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The largest size trained at; the plan is made again from this run's steps
        (the machine, the world size and the budget may differ)."""
        if state:
            self.largest = max(self.largest, int(state.get("largest", 0)))

    def elapsed(self) -> float:
        """Seconds of the budget gone: earlier runs' plus this command's so far."""
        return self.spent_before + since_start()

    def left(self) -> float:
        """Seconds left by this rank's clock (a decision reads rank 0's: agreed_left)."""
        return self.seconds * (1 - SAFETY) - EXIT - self.elapsed()

    def agreed_left(self) -> float:
        """Rank 0's seconds left, on every rank."""
        left = comm.broadcast_object(self.left())
        assert left is not None  # rank 0's
        return left

    def after_step(self, done: float) -> float | None:
        """Called after every step (``done``: epochs trained so far); a new plan (the
        schedule's length, agreed on every rank) after the first measured steps."""
        now = time.perf_counter()
        if self.last_step is not None and self.planned is None:
            self.step_times.append(now - self.last_step)
        self.last_step = now
        if self.planned is not None or len(self.step_times) < MEASURED_STEPS - 1:
            return None
        step = statistics.median(self.step_times)
        epoch = epoch_cost(step, self.steps_per_epoch, self.val_batches)
        return self._plan(done, epoch, f"{step:.3f} s a step, {self.steps_per_epoch} an epoch")

    def first_plan(self, done: float, train_seconds: float, steps: int) -> float | None:
        """The plan at the end of a first epoch too short to have timed its steps (fewer
        than MEASURED_STEPS): from the epoch's own steps, before its line is printed, so
        the epoch counter agrees with the plan from the first line."""
        if self.planned is not None or steps < 1:
            return None
        step = train_seconds / steps
        epoch = epoch_cost(step, self.steps_per_epoch, self.val_batches)
        return self._plan(done, epoch, f"{step:.3f} s a step, {self.steps_per_epoch} an epoch")

    def after_epoch(self, done: float, epoch_seconds: float) -> float:
        """Plan again from the epochs' real cost (training, evaluation and checkpoint):
        the mean of the last eight, the first left out (it pays once for what the next
        ones do not: the first evaluation, the first plot; after it the plan made from
        the steps stands, measured closer to the next epochs than the first was). A
        mean, since epochs differ by what they write (a new best.pt, or not): measured
        on the digits, a median of three swung by 15% from epoch to epoch."""
        self.epoch_costs.append(epoch_seconds)
        self.last_step = None  # the next epoch's first step starts a new interval
        if len(self.epoch_costs) == 1 and self.planned is not None:
            return self.planned  # the steps' plan stands until an epoch without first times
        costs = self.epoch_costs[1:] or self.epoch_costs
        cost = statistics.fmean(costs[-8:])
        return self._plan(done, cost, f"{cost:.2f} s an epoch with its evaluation and save")

    def _plan(self, done: float, epoch_seconds: float, how: str) -> float:
        if self.finished:  # the schedule has ended: it is never stretched again
            assert self.planned is not None
            return self.planned
        # rank 0's clock and costs decide, so every rank keeps or moves the plan alike: the
        # time left too, which the threshold below reads (the ranks' clocks start apart)
        agreed = comm.broadcast_object((max(self.left(), 0.0), epoch_seconds))
        assert agreed is not None  # rank 0's
        left, epoch_seconds = agreed
        fits = done + left / max(epoch_seconds, 1e-9)
        if self.planned is None:
            self.planned = fits
            get_logger().info(self._first_words(fits, left, how))
        elif abs(fits - self.planned) * epoch_seconds > max(
            SLACK * self.seconds, 1.0, DRIFT * left
        ):
            before, self.planned = self.planned, fits
            if counted(before) != counted(fits):
                get_logger().info(
                    f"budget {duration(self.seconds)}: {fits:.2f} epochs fit, not "
                    f"{before:.2f}: {how} ({duration(left)} left); the run now ends after "
                    f"epoch {counted(fits)}"
                )
        return self.planned

    def _first_words(self, fits: float, left: float, how: str) -> str:
        budget = f"budget {duration(self.seconds)}"
        if fits < 1:
            return (
                f"{budget}: not one epoch fits in the {duration(left)} left ({how}): "
                f"training {fits:.2f} of an epoch, then one evaluation and checkpoint"
            )
        return (
            f"{budget}: {shown_fit(fits)} epochs fit in the {duration(left)} left ({how}); "
            "the schedule ends there"
        )

    def done(self, trained: float) -> bool:
        """Whether training has reached the planned length (for good, once it has)."""
        self.finished = self.finished or (
            self.planned is not None and trained >= self.planned - PART
        )
        return self.finished


def counted(epochs: float) -> int:
    """The epoch counter's total for a schedule of ``epochs`` (its last epoch maybe in
    part): rounded up, and at least one."""
    return max(math.ceil(epochs - PART), 1)


def shown_fit(fits: float) -> str:
    """Epochs that fit, to two decimals rounded up as the epoch counter rounds them
    (71.001 is 71.01, not 71.00, where the counter says 72)."""
    return f"{math.ceil(round((fits - PART) * 100, 6)) / 100:.2f}"


# ------------------------------------------------------------------ the recipe


def eighth(size: float) -> int:
    """A size in pixels rounded to a multiple of 8 (at least 8)."""
    return max(8, int(round(size / 8)) * 8)


def low_res(cfg: TrainConfig) -> TrainConfig:
    """The low-resolution recipe's concrete settings: training at 5/8 of the size,
    evaluating at 3/4, twice the batch a process at the learning rate of the batch as
    given (--lr as given, or --lr-base halved)."""
    return replace(
        cfg,
        train_crop=eighth(cfg.train_size * TRAIN_SHARE),
        val_crop=eighth(cfg.eval_crop * EVAL_SHARE),
        batch_size=BATCH_FACTOR * cfg.batch,
        lr_base=cfg.lr_base / BATCH_FACTOR if cfg.lr is None else cfg.lr_base,
        budget_recipe="fixed",  # its sizes are explicit now (a checkpoint keeps them)
    )


def concrete(cfg: TrainConfig) -> TrainConfig:
    """What a run trains with: the recipe applied where --budget-recipe is low-res."""
    return low_res(cfg) if cfg.budget and cfg.budget_recipe == "low-res" else cfg


def may_choose(cfg: TrainConfig) -> bool:
    """Whether auto may choose low-res: from scratch (the measurements were) and with no
    size set by the user."""
    return cfg.budget_recipe == "auto" and not cfg.sizes_given() and cfg.weights is None


def recorded_recipe(run_dir: Path) -> str:
    """The recipe a run's config.yaml recorded (fixed where it says none)."""
    try:
        values = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return "fixed"
    return "low-res" if values.get("budget_recipe") == "low-res" else "fixed"


def epoch_cost(step: float, train_batches: int, val_batches: int) -> float:
    """An epoch's seconds at ``step`` seconds a training batch: its training batches, and
    its validation batches at a share of a step each."""
    return step * (train_batches + EVAL_COST * val_batches)


def epoch_seconds(step: float, cfg: TrainConfig, train: int, val: int, replicas: int) -> float:
    """An epoch's seconds for ``train`` and ``val`` images over ``replicas`` (each replica
    takes its batches at once)."""
    per_step = cfg.batch * replicas
    return epoch_cost(step, -(-train // per_step), -(-val // per_step))


def _takes(cfg: TrainConfig, world: int) -> bool:
    """Whether the model takes the recipe's sizes (a ViT of fixed size does not)."""
    from paratrain.engine.prerun.preflight import check_model_input
    from paratrain.errors import UserError

    try:
        check_model_input(cfg, world)
    except UserError:
        return False
    return True


def recipe_words(cfg: TrainConfig) -> str:
    """How the low-res recipe changes a run, in words."""
    chosen = low_res(cfg)
    return (
        f"training at {chosen.train_size} px, evaluating at {chosen.eval_crop}, batch "
        f"{chosen.batch} a process at the same learning rate"
    )


def choose_recipe(
    cfg: TrainConfig, runtime: Runtime, split: DataSplit, resumed: Path | None
) -> TrainConfig:
    """--budget-recipe auto made low-res or fixed (every rank the same), and said; a
    resumed run keeps what its config.yaml recorded. Low-res where few epochs fit at the
    sizes given, unless a look at a few training images finds that the lower sizes lose
    what tells the classes apart (engine/prerun/detail.py). The look comes first: it
    costs a few small decodes, and where it keeps the sizes no step is timed (the
    probe's second or more is the budget's; on the suite's fine-detail set, 1.1 s of a
    22 s budget)."""
    train, val = len(split.train), len(split.val)
    if not cfg.budget or cfg.budget_recipe != "auto":
        return cfg
    if resumed is not None:
        return replace(cfg, budget_recipe=recorded_recipe(resumed))
    if not may_choose(cfg) or not _takes(low_res(cfg), runtime.world_size):
        return replace(cfg, budget_recipe="fixed")
    budget = f"budget {duration(cfg.budget_seconds or 0.0)}"
    if low_res(cfg).train_size < SMALLEST:
        get_logger().info(
            f"{budget}: the sizes as given (low-res would train at "
            f"{low_res(cfg).train_size} px, below {SMALLEST})"
        )
        return replace(cfg, budget_recipe="fixed")
    if _detail_lost(cfg, split, budget):  # a look at a few images, before any step is timed
        return replace(cfg, budget_recipe="fixed")
    from paratrain.engine.prerun.probe import step_seconds  # builds a model: only when choosing

    get_logger().info(
        f"{budget}: timing a few steps of the model on synthetic batches to choose the "
        f"recipe ({since_start():.1f}s gone; --budget-recipe fixed skips this)"
    )
    started = time.perf_counter()
    step, replicas = step_seconds(cfg, runtime)
    probe = time.perf_counter() - started
    epoch = epoch_seconds(step, cfg, train, val, replicas)
    fits = comm.broadcast_object(max(Budget(cfg.budget_seconds or 0.0).left(), 0.0) / epoch)
    assert fits is not None  # rank 0's
    short = fits < SHORT
    get_logger().info(
        f"{budget}: about {fits:.1f} epochs fit at {cfg.train_size} px ({step:.3f} s a "
        f"step on synthetic batches; timing took {probe:.1f}s of the budget), "
        + (
            f"fewer than {SHORT:.0f}: --budget-recipe low-res"
            if short
            else f"{SHORT:.0f} or more: the sizes as given"
        )
    )
    return replace(cfg, budget_recipe="low-res" if short else "fixed")


def _detail_lost(cfg: TrainConfig, split: DataSplit, budget: str) -> bool:
    """Whether the low-res recipe's sizes lose what tells the classes apart (rank 0
    looks, every rank follows); said either way (where they keep it, the probe then
    decides)."""
    from paratrain.engine.prerun.detail import check_detail

    low = low_res(cfg)
    check = comm.agree(lambda: check_detail(split.train, cfg, low, cfg.split_seed))
    words = check.words(cfg.eval_crop, low.eval_crop)
    get_logger().info(
        f"{budget}: {words}: "
        + (
            "the lower size loses what tells them apart: the sizes as given"
            if check.lost
            else "the lower size keeps it"
        )
    )
    return check.lost
