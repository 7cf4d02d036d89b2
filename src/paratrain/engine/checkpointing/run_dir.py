"""The run directory: which one a run writes into, which checkpoint it continues from.

A run folder is claimed in one step (config/run_dirs.py), so runs started together never
share one; an existing run is continued (--resume) or left alone, never overwritten.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from paratrain.config import TrainConfig
from paratrain.config.run_dirs import already_holds_a_run, claim_checkpoints, claim_new_name
from paratrain.errors import UserError
from paratrain.files import try_lock
from paratrain.report.trackers import TRACKERS
from paratrain.report.trackers.base import kind as tracker_kind

if TYPE_CHECKING:
    from filelock import BaseFileLock

LAST = "last.pt"
LOCK = ".paratrain.lock"  # held (flock) by the process whose run is in the folder
_held: dict[Path, BaseFileLock] = {}  # run folders this process holds, and their locks
BEST = "best.pt"


def run_dir_of(path: str | Path) -> Path | None:
    """The run directory of a checkpoint saved by training (<run>/checkpoints/x.pt)."""
    path = Path(path)
    return path.parent.parent if path.parent.name == "checkpoints" else None


def find_resumable(output_dir: Path, name: str | None) -> Path | None:
    """``--resume auto``: the last checkpoint (last.pt, or a sharded last/) of the named
    run, else of the newest run that has one."""
    runs = [output_dir / name] if name else [p for p in output_dir.glob("*") if p.is_dir()]
    found = [(c.stat().st_mtime, c) for c in map(last_of_run, runs) if c is not None]
    return max(found)[1] if found else None


def last_of_run(run: Path) -> Path | None:
    """The newer of a run directory's last.pt and sharded last/ (None: it has neither)."""
    from paratrain.parallel import sharded  # torch's checkpoint package: when asked

    single = run / "checkpoints" / LAST
    candidates = [single] if single.is_file() else []
    folder = sharded.find(run / "checkpoints" / "last")
    candidates += [folder] if folder is not None else []
    return max(candidates, key=lambda c: c.stat().st_mtime) if candidates else None


def resume_target(resume: str) -> Path:
    """``--resume PATH``: a checkpoint file, a sharded checkpoint's folder, or a run
    directory (its last checkpoint)."""
    from paratrain.parallel import sharded

    path = Path(resume)
    if not path.exists():
        raise UserError(f"--resume: checkpoint not found: {path}")
    if path.is_dir() and sharded.find(path) is None and (path / "checkpoints").is_dir():
        last = last_of_run(path)
        if last is None:
            raise UserError(f"--resume: {path} is a run directory with no last checkpoint")
        return last
    return path


def holds_a_run(run_dir: Path) -> bool:
    """Whether a run already wrote into ``run_dir``."""
    return (run_dir / "config.yaml").exists() or any((run_dir / "checkpoints").glob("*.pt"))


def check_run_dir_free(cfg: TrainConfig) -> None:
    """A named run that exists is continued (--resume) or left alone (another --name):
    never overwritten."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    if cfg.name and cfg.resume is None and not restarted:
        run_dir = Path(cfg.output_dir) / cfg.name
        if holds_a_run(run_dir):
            raise already_holds_a_run(run_dir)


def resolve_run(cfg: TrainConfig) -> tuple[Path, Path | None]:
    """The run directory and the checkpoint to resume from (None: a fresh start). Rank 0
    decides (see comm.agree); an existing run is never overwritten."""
    output = Path(cfg.output_dir)
    resume = cfg.resume
    if resume is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        resume = "auto"  # a restarted worker continues from the last checkpoint
    check_run_dir_free(cfg)
    resume_from: Path | None = None
    if resume == "auto":
        resume_from = find_resumable(output, cfg.name)
    elif resume:
        resume_from = resume_target(resume)
    fresh = resume_from is None and resume is None
    found = run_dir_of(resume_from) if resume_from is not None else None
    if cfg.name:
        name = cfg.name
    elif found is not None:
        name = found.name
    else:  # a timestamp; a run started in the same second gets the next free name
        name = claim_new_name(output)
    run_dir = output / name
    hold(run_dir)  # before anything is written: a run still going keeps its folder
    claim_checkpoints(run_dir, new_run=fresh)  # one step: two new runs cannot share it
    return run_dir, resume_from


def hold(run_dir: Path) -> None:
    """The run folder held by this process (rank 0) while it lives: its lock file taken
    (files.try_lock: an flock the kernel lets go when the process ends, however it ends,
    so a killed run never leaves its folder locked; a lock file where the file system has
    no flock). Another process asking for it is refused in one line naming the holder's
    host and pid."""
    run_dir = run_dir.resolve()
    if run_dir in _held:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = try_lock(run_dir / LOCK)
    if lock is None:
        raise UserError(
            f"{run_dir} is in use by a run still going ({_holder(run_dir / LOCK)}): wait "
            "for it to end, or give another --name"
        )
    _tell_holder(run_dir / LOCK)
    _held[run_dir] = lock


HOLDER = "host "  # how the holder's line starts in an flock's (otherwise empty) lock file


def _tell_holder(path: Path) -> None:
    """This process named in its flock's lock file. A lock file that stands in for an
    flock already names its holder in filelock's own record: that one is left alone."""
    try:
        text = path.read_bytes()
    except OSError:
        return
    if text and not text.startswith(HOLDER.encode()):
        return
    path.write_text(f"{HOLDER}{socket.gethostname()}, pid {os.getpid()}\n")


def _holder(path: Path) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        text = ""
    return text if text.startswith(HOLDER) else "another process"


# what a run writes before its first step (metrics: the CSV's header, an empty JSONL)
STARTED_FILES = {
    LOCK,
    "config.yaml",
    "class_indices.json",
    "split.npz",
    "checkpoints",
    "metrics.csv",
    "metrics.jsonl",
    # --logger's trackers, opened before the first step: what each says it writes
    *(entry for name in TRACKERS for entry in tracker_kind(name).writes),
}


def release_all() -> None:
    """Let go of every run folder this process holds (its run is over). A folder in
    which nothing was trained (no checkpoint, no metrics: a run that failed or was
    stopped before its first save) is removed, so it does not block its --name."""
    import shutil

    while _held:
        run_dir, lock = _held.popitem()
        checkpoints, metrics = run_dir / "checkpoints", run_dir / "metrics.jsonl"
        empty = checkpoints.is_dir() and not any(checkpoints.iterdir())
        no_epoch = not metrics.exists() or metrics.stat().st_size == 0
        if empty and no_epoch and {p.name for p in run_dir.iterdir()} <= STARTED_FILES:
            shutil.rmtree(run_dir, ignore_errors=True)  # still held: nobody takes it meanwhile
        try:
            lock.release()
        except OSError:  # a lock file that went with its folder
            pass
