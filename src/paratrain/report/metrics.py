"""Per-epoch metrics as JSON lines and CSV, written by rank 0."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from paratrain.errors import told_if_full
from paratrain.files import write_atomic
from paratrain.report.scores import SCORES

# metrics.csv's columns: every registered score of the validation (report/scores)
# among them; metrics.jsonl holds every key of the row
COLUMNS = [
    "epoch",
    "lr",
    "train_loss",
    "train_acc",
    # the first three as ever (scripts read them by position), then every other score
    *dict.fromkeys(["val_loss", "val_top1", "val_top5", *(f"val_{name}" for name in SCORES)]),
    "epoch_seconds",
    "train_images_per_s",
    "world_size",
    "val_loss_ema",
    "val_top1_ema",
    "val_map_ema",
]


class MetricsWriter:
    """Appends one row per epoch to metrics.jsonl and metrics.csv (resumable)."""

    def __init__(self, run_dir: Path):
        self.jsonl = run_dir / "metrics.jsonl"
        self.csv = run_dir / "metrics.csv"

    def drop_after(self, epoch: int) -> None:
        """On resume, forget rows of epochs that are about to be run again."""
        rows = [r for r in self.read() if r["epoch"] <= epoch]
        write_atomic(self.jsonl, "".join(json.dumps(r) + "\n" for r in rows))
        with self.csv.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)

    def read(self) -> list[dict[str, Any]]:
        """Every row written so far."""
        if not self.jsonl.exists():
            return []
        return [json.loads(line) for line in self.jsonl.read_text().splitlines() if line]

    def write(self, row: dict[str, Any]) -> None:
        """Append one epoch's row to both files."""
        with told_if_full(self.jsonl), self.jsonl.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        new = not self.csv.exists()
        with told_if_full(self.csv), self.csv.open("a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow(row)


def headline(row: dict[str, Any]) -> tuple[str, float | None]:
    """The validation score a row leads with, and its name: top-1, or mAP where the run
    has several labels an image (it has no top-1)."""
    if row.get("val_top1") is None and "val_map" in row:
        return "mAP", row["val_map"]
    return "top1", row.get("val_top1")


AVERAGED = "_ema"  # the suffix of the EMA weights' columns (val_top1_ema, ...)


def judged(rows: list[dict[str, Any]]) -> str:
    """The suffix of the columns a run is judged by (best.pt, its best top-1): "_ema"
    where it kept an average of the weights, else ""."""
    kept = any(r.get("val_top1_ema") is not None or r.get("val_map_ema") is not None
               for r in rows)  # fmt: skip
    return AVERAGED if kept else ""


def format_epoch(row: dict[str, Any], epochs: int) -> str:
    """The line an epoch ends with: rate, losses, accuracies, time and images/s."""
    name, value = headline(row)
    rest = f" top5 {row['val_top5']:.1%}" if row.get("val_top5") is not None else ""
    if row.get("val_threshold") is not None:  # several labels an image
        rest += f" micro-F1 {row['val_micro_f1']:.1%} at {row['val_threshold']:g}"
    if row.get("val_top1_ema") is not None:
        rest += f" (EMA top1 {row['val_top1_ema']:.1%})"
    shown = f"{value:.1%}" if value is not None else "-"
    return (
        f"epoch {row['epoch']}/{epochs}  lr {row['lr']:.4g}  "
        f"train loss {row['train_loss']:.4f} acc {row['train_acc']:.1%}  "
        f"val loss {row['val_loss']:.4f} {name} {shown}{rest}  "
        f"{row['epoch_seconds']:.1f}s  {row['train_images_per_s']:.0f} img/s"
    )
