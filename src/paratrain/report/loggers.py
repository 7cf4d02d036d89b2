"""Experiment trackers (``--logger tensorboard,mlflow,wandb,csv,jsonl``), written by rank 0.

Every tracker receives the same things: the run's settings once, per step the scalars
of rank 0's batches (``train/loss``, ``train/acc``, ``train/lr``, ``train/images_per_s``;
on CUDA summed over the steps between two reads, so that no step waits for the device),
per epoch every number of the metrics row under ``epoch/``, and at the end the curves
image and the final checkpoint's path. Each tracker is a module of report/trackers/
(its registry: report/trackers/__init__.py); its package is an optional extra,
imported only when it is asked for. The ids of the MLflow and W&B runs are kept in
``<run>/trackers.json``, so a resumed run goes on logging into the same tracked run.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paratrain.errors import UserError
from paratrain.files import write_atomic
from paratrain.log import get_logger
from paratrain.report.trackers.base import Tracker, kind

if TYPE_CHECKING:
    import torch

IDS = "trackers.json"
# the trackers found unreachable before the launch under --on-tracker-error warn: the
# run's processes (which inherit it) leave them out rather than wait for them again
DOWN = "PARATRAIN_TRACKERS_DOWN"


class TrackerIds:
    """The ids of the tracked runs (MLflow's, W&B's), so that a resumed run logs on to
    the same ones: kept in the run folder (``trackers.json``) and in the checkpoint."""

    def __init__(self, run_dir: Path, read: bool = True):
        self.ids: dict[str, str] = _read_ids(run_dir) if read else {}

    def state_dict(self) -> dict[str, str]:
        return dict(self.ids)

    def load_state_dict(self, state: dict[str, str] | None) -> None:
        """The checkpoint's ids, where the run folder's file does not have them."""
        for name, value in (state or {}).items():
            self.ids.setdefault(name, value)


class Loggers:
    """The trackers asked for, on rank 0 (none elsewhere): one call reaches each."""

    def __init__(
        self,
        run_dir: Path,
        names: tuple[str, ...],
        settings: dict,
        world_size: int,
        timeout: float = 5.0,
        on_error: str = "fail",
        tracker_ids: TrackerIds | None = None,
    ):
        self.world_size = world_size
        self.last = time.perf_counter()
        self.pending: torch.Tensor | None = None  # (loss x n, correct, n) not yet written
        self.trackers: list[Tracker] = []
        # ranks without trackers read nothing
        ids = (tracker_ids or TrackerIds(run_dir, read=bool(names))).ids if names else {}
        down = set(os.environ.get(DOWN, "").split(","))  # told before the launch
        if names:
            bound_requests(timeout)
        for name in (n for n in names if n not in down):
            try:
                self.trackers.append(_Guarded(name, kind(name).open(run_dir, settings, ids)))
            except Exception as exc:  # a server, a store, a package: whatever it raised
                told = f"--logger {name} cannot start: {cause(exc)}"
                if on_error == "fail":
                    raise UserError(f"{told} (--on-tracker-error warn trains without it)") from None
                get_logger().warning(f"{told}; training without it (--on-tracker-error warn)")
        if ids:
            write_atomic(run_dir / IDS, json.dumps(ids, indent=2) + "\n")

    @property
    def active(self) -> bool:
        return bool(self.trackers)

    def start_epoch(self) -> None:
        """Restart the images/s clock at an epoch's first step."""
        self.last = time.perf_counter()

    def add(self, step: torch.Tensor, global_step: int, lr: float, every: int) -> None:
        """Count one step's (loss x n, correct, n), a tensor on the device; written (read
        back) every ``every`` steps; nothing without a tracker (nothing read back)."""
        if not self.trackers:
            return
        self.pending = step if self.pending is None else self.pending + step
        if global_step % every:
            return
        loss, correct, n = self.pending.tolist()
        self.pending = None
        if n:
            self.step(global_step, loss / n, correct / n, lr, int(n))

    def step(self, global_step: int, loss: float, acc: float, lr: float, batch: int) -> None:
        """One step's scalars (rank 0's batch)."""
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        scalars = {
            "train/loss": loss,
            "train/acc": acc,  # this rank's batch
            "train/lr": lr,
            "train/images_per_s": batch * self.world_size / max(seconds, 1e-9),
        }
        for tracker in self.trackers:
            tracker.step(global_step, scalars)

    def epoch(self, row: dict[str, Any], global_step: int) -> None:
        """Every number of an epoch's metrics row, under epoch/."""
        scalars = {
            f"epoch/{key}": float(value)
            for key, value in row.items()
            if key != "epoch" and isinstance(value, int | float) and not isinstance(value, bool)
        }
        for tracker in self.trackers:
            tracker.epoch(row["epoch"], global_step, scalars)

    def finish(self, curves: Path | None, checkpoint: Path | None) -> None:
        """The run ended as planned: its curves and where its final checkpoint is."""
        for tracker in self.trackers:
            tracker.finish(curves if curves is not None and curves.exists() else None, checkpoint)

    def close(self, failed: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(failed)

    def __enter__(self) -> Loggers:
        return self

    def __exit__(self, kind, *exc) -> None:
        self.close(failed=kind is not None)


class _Guarded:
    """A tracker that never stops training: its first failure is told once (the
    metrics still go to metrics.jsonl), and it is not called again."""

    def __init__(self, name: str, tracker: Tracker):
        self.name, self.tracker, self.failed = name, tracker, False

    def _call(self, what: str, *args: Any) -> None:
        if self.failed:
            return
        try:
            getattr(self.tracker, what)(*args)
        except Exception as exc:
            self.failed = True
            get_logger().warning(
                f"--logger {self.name} failed ({cause(exc)}); training goes on without it, "
                "its metrics are still in metrics.jsonl"
            )

    def step(self, step: int, scalars: dict[str, float]) -> None:
        self._call("step", step, scalars)

    def epoch(self, epoch: int, step: int, scalars: dict[str, float]) -> None:
        self._call("epoch", epoch, step, scalars)

    def finish(self, curves: Path | None, checkpoint: Path | None) -> None:
        self._call("finish", curves, checkpoint)

    def close(self, failed: bool) -> None:
        self._call("close", failed)


def cause(exc: BaseException) -> str:
    """An exception's first line, short (a tracker's chained tracebacks run to pages)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def bound_requests(timeout: float) -> None:
    """MLflow's HTTP calls bounded by ``timeout`` and not retried (its defaults: 120 s a
    request, 7 retries with backoff: minutes of a stalled run for a dead server); a
    user's own MLFLOW_HTTP_REQUEST_* settings are kept."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, math.ceil(timeout))))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")


def unreachable(names: tuple[str, ...], timeout: float) -> dict[str, str]:
    """Each tracker of ``names`` whose server does not answer within ``timeout``
    seconds -> why (trackers that write local files answer always)."""
    found = {}
    for name in names:
        reach = kind(name).reach
        why = reach(timeout) if reach is not None else None
        if why:
            found[name] = why
    return found


def _read_ids(run_dir: Path) -> dict[str, str]:
    try:
        return json.loads((run_dir / IDS).read_text())
    except (OSError, ValueError):
        return {}
