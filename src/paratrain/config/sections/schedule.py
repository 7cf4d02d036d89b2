"""How long and at what rate over time: epochs or steps or a time budget, the schedule and its warm-up."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.schema import setting
from paratrain.config.words import DURATION


@dataclass(frozen=True)
class ScheduleSettings:
    epochs: int = setting(10, "passes over the training images", group="optimisation", low=1)
    max_steps: int | None = setting(
        None,
        "stop after this many optimizer steps, with an evaluation and a checkpoint (a quick "
        "smoke run, as Lightning's fast_dev_run)",
        group="optimisation",
        low=1,
    )
    limit_val_batches: int | None = setting(
        None,
        "evaluate on only the first N batches of each rank's validation shard (a smoke run: "
        "not every image, so not the exact figure)",
        group="optimisation",
        low=1,
    )
    budget: str | None = setting(
        None,
        "wall-clock to train in (90s, 15m, 2h, 1h30m), from the command's start: the "
        "schedule is fitted to it from the measured step, evaluation and save times, the "
        "rate falling linearly to zero at its end (--sched linear --lrf 0 where not given), "
        "and the run ends on time with a last evaluation and checkpoint (--epochs: ignored)",
        group="optimisation",
        pattern=DURATION,
        pattern_text="a duration such as 90s, 15m, 2h or 1h30m",
        metavar="DURATION",
    )
    budget_recipe: str = setting(
        "auto",
        "with --budget, the resolution: low-res trains at 5/8 of the size and evaluates at "
        "3/4, twice the batch at the same learning rate (more epochs in the time: sooner to "
        "a good model in short runs); auto chooses it when fewer than 10 epochs at the sizes "
        "as given fit (timed on a few synthetic steps), from scratch and with no size set "
        "(--train-crop, --val-size, --progressive); fixed keeps the sizes as given",
        group="optimisation",
        choices=("auto", "low-res", "fixed"),
    )
    lrf: float = setting(
        0.1, "final lr as a fraction of lr", group="optimisation", low=0.0, high=1.0
    )
    sched: str = setting(
        "cosine",
        "learning-rate schedule, updated every step: cosine to lr x lrf; linear to lr x lrf; "
        "step (x --lr-gamma every --lr-step-size epochs); multistep (x --lr-gamma at each "
        "--lr-milestones epoch); constant",
        group="optimisation",
        choices=("cosine", "linear", "step", "multistep", "constant"),
    )
    lr_step_size: int = setting(30, "step: epochs between decays", group="optimisation", low=1)
    lr_gamma: float = setting(
        0.1,
        "step, multistep: the factor of each decay",
        group="optimisation",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    lr_milestones: str | None = setting(
        None,
        "multistep: comma-separated epochs at which the rate decays (e.g. 30,60,80)",
        group="optimisation",
        pattern=r"\d+(,\d+)*",
        pattern_text="epochs separated by commas",
    )
    warmup_epochs: int = setting(0, "linear warm-up epochs", group="optimisation", low=0)
    warmup_steps: int = setting(
        0, "linear warm-up in steps instead of epochs", group="optimisation", low=0
    )
    warmup_start: float = setting(
        0.01,
        "the warm-up starts at this fraction of the peak rate",
        group="optimisation",
        low=0.0,
        high=1.0,
    )
