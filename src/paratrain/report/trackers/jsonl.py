"""--logger jsonl: every step's and epoch's scalars as JSON lines (no package needed),
for tools that read a run while it trains (``tail -f``, ``jq``, a notebook)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from paratrain.report.trackers.base import TrackerKind


class JsonLinesTracker:
    """<run>/trackers.jsonl: one object a line, ``{"kind": "step"|"epoch"|"finish",
    "time": unix seconds, "step": ..., ...scalars}``; the settings are the first line of a
    new run (a resumed run appends)."""

    def __init__(self, run_dir: Path, settings: dict, ids: dict):
        self.path = run_dir / "trackers.jsonl"
        if not self.path.exists():
            self._write({"kind": "settings", "settings": settings})

    def _write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps({**record, "time": round(time.time(), 3)}, default=str))
            handle.write("\n")

    def step(self, step: int, scalars: dict[str, float]) -> None:
        self._write({"kind": "step", "step": step, **scalars})

    def epoch(self, epoch: int, step: int, scalars: dict[str, float]) -> None:
        self._write({"kind": "epoch", "epoch": epoch, "step": step, **scalars})

    def finish(self, curves: Path | None, checkpoint: Path | None) -> None:
        self._write({"kind": "finish", "curves": curves, "checkpoint": checkpoint})

    def close(self, failed: bool) -> None:
        pass  # every line is written whole, and closed, as it comes


TRACKER = TrackerKind("jsonl", JsonLinesTracker, writes=("trackers.jsonl",))
