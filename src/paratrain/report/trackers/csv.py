"""--logger csv: per-step scalars in a CSV file (no package needed)."""

from __future__ import annotations

import csv
from pathlib import Path

from paratrain.report.trackers.base import TrackerKind


class CsvTracker:
    """Per-step scalars in <run>/steps.csv (the epochs are in metrics.csv, the settings
    in config.yaml, as every run writes them)."""

    COLUMNS = ["step", "train/loss", "train/acc", "train/lr", "train/images_per_s"]

    def __init__(self, run_dir: Path, settings: dict, ids: dict):
        self.path = run_dir / "steps.csv"
        if not self.path.exists():
            with self.path.open("w", newline="") as handle:
                csv.writer(handle).writerow(self.COLUMNS)

    def step(self, step: int, scalars: dict[str, float]) -> None:
        with self.path.open("a", newline="") as handle:
            csv.writer(handle).writerow([step, *(f"{scalars[k]:.6g}" for k in self.COLUMNS[1:])])

    def epoch(self, epoch: int, step: int, scalars: dict[str, float]) -> None:
        pass  # metrics.csv has them

    def finish(self, curves: Path | None, checkpoint: Path | None) -> None:
        pass  # curves.png and the checkpoints are in the run folder

    def close(self, failed: bool) -> None:
        pass


TRACKER = TrackerKind("csv", CsvTracker, writes=("steps.csv",))
