"""--logger tensorboard: TensorBoard's SummaryWriter (the ``tensorboard`` extra)."""

from __future__ import annotations

from pathlib import Path

from paratrain.report.trackers.base import TrackerKind, flat


class TensorBoardTracker:
    """SummaryWriter scalars in <run>/tensorboard; the settings as text."""

    def __init__(self, run_dir: Path, settings: dict, ids: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        table = "\n".join(f"| {k} | {v} |" for k, v in flat(settings).items())
        self.writer.add_text("config", "| setting | value |\n|---|---|\n" + table, 0)

    def step(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def epoch(self, epoch: int, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, epoch)
        self.writer.flush()

    def finish(self, curves: Path | None, checkpoint: Path | None) -> None:
        if checkpoint is not None:
            self.writer.add_text("final_checkpoint", str(checkpoint), 0)

    def close(self, failed: bool) -> None:
        self.writer.close()


TRACKER = TrackerKind(
    "tensorboard", TensorBoardTracker, package="tensorboard", extra="tensorboard",
    writes=("tensorboard",),
)  # fmt: skip
