"""Whole, atomic checkpoints: written to a temporary file, flushed, then renamed."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from paratrain.errors import UserError

LAST = "last.pt"
BEST = "best.pt"


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """A reader sees the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def copy_atomic(state: dict[str, Any], written: Path, path: Path) -> None:
    """``path`` gets the checkpoint just written to ``written`` (the same ``state``): a hard
    link, renamed into place, instead of a second 90 MB write; a write where the file
    system has no hard links. A later replacement of ``written`` leaves ``path`` alone."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.link")
    try:
        tmp.unlink(missing_ok=True)
        os.link(written, tmp)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        save_atomic(state, path)
        return
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise UserError(f"checkpoint {path} could not be read: {exc}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise UserError(f"{path} is not a paratrain checkpoint (no 'model' entry)")
    return state


def run_dir_of(path: str | Path) -> Path | None:
    """The run directory of a checkpoint saved by training (<run>/checkpoints/x.pt)."""
    path = Path(path)
    return path.parent.parent if path.parent.name == "checkpoints" else None


def find_resumable(output_dir: Path, name: str | None) -> Path | None:
    """``--resume auto``: last.pt of the named run, else of the newest run that has one."""
    if name:
        candidate = output_dir / name / "checkpoints" / LAST
        return candidate if candidate.is_file() else None
    found = sorted(
        output_dir.glob(f"*/checkpoints/{LAST}"), key=lambda p: p.stat().st_mtime, reverse=True
    )
    return found[0] if found else None


def prune_epochs(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` epoch-NNNN.pt files (last.pt and best.pt are separate)."""
    epochs = sorted(directory.glob("epoch-*.pt"))
    for old in epochs[: max(0, len(epochs) - keep)]:
        old.unlink(missing_ok=True)
