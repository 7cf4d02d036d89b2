"""What it leaves: the run folder, resuming, the experiment trackers."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.schema import setting
from paratrain.config.words import RUN_NAME, TRACKERS


@dataclass(frozen=True)
class OutputSettings:
    output_dir: str = setting(
        "runs", "parent of run directories", group="output", metavar="DIR", resume="quiet"
    )
    name: str | None = setting(
        None,
        "run directory name",
        group="output",
        pattern=RUN_NAME,
        pattern_text="a folder name (no path separators)",
        default_text="a timestamp",
        resume="quiet",
    )
    resume: str | None = setting(
        None,
        "checkpoint (a .pt file, a sharded checkpoint's folder, or a run directory for its "
        "last one), or auto for the newest in the run directory",
        group="output",
        path="entry",
        auto=True,
        metavar="PATH|auto",
        resume="quiet",
    )
    logger: str | None = setting(
        None,
        "experiment trackers, comma-separated; each needs its extra, if any",
        group="output",
        choices_from=TRACKERS,
        listed=True,
        metavar="NAME[,NAME]",
        resume="quiet",
    )
    tensorboard: bool = setting(
        False, "the same as --logger tensorboard", group="output", resume="quiet"
    )
    tracker_timeout: float = setting(
        5.0,
        "seconds an experiment tracker's server has to answer: once before the launch, "
        "and each call during the run",
        group="output",
        low=0.1,
        high=600.0,
        resume="quiet",
    )
    on_tracker_error: str = setting(
        "fail",
        "a tracker that cannot be reached or started before training: fail (one line) or "
        "warn (train without it); one that fails during the run never stops training",
        group="output",
        choices=("fail", "warn"),
        resume="quiet",
    )
