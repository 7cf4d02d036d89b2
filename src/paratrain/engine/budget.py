"""--budget: a run that fits its schedule to the wall-clock it is given.

The clock runs from the command's start (start-up, screening and cache building count)
plus what a resumed run had spent before. After its first few steps the run measures a
step, guesses an evaluation from it, and sets the schedule's length (in epochs, a
fraction allowed) so that training, every epoch's evaluation and checkpoint, and the
last ones end on time; after each epoch it plans again from what the epoch really cost.
Rank 0 decides and every rank follows (their clocks differ a little), so every rank
stops at the same step. The learning rate is a function of how far training is in
epochs (engine/schedule.py), so a new length only reshapes what is left of the curve.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from paratrain.distributed import comm
from paratrain.log import get_logger, since_start

MEASURED_STEPS = 6  # steps timed before the first plan (the first one left out: warm-up)
EVAL_COST = 1 / 3  # a batch's evaluation, as a share of its training step (forward only)
SAFETY = 0.02  # of the budget, kept back for what the plan cannot see (the last write)
EXIT = 2.0  # seconds kept back for the processes to end (measured: 2.5 s for 2 on a CPU)


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

    def elapsed(self) -> float:
        """Seconds of the budget gone: earlier runs' plus this command's so far."""
        return self.spent_before + since_start()

    def left(self) -> float:
        return self.seconds * (1 - SAFETY) - EXIT - self.elapsed()

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
        epoch = step * self.steps_per_epoch + step * EVAL_COST * self.val_batches
        return self._plan(done, epoch, f"{step:.3f} s a step, {self.steps_per_epoch} an epoch")

    def after_epoch(self, done: float, epoch_seconds: float) -> float:
        """Plan again from the epoch's real cost (training, evaluation and checkpoint)."""
        self.epoch_costs.append(epoch_seconds)
        self.last_step = None  # the next epoch's first step starts a new interval
        cost = statistics.median(self.epoch_costs[-3:])
        return self._plan(done, cost, f"{cost:.2f} s an epoch with its evaluation and save")

    def _plan(self, done: float, epoch_seconds: float, how: str) -> float:
        if self.finished:  # the schedule has ended: it is never stretched again
            assert self.planned is not None
            return self.planned
        fits = done + max(self.left(), 0.0) / max(epoch_seconds, 1e-9)
        planned = comm.broadcast_object(fits)
        assert planned is not None  # rank 0's
        first = self.planned is None
        self.planned = max(planned, done)
        if first:
            get_logger().info(
                f"budget {duration(self.seconds)}: {self.planned:.2f} epochs fit in the "
                f"{duration(self.left())} left ({how}); the schedule ends there"
            )
        return self.planned

    def done(self, trained: float) -> bool:
        """Whether training has reached the planned length (for good, once it has)."""
        self.finished = self.finished or (
            self.planned is not None and trained >= self.planned - 1e-9
        )
        return self.finished
