"""`paratrain runs [DIR]`: one line per run directory, read from the files it left."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from paratrain.errors import UserError
from paratrain.report.metrics import judged

COLUMNS = ("run", "model", "data", "world", "best_top1", "epochs", "time", "status")


def collect(output_dir: str | Path) -> list[dict[str, Any]]:
    """Every run under ``output_dir`` (a folder with config.yaml), oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        raise UserError(f"no such run folder: {root}")
    rows = [_row(d) for d in root.iterdir() if (d / "config.yaml").is_file()]
    return sorted(rows, key=lambda r: (r["started"], r["run"]))


def _row(run: Path) -> dict[str, Any]:
    try:
        config = yaml.safe_load((run / "config.yaml").read_text()) or {}
    except yaml.YAMLError:
        config = {}
    epochs = []
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                epochs.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
    summary = {}
    if (run / "summary.json").is_file():
        summary = json.loads((run / "summary.json").read_text())
    planned = config.get("epochs")
    # the last epoch reached: a run resumed into a new folder starts its rows past 1
    done = max((r.get("epoch", 0) for r in epochs), default=0)
    if summary and done >= (planned or done):
        status = "done"
    elif done:
        status = f"stopped after epoch {done}"
    else:
        status = "no epoch finished"
    world = summary.get("world_size") or (epochs[-1].get("world_size") if epochs else None)
    suffix = judged(epochs)  # the EMA weights' where the run kept them
    tops = [r["val_top1" + suffix] for r in epochs if r.get("val_top1" + suffix) is not None]
    tops = tops or [  # several labels an image
        r["val_map" + suffix] for r in epochs if r.get("val_map" + suffix) is not None
    ]
    return {
        "run": run.name,
        "model": config.get("model"),
        "data": Path(config["data"]).name if config.get("data") else None,
        "world": world,
        "best_top1": max(tops) if tops else None,
        "epochs": f"{done}/{planned}" if planned else str(done),
        "seconds": summary.get("seconds") or sum(r.get("epoch_seconds", 0) for r in epochs),
        "status": status,
        "started": (run / "config.yaml").stat().st_mtime,
        "path": str(run),
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    """The table `paratrain runs` prints, one line per run."""

    def cell(row: dict[str, Any], key: str) -> str:
        value = row.get(key)
        if key == "best_top1":
            return f"{value:.2%}" if value is not None else "-"
        if key == "time":
            return _duration(row["seconds"])
        return "-" if value is None else str(value)

    table = [list(COLUMNS)] + [[cell(r, key) for key in COLUMNS] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(text.ljust(w) for text, w in zip(line, widths, strict=True)).rstrip()
        for line in table
    )


def _duration(seconds: float) -> str:
    seconds = int(round(seconds or 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
