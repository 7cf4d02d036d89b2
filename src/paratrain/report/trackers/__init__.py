"""TRACKERS: an experiment tracker's name -> what it writes where. Nothing else lives here.

The tracker itself is ``paratrain.report.trackers.<name>.TRACKER`` (a :class:`~paratrain.
report.trackers.base.TrackerKind`: how to open it, the package and extra it needs, how
to reach its server, what it writes in the run folder), loaded by ``base.kind``. Adding
one is its module and one line here. Nothing here imports torch or a tracker's package,
so the command line reads these names for ``--logger`` at no cost.
"""

from __future__ import annotations

TRACKERS: dict[str, str] = {
    "tensorboard": "TensorBoard event files in <run>/tensorboard",
    "mlflow": "an MLflow run (MLFLOW_TRACKING_URI, else <output dir>/mlruns)",
    "wandb": "a W&B run in <run>/wandb (offline without an API key)",
    "csv": "per-step scalars in <run>/steps.csv",
    "jsonl": "every step's and epoch's scalars as JSON lines in <run>/trackers.jsonl",
}
