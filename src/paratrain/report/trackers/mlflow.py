"""--logger mlflow: an MLflow run (the ``mlflow`` extra, mlflow-skinny)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from paratrain.log import get_logger
from paratrain.report.trackers.base import TrackerKind, answers, flat


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

        params = [Param(k, v[:6000]) for k, v in flat(settings).items()]
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


def reach(timeout: float) -> str | None:
    """A tracking server over HTTP answers its health check (a file store or a
    database is opened by the run itself)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri.startswith(("http://", "https://")):
        return answers(uri.rstrip("/") + "/health", timeout)
    return None


TRACKER = TrackerKind(
    "mlflow", MlflowTracker, package="mlflow", extra="mlflow", reach=reach,
    writes=("trackers.json",),
)  # fmt: skip
