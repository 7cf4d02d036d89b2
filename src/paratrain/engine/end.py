"""Where a run stops: the one end condition, asked at every step and epoch boundary.

The run ends after its epochs (the schedule's length, a fraction allowed), at
``--max-steps``, or when ``--budget``'s plan says, whose plan moves the end: the budget
re-plans here and the schedule follows, never the loop. A stop signal is the step
control's (engine/run/control.py): it saves at the next step boundary and raises. The
settings are never rewritten: the end in whole epochs is ``End.whole``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from paratrain.config import TrainConfig
from paratrain.engine.prerun.budget import Budget, counted, duration
from paratrain.engine.run.schedule import Schedule, train_size_at
from paratrain.errors import AgreedUserError
from paratrain.log import get_logger


@dataclass
class End:
    """The run's end: ``schedule.epochs`` (moved by the budget's plan), ``max_steps``."""

    schedule: Schedule
    max_steps: int = 0
    budget: Budget | None = None
    freeze_epochs: int = 0
    told_frozen: bool = False  # said that the budget's plan ends before --freeze-epochs

    def state_dict(self) -> dict[str, Any]:
        """The schedule as planned (for a reader: the rate is derived, not saved) and
        the budget's part, where there is one."""
        return {
            "schedule": dataclasses.asdict(self.schedule),
            "budget": self.budget.state_dict() if self.budget is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The budget's part; the schedule is this run's (made from its settings)."""
        if state and self.budget is not None:
            self.budget.load_state_dict(state.get("budget"))

    def budget_spent(self, seconds: float) -> None:
        """A resumed run's budget counts what its earlier runs spent."""
        if self.budget is not None:
            self.budget.spent_before = seconds

    @property
    def epochs(self) -> float:
        return self.schedule.epochs

    @property
    def whole(self) -> int:
        """The epochs the run trains (the last one maybe in part): the counter's total."""
        return counted(self.epochs)

    def at_start(self, epoch: int, global_step: int, budget_text: str) -> str | None:
        """Before the first epoch: None to train, else why nothing is left to train ('':
        the epochs were reached). A budget spent before a first step is refused."""
        if self.budget is None:
            return "" if epoch >= self.whole else None
        if self.budget.agreed_left() <= 0:  # every rank trains on, or none
            spent = duration(self.budget.elapsed())
            if global_step == 0:
                raise AgreedUserError(
                    f"--budget {budget_text} was used up before the first step (start-up: "
                    f"{spent}): give a budget longer than the start-up"
                )
            return (
                f"--budget {budget_text} is spent ({spent} trained, the rest kept for saving "
                "and ending); a longer --budget trains on"
            )
        self.plan(max(self.epochs, epoch + 1.0))
        return None

    def after_step(self, trained: float, global_step: int, bar: Any = None, epoch: int = 0) -> bool:
        """After a step (``trained``: epochs so far): whether the epoch stops here."""
        if self.budget is not None:
            if (planned := self.budget.after_step(trained)) is not None:
                self.plan(planned, bar, epoch)
            if self.budget.done(trained):
                return True
        return bool(self.max_steps) and global_step >= self.max_steps

    def epoch_trained(self, trained: float, seconds: float, steps: int) -> None:
        """An epoch's steps are done: one too short to time its steps is planned now,
        before its line, so the counter agrees with the plan from the first line."""
        if self.budget is not None:
            planned = self.budget.first_plan(trained, seconds, steps)
            if planned is not None:
                self.plan(planned)

    def after_epoch(self, epoch: int, seconds: float, global_step: int) -> bool:
        """After epoch ``epoch`` (0-based) was evaluated and saved: whether another
        follows. ``seconds``: what it cost, training, evaluation and saving."""
        if self.budget is not None:
            self.plan(self.budget.after_epoch(float(epoch + 1), seconds))
        if self.max_steps and global_step >= self.max_steps:
            return False  # --max-steps: evaluated and saved already
        return epoch + 1 < self.whole

    def train_size(self, cfg: TrainConfig, epoch: int) -> int:
        """--progressive: this epoch's training size over the planned length. Before a
        budget's first plan, the start size; a moving end never takes it back down."""
        if self.budget is None:
            return train_size_at(cfg, epoch, self.epochs)
        length = math.inf if self.budget.planned is None else self.epochs
        self.budget.largest = max(train_size_at(cfg, epoch, length), self.budget.largest)
        return self.budget.largest

    def plan(self, epochs: float, bar: Any = None, epoch: int = 0) -> None:
        """The schedule ends at ``epochs``: the budget's plan. One that ends before
        --freeze-epochs thaws the backbone says so, once; the epoch's progress bar, if
        any, counts to the new end."""
        freezing = self.freeze_epochs
        if freezing and epochs <= freezing and self.budget is not None and self.budget.planned:
            if not self.told_frozen:
                get_logger().info(
                    f"--budget fits {epochs:.1f} epoch(s), not more than --freeze-epochs "
                    f"{freezing}: the backbone stays frozen for the whole run"
                )
            self.told_frozen = True
        self.schedule = dataclasses.replace(self.schedule, epochs=epochs)
        if bar is not None:
            bar.set_description(f"epoch {epoch + 1}/{self.whole}")
