"""--logger wandb: a Weights & Biases run (the ``wandb`` extra)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

from paratrain.log import get_logger
from paratrain.report.trackers.base import TrackerKind, answers


class WandbTracker:
    """A W&B run in <run>/wandb, project WANDB_PROJECT or 'paratrain', named as the run.
    Offline (``wandb sync`` it later) when WANDB_MODE says so or no API key is set (no
    login prompt on a cluster's node); epoch scalars plotted against epoch."""

    def __init__(self, run_dir: Path, settings: dict, ids: dict):
        import wandb

        mode = os.environ.get("WANDB_MODE")
        if mode is None and not _wandb_key():
            mode = "offline"
            get_logger().info(f"W&B: no API key, logging offline to {run_dir / 'wandb'}")
        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "paratrain"),
            name=run_dir.name,
            dir=str(run_dir),
            config=settings,
            mode=cast(Any, mode),
            id=ids.get("wandb"),
            resume="allow",
            settings=wandb.Settings(silent=True),
        )
        ids["wandb"] = self.run.id
        self.run.define_metric("epoch")
        self.run.define_metric("epoch/*", step_metric="epoch")

    def step(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def epoch(self, epoch: int, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, "epoch": epoch}, step=step)

    def finish(self, curves: Path | None, checkpoint: Path | None) -> None:
        if curves is not None:
            self.run.log({"curves": self.wandb.Image(str(curves))})
        if checkpoint is not None:
            self.run.summary["final_checkpoint"] = str(checkpoint)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _wandb_key() -> bool:
    """An API key in the environment or in ~/.netrc (where `wandb login` puts it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def reach(timeout: float) -> str | None:
    """W&B's server answers, unless the run logs offline (nothing to reach)."""
    if os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun") or not _wandb_key():
        return None
    return answers(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"), timeout)


TRACKER = TrackerKind(
    "wandb", WandbTracker, package="wandb", extra="wandb", reach=reach,
    writes=("wandb", "trackers.json"),
)  # fmt: skip
