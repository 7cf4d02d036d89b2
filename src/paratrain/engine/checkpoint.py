"""Checkpoints: whole and atomic on disk, written by the Checkpointer, read back by
resume().

A checkpoint holds the unwrapped model, EMA weights, optimizer (in the single-device
layout every strategy shares), LR scheduler, grad scaler, where training stands, every
rank's RNG states, the classes and the resolved config. It is written to a temporary
file, flushed, fsynced and renamed, so a reader sees the old file or the new one.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from paratrain.config import TrainConfig
from paratrain.config.run_dirs import already_holds_a_run, claim_checkpoints, claim_new_name
from paratrain.distributed.runtime import Runtime
from paratrain.engine import sharded
from paratrain.engine.preempt import interrupts_deferred
from paratrain.engine.recipe import Recipe
from paratrain.engine.schedule import Schedule, peak_lr
from paratrain.engine.state import Progress, gathered_rng_states, restore_rng
from paratrain.errors import UserError
from paratrain.log import get_logger
from paratrain.parallel import ModelParts

LAST = "last.pt"
BEST = "best.pt"


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """A reader sees the old file or the new one, never a torn one. A write that fails
    (a full disk, a file size limit) is one line; the old file stays as it was."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise UserError(f"cannot write checkpoint {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports write errors so
        Path(tmp).unlink(missing_ok=True)
        cause = exc.__context__ if isinstance(exc.__context__, OSError) else exc
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
        kept = "the previous one is unchanged" if path.exists() else "none was saved before"
        raise UserError(
            f"cannot write checkpoint {path}: {reason.strip().splitlines()[0][:200]} ({kept})"
        ) from None
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


def load(path: str | Path, with_optimizer: bool = True) -> dict[str, Any]:
    """A checkpoint as a dict in the single-file layout (a sharded folder consolidated
    in memory), read as data: tensors and plain values only (``weights_only``), so a
    file from anywhere cannot run code. Anything else is one line naming the file."""
    path = Path(path)
    if path.is_dir():
        found = sharded.find(path)
        if found is None and (path / "checkpoints").is_dir():
            raise UserError(
                f"{path} is a run directory: name one of its checkpoints, e.g. "
                f"{path / 'checkpoints' / 'best.pt'}"
            )
        if found is None:
            raise UserError(f"{path} is a folder but not a sharded paratrain checkpoint")
        return sharded.consolidate(found, with_optimizer)
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise UserError(
            f"{path} holds objects other than tensors and plain values; paratrain reads "
            "checkpoints as data only, so it was not loaded (nothing in it ran)"
        ) from None
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"checkpoint {path} could not be read: {reason}") from None
    if not isinstance(state, dict) or "model" not in state:
        raise UserError(f"{path} is not a paratrain checkpoint (no 'model' entry)")
    lacking = [key for key in ("config", "classes") if key not in state]
    if lacking or not isinstance(state["config"], dict) or not isinstance(state["classes"], list):
        what = ", ".join(repr(key) for key in lacking) or "'config', 'classes' of the right type"
        raise UserError(
            f"{path} is not a paratrain checkpoint (no {what}): weights saved elsewhere go "
            f"to `paratrain train --weights {path}`, which loads what matches by name and shape"
        )
    return state


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
    single = run / "checkpoints" / LAST
    candidates = [single] if single.is_file() else []
    folder = sharded.find(run / "checkpoints" / "last")
    candidates += [folder] if folder is not None else []
    return max(candidates, key=lambda c: c.stat().st_mtime) if candidates else None


def resume_target(resume: str) -> Path:
    """``--resume PATH``: a checkpoint file, a sharded checkpoint's folder, or a run
    directory (its last checkpoint)."""
    path = Path(resume)
    if not path.exists():
        raise UserError(f"--resume: checkpoint not found: {path}")
    if path.is_dir() and sharded.find(path) is None and (path / "checkpoints").is_dir():
        last = last_of_run(path)
        if last is None:
            raise UserError(f"--resume: {path} is a run directory with no last checkpoint")
        return last
    return path


