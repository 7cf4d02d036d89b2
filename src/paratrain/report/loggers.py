"""Experiment trackers (``--logger tensorboard,mlflow,wandb,csv``), written by rank 0.

Every tracker receives the same things: the run's settings once, per step the scalars
of rank 0's batches (``train/loss``, ``train/acc``, ``train/lr``, ``train/images_per_s``;
on CUDA summed over the steps between two reads, so that no step waits for the device),
per epoch every number of the metrics row under ``epoch/``, and at the end the curves
image and the final checkpoint's path. Each package is an optional extra, imported only
when its tracker is asked for. The ids of the MLflow and W&B runs are kept in
``<run>/trackers.json``, so a resumed run goes on logging into the same tracked run.
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

from paratrain.errors import UserError
from paratrain.log import get_logger

if TYPE_CHECKING:
    import torch

# the trackers --logger takes, and the package each needs
TRACKERS = {
    "tensorboard": "tensorboard",
    "mlflow": "mlflow",
    "wandb": "wandb",
    "csv": None,
}
IDS = "trackers.json"
# the trackers found unreachable before the launch under --on-tracker-error warn: the
# run's processes (which inherit it) leave them out rather than wait for them again
DOWN = "PARATRAIN_TRACKERS_DOWN"


class Tracker(Protocol):
    def step(self, step: int, scalars: dict[str, float]) -> None: ...

    def epoch(self, epoch: int, step: int, scalars: dict[str, float]) -> None: ...

    def finish(self, curves: Path | None, checkpoint: Path | None) -> None: ...

    def close(self, failed: bool) -> None: ...


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
    ):
        self.world_size = world_size
        self.last = time.perf_counter()
        self.pending: torch.Tensor | None = None  # (loss x n, correct, n) not yet written
        self.trackers: list[Tracker] = []
        ids = _read_ids(run_dir) if names else {}  # ranks without trackers read nothing
        down = set(os.environ.get(DOWN, "").split(","))  # told before the launch
        if names:
            bound_requests(timeout)
        for name in (n for n in names if n not in down):
            try:
                self.trackers.append(_Guarded(name, _OPEN[name](run_dir, settings, ids)))
            except Exception as exc:  # a server, a store, a package: whatever it raised
                told = f"--logger {name} cannot start: {cause(exc)}"
                if on_error == "fail":
                    raise UserError(f"{told} (--on-tracker-error warn trains without it)") from None
                get_logger().warning(f"{told}; training without it (--on-tracker-error warn)")
        if ids:
            (run_dir / IDS).write_text(json.dumps(ids, indent=2) + "\n")

    @property
    def active(self) -> bool:
        return bool(self.trackers)

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
        reach = _REACH.get(name)
        why = reach(timeout) if reach is not None else None
        if why:
            found[name] = why
    return found


def _answers(url: str, timeout: float) -> str | None:
    """None when ``url`` answers (any HTTP status), else why not."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # it answered, if not with 200
    except (OSError, ValueError) as exc:  # URLError, refused, timed out, a bad URL
        reason = getattr(exc, "reason", None) or exc
        return f"{url} did not answer within {timeout:g} s ({reason})"
    return None


def _reach_mlflow(timeout: float) -> str | None:
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith(("http://", "https://")):
        return _answers(uri.rstrip("/") + "/health", timeout)
    return None  # a file store or a database: opened by the run itself


def _reach_wandb(timeout: float) -> str | None:
    if os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun") or not _wandb_key():
        return None  # offline: nothing to reach
    return _answers(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"), timeout)


_REACH: dict[str, Callable[[float], str | None]] = {"mlflow": _reach_mlflow, "wandb": _reach_wandb}


def _read_ids(run_dir: Path) -> dict[str, str]:
    try:
        return json.loads((run_dir / IDS).read_text())
    except (OSError, ValueError):
        return {}


def _flat(settings: dict[str, Any]) -> dict[str, str]:
    """Settings as trackers' parameters take them: strings, None as empty."""
    return {k: "" if v is None else str(v) for k, v in settings.items()}


class TensorBoardTracker:
    """SummaryWriter scalars in <run>/tensorboard; the settings as text."""

    def __init__(self, run_dir: Path, settings: dict, ids: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        table = "\n".join(f"| {k} | {v} |" for k, v in _flat(settings).items())
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


class MlflowTracker:
    """An MLflow run in MLFLOW_TRACKING_URI when set (a server, a database), else in a
    local file store, <output dir>/mlruns; the experiment MLFLOW_EXPERIMENT_NAME or
    'paratrain'. Settings as parameters, scalars as metrics (epoch ones by epoch), the
    curves as an artifact, the final checkpoint's path as the tag final_checkpoint."""

    def __init__(self, run_dir: Path, settings: dict, ids: dict):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the one store the mlflow-skinny client writes without a server
            uri = (run_dir.parent / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):  # asked for (or the default): MLflow 3 wants it said
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(uri)
        if "mlflow" in ids:
            self.run_id = ids["mlflow"]
            self.client.update_run(self.run_id, status="RUNNING")
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "paratrain")
        found = self.client.get_experiment_by_name(name)
        experiment = found.experiment_id if found else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment, run_name=run_dir.name).info.run_id
        ids["mlflow"] = self.run_id
        from mlflow.entities import Param

        params = [Param(k, v[:6000]) for k, v in _flat(settings).items()]
        for start in range(0, len(params), 100):  # MLflow takes 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        get_logger().info(f"MLflow: run {self.run_id} in {uri}")

    def _metrics(self, scalars: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def step(self, step: int, scalars: dict[str, float]) -> None:
        self._metrics(scalars, step)

    def epoch(self, epoch: int, step: int, scalars: dict[str, float]) -> None:
        self._metrics(scalars, epoch)

    def finish(self, curves: Path | None, checkpoint: Path | None) -> None:
        if curves is not None:
            self.client.log_artifact(self.run_id, str(curves))
        if checkpoint is not None:
            self.client.set_tag(self.run_id, "final_checkpoint", str(checkpoint))

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


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


_OPEN: dict[str, Callable[[Path, dict, dict], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "csv": CsvTracker,
    "mlflow": MlflowTracker,
    "wandb": WandbTracker,
}
