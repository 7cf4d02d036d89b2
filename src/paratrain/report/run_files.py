"""A run directory's own files (config.yaml, class_indices.json, summary.json), what the
run says when it starts and ends, and its progress bar. Rank 0 writes and speaks."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from paratrain.config import TrainConfig
from paratrain.data.folder import DataSplit
from paratrain.distributed import comm
from paratrain.distributed.runtime import Runtime
from paratrain.files import write_atomic
from paratrain.log import get_logger, since_start
from paratrain.report.metrics import MetricsWriter, headline, judged


def write_run_files(cfg: TrainConfig, split: DataSplit, run_dir: Path) -> None:
    """config.yaml (the resolved config, reusable with --config) and class_indices.json."""
    resolved = TrainConfig(**{**cfg.to_dict(), "name": run_dir.name})
    resolved.save(run_dir / "config.yaml")
    write_atomic(run_dir / "class_indices.json", json.dumps(split.class_index(), indent=2) + "\n")


@dataclass
class RunFacts:
    """What a run is: the lines `train --dry-run` prints under "would run:" and the run
    prints when it starts, made once (engine/prerun/describe.py) for both."""

    processes: str
    device: str
    data: str
    model: str
    global_batch: str
    schedule: str
    precision: str
    cache: str
    recipe: str = ""
    resume: str = ""
    chosen: list[str] = field(default_factory=list)
    warning: str = ""

    def lines(self) -> list[str]:
        rows = [
            ("processes", self.processes),
            ("device", self.device),
            ("data", self.data),
            ("model", self.model),
            ("global batch", self.global_batch),
            ("schedule", self.schedule),
            ("recipe", self.recipe),
            ("precision", self.precision),
            ("decoded-image cache", self.cache),
            ("resume", self.resume),
            *(("chosen", choice) for choice in self.chosen),
            ("warning", self.warning),
        ]
        return [f"  {name}: {value}" for name, value in rows if value]


def announce(run_dir: Path, facts: RunFacts) -> None:
    """What is about to run, as the dry run would have said it."""
    get_logger().info("\n".join([f"run {run_dir}:", *facts.lines()]))


def recipe_words(cfg: TrainConfig) -> str:
    """The recipe options that are on, in words (empty when none is)."""
    words = [
        f"label smoothing {cfg.label_smoothing:g}" if cfg.label_smoothing else "",
        f"mixup {cfg.mixup:g}" if cfg.mixup else "",
        f"cutmix {cfg.cutmix:g}" if cfg.cutmix else "",
        ema_words(cfg.ema_decay),
        f"{cfg.auto_augment}" if cfg.auto_augment != "none" else "",
        f"random erasing {cfg.random_erase:g}" if cfg.random_erase else "",
        f"repeated augmentation x{cfg.ra_reps}" if cfg.ra_reps > 1 else "",
        f"backbone frozen for {cfg.freeze_epochs} epoch(s)" if cfg.freeze_epochs else "",
        f"head lr x{cfg.head_lr_mult:g}" if cfg.head_lr_mult != 1 else "",
        f"layer-wise lr decay {cfg.layer_decay:g}" if cfg.layer_decay else "",
    ]
    return ", ".join(w for w in words if w)


def ema_words(decay: float | str | None) -> str:
    """--ema-decay in words: how many steps its average spans (empty when off)."""
    if decay == "auto":
        return "EMA of the weights (auto: over about two epochs' steps)"
    if not decay:
        return ""
    return f"EMA decay {float(decay):g} (an average over about {1 / (1 - float(decay)):.0f} steps)"


class EpochBar(tqdm):
    """The epoch's bar. While it is drawn, the run's log lines (the first step, a
    thawed backbone, a tracker's warning) are written above it through tqdm, not into
    the bar's own line on the terminal they share."""

    def __init__(self, *args: Any, **kwargs: Any):
        from tqdm.contrib.logging import logging_redirect_tqdm

        super().__init__(*args, **kwargs)
        self._redirect: Any = logging_redirect_tqdm(loggers=[get_logger()], tqdm_class=tqdm)
        self._redirect.__enter__()

    def close(self) -> None:
        super().close()
        redirect, self._redirect = getattr(self, "_redirect", None), None
        if redirect is not None:
            redirect.__exit__(None, None, None)


def progress_bar(runtime: Runtime, total: int, epoch: int, epochs: int) -> tqdm:
    """Rank 0's bar over the epoch's images, on a terminal only (elsewhere a bar that
    shows nothing: its calls do nothing)."""
    hidden = (
        not runtime.is_main or not sys.stdout.isatty() or bool(os.environ.get("PARATRAIN_NO_BAR"))
    )
    return EpochBar(total=total, desc=f"epoch {epoch + 1}/{epochs}", unit="img", leave=False,
                    disable=hidden)  # fmt: skip


def _parts(first_step: float | None, seconds: float) -> str:
    if first_step is None:
        return f" (training {seconds:.1f}s)"
    return f" (first step at {first_step:.1f}s, training {seconds:.1f}s)"


def summarise(
    cfg: TrainConfig,
    run_dir: Path,
    metrics: MetricsWriter,
    runtime: Runtime,
    seconds: float,
    skipped_steps: int,
    first_step: float | None = None,
) -> dict:
    """summary.json and the closing line; every rank returns rank 0's summary. "done
    in" is the command's own time so far (start-up included, as a user's clock counts
    it), with the time to the first step and the training's beside it."""
    wall = since_start()
    rows = metrics.read() if runtime.is_main else []
    summary = comm.broadcast_object(
        {
            "run_dir": str(run_dir),
            "model": cfg.model,
            "world_size": runtime.world_size,
            "epochs": rows[-1]["epoch"] if rows else 0,  # the last epoch reached
            **_best(rows, "top1"),
            **_best(rows, "map"),
            "final": rows[-1] if rows else None,
            "skipped_steps": skipped_steps,
            "seconds": seconds,  # the epochs' (training, evaluation, saving)
            "wall_s": wall,  # from the command's start
            "first_step_s": first_step,
        }
        if runtime.is_main
        else None
    )
    assert summary is not None  # rank 0's, on every rank
    if runtime.is_main:
        write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        name = headline(rows[-1])[0]  # top-1, or mAP with several labels an image
        key = "best_val_map" if name == "mAP" else "best_val_top1"
        best, raw = summary[key], summary.get(f"{key}_raw")
        shown = f"{best:.2%}" if best is not None else "-"
        if judged(rows):  # the average of the weights: best.pt is its, and so is the figure
            shown += (f" (the EMA weights: eval, predict and export them with --ema; the raw "
                      f"weights' best {raw:.2%})" if raw is not None else " (the EMA weights)")  # fmt: skip
        skipped = f", {skipped_steps} non-finite step(s) skipped" if skipped_steps else ""
        get_logger().info(  # an epoch ran (a run with none left ends in nothing_left)
            f"done in {wall:.1f}s{_parts(first_step, seconds)}: best val {name} {shown}"
            f"{skipped}, checkpoints in {run_dir / 'checkpoints'}"
        )
    return summary


def _best(rows: list[dict], score: str) -> dict:
    """``best_val_top1`` (None where no epoch has one), or ``best_val_map`` where the run
    has several labels an image: the best of the weights the run is judged by (the EMA
    weights where kept, their raw weights' beside it as ``..._raw``)."""
    suffix, key = judged(rows), f"val_{score}"
    found = [r[key + suffix] for r in rows if r.get(key + suffix) is not None]
    if score == "map" and not found:
        return {}
    best = {f"best_{key}": max(found, default=None)}
    raw = [r[key] for r in rows if r.get(key) is not None]
    if suffix and raw:
        best[f"best_{key}_raw"] = max(raw)
    return best


def nothing_left(
    cfg: TrainConfig, run_dir: Path, runtime: Runtime, reached: int, told: str | None = None
) -> dict:
    """A resumed run with nothing left to train (its checkpoint reached ``cfg.epochs``,
    or what ``told`` says): said, and the run's files left as they were (its summary
    returned, not rewritten)."""
    summary: dict | None = None
    if runtime.is_main:
        get_logger().info(
            told
            or f"{run_dir}: {reached} of {cfg.epochs} epoch(s) already trained, nothing left "
            f"to train (--epochs more than {reached} trains on)"
        )
        path = run_dir / "summary.json"
        summary = json.loads(path.read_text()) if path.is_file() else {"run_dir": str(run_dir)}
    agreed = comm.broadcast_object(summary)
    assert agreed is not None  # rank 0's, on every rank
    return agreed