def prune_epochs(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` epoch-NNNN checkpoints (files or sharded folders); last
    and best are separate."""
    epochs = sorted(p for p in directory.glob("epoch-*") if p.suffix in (".pt", ""))
    for old in epochs[: max(0, len(epochs) - keep)]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def samples_per_step(cfg: TrainConfig, replicas: int) -> int:
    """The global batch: per-process batch x model replicas x accumulated micro-batches."""
    return cfg.batch_size * replicas * cfg.grad_accum


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
    if cfg.name:
        name = cfg.name
    elif resume_from is not None and run_dir_of(resume_from) is not None:
        name = run_dir_of(resume_from).name
    else:  # a timestamp; a run started in the same second gets the next free name
        name = claim_new_name(output)
    run_dir = output / name
    claim_checkpoints(run_dir, new_run=fresh)  # one step: two new runs cannot share it
    return run_dir, resume_from


class Checkpointer:
    """Whole-state checkpoints: last.pt (every save), best.pt, the newest --keep epochs."""

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: Path,
        runtime: Runtime,
        parts: ModelParts,
        optimizer: torch.optim.Optimizer,
        schedule: Schedule,
        classes: list[str],
        recipe: Recipe,
    ):
        self.cfg, self.dir, self.runtime = cfg, run_dir / "checkpoints", runtime
        self.parts, self.optimizer, self.schedule = parts, optimizer, schedule
        self.classes, self.recipe = classes, recipe

    def save(self, progress: Progress, val_top1: float | None = None) -> None:
        """A collective: every rank calls it. Sharded strategies (fsdp, pipeline) write
        their shards each (folders last/, best/, epoch-NNNN/); the others hand rank 0
        the whole state, which it writes as one file (last.pt, best.pt, epoch-NNNN.pt).
        Ctrl-C meanwhile takes effect once the checkpoint is written."""
        with interrupts_deferred():
            self._save(progress, val_top1)

    def _save(self, progress: Progress, val_top1: float | None) -> None:
        rng = gathered_rng_states()
        rest = self._rest(progress, val_top1, rng)
        if self.parts.collective_state:
            sharded.save(self.dir / "last", self.parts, self.optimizer, rest)
            if self.runtime.is_main and val_top1 is not None:
                self._keep_copies(self.dir / "last", "", progress, val_top1, sharded.link_copy)
            return
        if self.runtime.is_main:
            model = self.parts.state_dict()
            optimizer = self.parts.optimizer_state_dict(self.optimizer)
        if not self.runtime.is_main:
            return
        state = {"model": model, "optimizer": optimizer, **rest}
        last = self.dir / LAST
        save_atomic(state, last)
        if val_top1 is not None:
            self._keep_copies(
                last, ".pt", progress, val_top1, lambda src, dst: copy_atomic(state, src, dst)
            )

    def _keep_copies(
        self, last: Path, suffix: str, progress: Progress, val_top1: float, copy
    ) -> None:
        """best (by validation top-1) and the newest --keep epochs, as copies of last."""
        if val_top1 >= progress.best_top1:
            copy(last, self.dir / f"best{suffix}")
        if self.cfg.keep:
            copy(last, self.dir / f"epoch-{progress.epoch:04d}{suffix}")
            prune_epochs(self.dir, self.cfg.keep)

    def _rest(self, progress: Progress, val_top1: float | None, rng: list) -> dict[str, Any]:
        """Everything a checkpoint holds besides the model's and optimizer's tensors."""
        ema, scaler = self.recipe.ema, self.recipe.precision.scaler
        return {
            "ema": ema.state_dict() if ema is not None else None,
            "schedule": dataclasses.asdict(self.schedule),  # for a reader: it is derived
            "scaler": scaler.state_dict() if scaler is not None else None,
            "epoch": progress.epoch,
            "step_in_epoch": progress.step_in_epoch,
            "consumed": progress.consumed,
            "global_step": progress.global_step,
            "skipped_steps": progress.skipped_steps,
            "partial_totals": progress.totals.detach().cpu().clone(),
            "best_top1": progress.best_top1,
            "val_top1": val_top1,
            "rng": rng,
            "classes": self.classes,
            "config": self.cfg.to_dict(),
            "world_size": self.parts.replicas,  # data-parallel copies: what the batch scales by
            "processes": self.runtime.world_size,
            "strategy": self.cfg.strategy,
            "lr": self.optimizer.param_groups[0]["lr"],
        }


# settings a checkpoint cannot continue under, and why
FIXED_ON_RESUME = {
    "model": "its weights belong to another architecture",
    "opt": "its optimizer state belongs to another optimizer",
    "freeze_backbone": "its optimizer state covers other parameters",
    "split_seed": "the train/val split would change",
    "val_fraction": "the train/val split would change",
}
# settings that take effect on resume without being worth a word
QUIET_ON_RESUME = {
    "data",
    "workers",
    "bad_images",
    "cache",
    "cache_max_gb",
    "cache_dir",
    "weights",
    "weights_strict",
    "nproc",
    "strategy",
    "devices",
    "stages",
    "microbatches",
    "schedule",
    "split_points",
    "backend",
    "device",
    "timeout",
    "max_restarts",
    "master_port",
    "keep",
    "save_every_steps",
    "requeue",
    "preempt_grace",
    "output_dir",
    "name",
    "resume",
    "tensorboard",
    "compile",
    "memory_format",
    "bucket_cap_mb",
    "grad_compression",
}


def check_resumable(
    state: dict, cfg: TrainConfig, classes: list[str], path: Path
) -> tuple[TrainConfig, list[str]]:
    """The checkpoint's config, and the settings that differ from it and take effect.
    What cannot continue is one line with every difference and what to do."""
    needed = ("epoch",) if state.get("sharded") else ("optimizer", "epoch")  # shards: apart
    lacking = [key for key in needed if key not in state]
    if lacking:
        raise UserError(
            f"cannot resume from {path}: it holds weights but no training state (no "
            f"{', '.join(repr(key) for key in lacking)}; an exported file keeps the weights "
            f"only) — start a new run from its weights (--weights {path})"
        )
    saved = TrainConfig.from_dict(state["config"], source=str(path))
    refused = []
    for key, why in FIXED_ON_RESUME.items():
        old, new = getattr(saved, key), getattr(cfg, key)
        if old != new:
            flag = "--" + key.replace("_", "-")
            refused.append(f"{flag} {new} but the checkpoint has {old} ({why})")
    if state.get("classes") != classes:
        old, new = state.get("classes") or [], classes
        refused.append(
            f"the data's classes ({len(new)}: {', '.join(new[:4])}...) are not the "
            f"checkpoint's ({len(old)}: {', '.join(old[:4])}...)"
        )
    for key in ("seed", "ra_reps") if state.get("step_in_epoch") else ():
        old, new = getattr(saved, key), getattr(cfg, key)
        if old != new:  # they make the epoch's order: its rest must follow the same one
            flag = "--" + key.replace("_", "-")
            refused.append(
                f"{flag} {new} but the checkpoint's epoch is part done under {flag} {old} "
                "(the rest of the epoch follows that order)"
            )
    if refused:
        weights = f"--weights {path}"
        if Path(path).is_dir():  # a sharded checkpoint: one file of it first
            weights = f"paratrain export --checkpoint {path} --format pt, then --weights that file"
        raise UserError(
            f"cannot resume from {path}: " + "; ".join(refused) + " — resume with the "
            f"checkpoint's settings, or start a new run from its weights ({weights})"
        )
    changed = [
        f"{key} {getattr(saved, key)} -> {getattr(cfg, key)}"
        for key in saved.to_dict()
        if key not in QUIET_ON_RESUME and getattr(saved, key) != getattr(cfg, key)
    ]
    return saved, changed


def resume(
    path: Path,
    cfg: TrainConfig,
    runtime: Runtime,
    parts: ModelParts,
    optimizer: torch.optim.Optimizer,
    recipe: Recipe,
    classes: list[str],
) -> Progress:
    """Put the run back where the checkpoint left it, under this run's settings where
    they may differ (batch, accumulation, world size, rates, epochs: handled exactly;
    the rest refused in check_resumable); returns where training stands."""
    log = get_logger()
    folder = sharded.find(path) if path.is_dir() else None
    in_shards = folder is not None and parts.collective_state
    state = sharded.read_state(folder) if in_shards else load(path)
    saved, changed = check_resumable(state, cfg, classes, path)
    if in_shards:  # each rank reads its own shards, resharded: nothing whole anywhere
        sharded.load_into(folder, parts, optimizer, state)
    else:
        try:
            parts.load_state_dict(state["model"])
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0]
            raise UserError(f"{path}: its weights do not fit this model ({first[:160]})") from None
    ema, scaler = recipe.ema, recipe.precision.scaler
    if scaler is not None and state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    if ema is not None:
        if state.get("ema"):
            ema.load_state_dict(state["ema"])
        else:
            log.warning(f"{path} holds no EMA weights: the average starts from the resumed ones")
    if not in_shards:
        parts.load_optimizer_state_dict(optimizer, state["optimizer"])
    restore_rng(state.get("rng"), runtime.rank)
    progress = Progress(
        epoch=state["epoch"],
        step_in_epoch=state.get("step_in_epoch", 0),
        consumed=state.get("consumed", 0),
        global_step=state.get("global_step", 0),
        skipped_steps=state.get("skipped_steps", 0),
        best_top1=state.get("best_top1", -1.0),
    )
    old_replicas = state.get("world_size", parts.replicas)
    _continue_with(saved, old_replicas, cfg, parts.replicas, optimizer)
    if samples_per_step(saved, old_replicas) != samples_per_step(cfg, parts.replicas):
        # the epoch goes on from the same sample of its order: nothing skipped or repeated
        progress.step_in_epoch = progress.consumed // samples_per_step(cfg, parts.replicas)
    elif state.get("partial_totals") is not None and runtime.is_main:
        progress.totals = state["partial_totals"]  # rank 0 carries the epoch's sums so far
    where = f"epoch {progress.epoch + 1}" + (
        f", step {progress.step_in_epoch}" if progress.step_in_epoch else ""
    )
    log.info(f"resumed from {path} at {where}")
    if changed:
        log.info("settings changed since the checkpoint: " + ", ".join(changed))
    return progress


def _continue_with(
    saved: TrainConfig, old_replicas: int, cfg: TrainConfig, replicas: int, optimizer
) -> None:
    """This run's momentum and weight decay in the loaded optimizer (the schedule's rate
    is set every step from where training stands); say what the rates became."""
    for group in optimizer.param_groups:
        if "momentum" in group:
            group["momentum"] = cfg.momentum
    _set_weight_decay(optimizer, cfg)
    new_lr, old_lr = peak_lr(cfg, replicas), peak_lr(saved, old_replicas)
    if old_replicas != replicas:
        get_logger().info(
            f"world size {old_replicas} -> {replicas}: global batch "
            f"{samples_per_step(saved, old_replicas)} -> {samples_per_step(cfg, replicas)}, "
            f"lr {old_lr:g} -> {new_lr:g}"
        )
    elif old_lr != new_lr:
        get_logger().info(f"peak lr {old_lr:g} -> {new_lr:g}")


def _set_weight_decay(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """Each group's decay as this run's settings give it (groups are named by kind)."""
    decay = {
        "decay": cfg.weight_decay,
        "norm": cfg.norm_weight_decay,
        "bias": cfg.bias_weight_decay,
    }
    for group in optimizer.param_groups:
        value = decay.get(group.get("kind", "decay"))
        group["weight_decay"] = cfg.weight_decay if value is None else value
