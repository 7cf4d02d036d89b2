"""TensorBoard scalars (``--tensorboard``), written by rank 0 into <run>/tensorboard.

Per step (rank 0's batches; on CUDA summed over the steps between two reads, so that
no step waits for the device): train/loss, train/acc, train/lr, train/images_per_s. Per
epoch: every number of the metrics row under epoch/ (losses, accuracies, lr, images/s,
EMA results when on).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class Board:
    """A SummaryWriter on rank 0 when enabled; every method is a no-op otherwise."""

    def __init__(self, run_dir: Path, enabled: bool, world_size: int):
        self.writer = None
        self.world_size = world_size
        self.last = time.perf_counter()
        self.pending: torch.Tensor | None = None  # (loss x n, correct, n) not yet written
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def start_epoch(self) -> None:
        """Restart the images/s clock at an epoch's first step."""
        self.last = time.perf_counter()

    def add(self, step: torch.Tensor, global_step: int, lr: float, every: int) -> None:
        """Count one step's (loss x n, correct, n), a tensor on the device; written (read
        back) every ``every`` steps."""
        self.pending = step if self.pending is None else self.pending + step
        if global_step % every:
            return
        loss, correct, n = self.pending.tolist()
        self.pending = None
        if n:
            self.step(global_step, loss / n, correct / n, lr, int(n))

    def step(self, global_step: int, loss: float, acc: float, lr: float, batch: int) -> None:
        """Write one step's scalars (rank 0's batch)."""
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        if self.writer is None:
            return
        self.writer.add_scalar("train/loss", loss, global_step)
        self.writer.add_scalar("train/acc", acc, global_step)  # this rank's batch
        self.writer.add_scalar("train/lr", lr, global_step)
        self.writer.add_scalar(
            "train/images_per_s", batch * self.world_size / max(seconds, 1e-9), global_step
        )

    def epoch(self, row: dict[str, Any]) -> None:
        """Write every number of an epoch's metrics row."""
        if self.writer is None:
            return
        for key, value in row.items():
            if key != "epoch" and isinstance(value, int | float) and value is not None:
                self.writer.add_scalar(f"epoch/{key}", value, row["epoch"])
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the writer."""
        if self.writer is not None:
            self.writer.close()

    def __enter__(self) -> Board:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
