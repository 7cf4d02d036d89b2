"""Checkpoints: typed and versioned, whole and atomic on disk, written by the
Checkpointer, read back by resume().

A checkpoint (:class:`Checkpoint`) is made of parts, each with its own state dict
(torch.distributed.checkpoint's ``Stateful`` shape, torchtitan's CheckpointManager): the
unwrapped model, the optimizer (in the single-device layout every strategy shares), the
EMA weights, the grad scaler, where training stands (:class:`Progress`), every rank's RNG
states, the classes and the resolved config, with a format number. On disk it is a plain
dict of tensors and plain values, loaded with ``weights_only``; an older format is
migrated when read (:func:`migrate`), so a renamed setting never breaks an older file.
Written to a temporary file, flushed, fsynced and renamed, so a reader sees the old
file or the new one. Sharded strategies write each rank's shards through
torch.distributed.checkpoint instead (engine/checkpointing/sharded.py), with the rest in ``state.pt``.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from paratrain.config import TrainConfig
from paratrain.config.schema import settings
from paratrain.config.train import migrate_settings
from paratrain.distributed import comm
from paratrain.distributed.runtime import Runtime
from paratrain.engine.checkpointing import sharded
from paratrain.engine.checkpointing.run_dir import LAST, run_dir_of
from paratrain.engine.run import faults
from paratrain.engine.run.preempt import interrupts_deferred
from paratrain.engine.run.recipe import Recipe
from paratrain.engine.run.schedule import Schedule, base_lr, peak_lr
from paratrain.engine.run.state import Progress, gathered_rng_states, restore_rng
from paratrain.errors import AgreedUserError, UserError
from paratrain.files import fsync, replaced
from paratrain.log import get_logger, since_start
from paratrain.parallel.parts import ModelParts

FORMAT = 2  # 1: paratrain 0.1's flat dict (no "format" key); 2: typed parts


@dataclass
class Checkpoint:
    """Everything a checkpoint holds. ``model`` is empty and ``optimizer`` None in a
    sharded checkpoint's ``state.pt`` (they are in the shards), and ``optimizer`` None
    in a file of weights only."""

    model: dict[str, torch.Tensor]
    config: dict[str, Any]
    classes: list[str]
    progress: Progress = field(default_factory=Progress)
    optimizer: dict[str, Any] | None = None
    ema: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None
    rng: list[dict[str, Any]] = field(default_factory=list)
    replicas: int = 1  # data-parallel ranks: what the global batch was a multiple of
    processes: int = 1
    strategy: str = "ddp"
    layout: dict[str, int] = field(default_factory=dict)  # parallel/base.Layout, as run
    lr: float | None = None
    val_top1: float | None = None
    schedule: dict[str, Any] | None = None  # for a reader: the rate is derived, not saved
    sharded: bool = False
    optimizer_groups: list[dict[str, Any]] | None = None  # sharded: groups by name
    format: int = FORMAT

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint as saved: tensors and plain values only."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["progress"] = self.progress.state_dict()
        return values

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "checkpoint") -> Checkpoint:
        """A checkpoint of any format, migrated to this one."""
        values = migrate(raw, source)
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in values.items() if k in known}
        values["progress"] = Progress.of(values.get("progress") or {})
        return cls(**values)

    def train_config(self, source: str = "checkpoint") -> TrainConfig:
        """The run's settings as this paratrain reads them."""
        return TrainConfig.from_dict(self.config, source=source)

    def weights(self, path: str | Path, ema: bool = False) -> dict[str, torch.Tensor]:
        """The raw weights, or with ``ema`` the moving-average weights."""
        if not ema:
            return self.model
        if not self.ema:
            raise UserError(f"--ema: {path} holds no EMA weights (train with --ema-decay)")
        averaged: dict[str, torch.Tensor] = self.ema["model"]
        return averaged


def migrate(raw: dict[str, Any], source: str = "checkpoint") -> dict[str, Any]:
    """A checkpoint's dict in this format, from any earlier one; its settings as this
    paratrain names them (config/train.migrate_settings)."""
    version = raw.get("format", 1)
    if not isinstance(version, int) or version > FORMAT:
        raise UserError(
            f"{source} is of checkpoint format {version}; this paratrain reads up to "
            f"{FORMAT} (a newer paratrain wrote it)"
        )
    values = dict(raw)
    if version == 1:  # where training stood was flat; the replica count was "world_size"
        progress: dict[str, Any] = {
            key: values.pop(key)
            for key in ("epoch", "step_in_epoch", "consumed", "global_step", "skipped_steps")
            if key in values
        }
        progress["best_top1"] = values.pop("best_top1", -1.0)
        progress["totals"] = values.pop("partial_totals", None)
        values["progress"] = progress
        values["replicas"] = values.pop("world_size", 1)
        values["format"] = 2
    values["config"] = migrate_settings(values.get("config") or {}, source, saved=True)
    return values


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """A reader sees the old file or the new one, never a torn one. A write that fails
    (a full disk, a file size limit) is one line; the old file stays as it was."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced(path) as handle:
            torch.save(state, handle)
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports write errors so
        cause = exc.__context__ if isinstance(exc.__context__, OSError) else exc
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)
        kept = "the previous one is unchanged" if path.exists() else "none was saved before"
        raise UserError(
            f"cannot write checkpoint {path}: {reason.strip().splitlines()[0][:200]} ({kept})"
        ) from None


def copy_atomic(state: dict[str, Any], written: Path, path: Path) -> None:
    """``path`` gets the checkpoint just written to ``written`` (the same ``state``): a hard
    link, renamed into place, instead of a second 90 MB write; a write where the file
    system has no hard links. A later replacement of ``written`` leaves ``path`` alone."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.link")
    try:
        tmp.unlink(missing_ok=True)
        os.link(written, tmp)  # the same inode: its bytes were fsynced when written
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        save_atomic(state, path)
        return
    fsync(path.parent)


def _read_file(path: Path) -> dict[str, Any]:
    """A checkpoint file as data: tensors and plain values only (``weights_only``), so a
    file from anywhere cannot run code. Anything else is one line naming the file."""
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


def load(path: str | Path, with_optimizer: bool = True) -> Checkpoint:
    """A whole checkpoint (a sharded folder consolidated in memory into the single-file
    layout), read as data and migrated to this format."""
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
        return Checkpoint.from_dict(sharded.consolidate(found, with_optimizer), str(path))
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}")
    return Checkpoint.from_dict(_read_file(path), str(path))


def read_for_resume(path: Path) -> Checkpoint:
    """What resuming checks first: a file whole, a sharded checkpoint's ``state.pt``
    alone (its tensors are read later, each rank its shards)."""
    folder = sharded.find(path) if path.is_dir() else None
    if folder is not None:
        return Checkpoint.from_dict(sharded.read_state(folder), str(path))
    return load(path)


def samples_per_step(cfg: TrainConfig, replicas: int) -> int:
    """The global batch: per-process batch x model replicas x accumulated micro-batches."""
    return cfg.batch * replicas * cfg.grad_accum


class Checkpointer:
    """Whole-state checkpoints: last.pt (every save), best.pt, the newest --keep epochs."""

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: Path,
        runtime: Runtime,
        parts: ModelParts,
        optimizer: torch.optim.Optimizer,
        schedule: Callable[[], Schedule],
        classes: list[str],
        recipe: Recipe,
    ):
        self.cfg, self.dir, self.runtime = cfg, run_dir / "checkpoints", runtime
        self.parts, self.optimizer, self.schedule = parts, optimizer, schedule
        self.classes, self.recipe = classes, recipe
        self.spent_before = 0.0  # the wall-clock earlier runs of a resumed one spent
        self.fault = faults.planned(runtime.rank)  # tests: a full disk at a chosen save

    def save(self, progress: Progress, val_top1: float | None = None) -> None:
        """A collective: every rank calls it. Sharded strategies write their shards each
        (folders last/, best/, epoch-NNNN/); the others hand rank 0 the whole state,
        which it writes as one file (last.pt, best.pt, epoch-NNNN.pt). Ctrl-C meanwhile
        takes effect once the checkpoint is written."""
        progress.seconds = self.spent_before + since_start()  # rank 0's is kept
        with interrupts_deferred():
            problem = None
            try:
                self._save(progress, val_top1)
            except (OSError, CheckpointException) as exc:  # a full disk, a quota, read-only
                reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0][:160]
                problem = (
                    f"could not write a checkpoint in {self.dir} ({reason}); the one written "
                    "before it is intact and --resume continues from it"
                )
            told = [p for p in comm.all_gather_object(problem) if p]
            if told:  # every rank stops alike, and the reason is told once
                raise AgreedUserError(told[0])

    def _save(self, progress: Progress, val_top1: float | None) -> None:
        rng = gathered_rng_states()
        if self.parts.collective_state:
            rest = self._checkpoint(progress, val_top1, rng, {})
            sharded.save(self.dir / "last", self.parts, self.optimizer, rest.to_dict())
            if self.runtime.is_main and val_top1 is not None:
                self._keep_copies(self.dir / "last", "", progress, val_top1, sharded.link_copy)
            return
        model = self.parts.state_dict() if self.runtime.is_main else {}
        optimizer = self.parts.optimizer_state_dict(self.optimizer) if self.runtime.is_main else {}
        if not self.runtime.is_main:
            return
        state = self._checkpoint(progress, val_top1, rng, model)
        state.optimizer = optimizer
        whole = state.to_dict()
        last = self.dir / LAST
        faults.disk_full(self.fault, progress.global_step, last)
        save_atomic(whole, last)
        if val_top1 is not None:
            self._keep_copies(
                last, ".pt", progress, val_top1, lambda src, dst: copy_atomic(whole, src, dst)
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

    def _checkpoint(
        self, progress: Progress, val_top1: float | None, rng: list, model: dict
    ) -> Checkpoint:
        """Every part of the checkpoint but the optimizer's (whole) state."""
        ema, scaler = self.recipe.ema, self.recipe.precision.scaler
        return Checkpoint(
            model=model,
            config=self.cfg.to_dict(),
            classes=self.classes,
            progress=progress,
            ema=ema.state_dict() if ema is not None else None,
            scaler=scaler.state_dict() if scaler is not None else None,
            rng=rng,
            replicas=self.parts.replicas,
            processes=self.runtime.world_size,
            strategy=self.cfg.strategy,
            layout=dataclasses.asdict(self.parts.layout),
            lr=base_lr(self.optimizer),
            val_top1=val_top1,
            schedule=dataclasses.asdict(self.schedule()),
        )


def prune_epochs(directory: Path, keep: int) -> None:
    """Keep the newest ``keep`` epoch-NNNN checkpoints (files or sharded folders); last
    and best are separate."""
    epochs = sorted(p for p in directory.glob("epoch-*") if p.suffix in (".pt", ""))
    for old in epochs[: max(0, len(epochs) - keep)]:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def check_resumable(
    state: Checkpoint, cfg: TrainConfig, classes: list[str], path: Path
) -> tuple[TrainConfig, list[str]]:
    """The checkpoint's config, and the settings that differ from it and take effect.
    What cannot continue is one line with every difference and what to do; which
    settings those are is each setting's own declaration (its rule's ``resume``)."""
    if state.optimizer is None and not state.sharded:
        raise UserError(
            f"cannot resume from {path}: it holds weights but no training state (no "
            f"'optimizer'; an exported file keeps the weights only) — start a new run from "
            f"its weights (--weights {path})"
        )
    saved = state.train_config(str(path))
    mid_epoch = state.progress.step_in_epoch > 0
    fixed, order, changed = [], [], []
    for s in settings(TrainConfig):
        old, new = getattr(saved, s.name), getattr(cfg, s.name)
        if old == new or s.rule.resume == "quiet":
            continue
        if s.rule.resume == "fixed":
            fixed.append(f"{s.flag} {new} but the checkpoint has {old} ({s.rule.resume_why})")
        elif s.rule.resume == "fixed_mid_epoch" and mid_epoch:
            order.append(
                f"{s.flag} {new} but the checkpoint's epoch is part done under {s.flag} {old} "
                "(the rest of the epoch follows that order)"
            )
        else:
            changed.append(f"{s.name} {_shown(old)} -> {_shown(new)}")
    if state.classes != classes:
        old_classes, new_classes = state.classes or [], classes
        fixed.append(
            f"the data's classes ({len(new_classes)}: {', '.join(new_classes[:4])}...) are not "
            f"the checkpoint's ({len(old_classes)}: {', '.join(old_classes[:4])}...)"
        )
    refused = fixed + order
    if refused:
        weights = f"--weights {path}"
        if Path(path).is_dir():  # a sharded checkpoint: one file of it first
            weights = f"paratrain export --checkpoint {path} --format pt, then --weights that file"
        raise UserError(
            f"cannot resume from {path}: " + "; ".join(refused) + " — resume with the "
            f"checkpoint's settings, or start a new run from its weights ({weights})"
        )
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
    state = read_for_resume(path) if in_shards else load(path)
    saved, changed = check_resumable(state, cfg, classes, path)
    if in_shards:  # each rank reads its own shards, resharded: nothing whole anywhere
        assert folder is not None and state.optimizer_groups is not None
        sharded.load_into(folder, parts, optimizer, state.optimizer_groups)
    else:
        try:
            parts.load_state_dict(state.model)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0]
            raise UserError(f"{path}: its weights do not fit this model ({first[:160]})") from None
        assert state.optimizer is not None
        parts.load_optimizer_state_dict(optimizer, state.optimizer)
    ema, scaler = recipe.ema, recipe.precision.scaler
    if scaler is not None and state.scaler:
        scaler.load_state_dict(state.scaler)
    if ema is not None:
        if state.ema:
            ema.load_state_dict(state.ema)
        else:
            log.warning(f"{path} holds no EMA weights: the average starts from the resumed ones")
    restore_rng(state.rng, runtime.rank)
    progress = state.progress
    same_steps = samples_per_step(saved, state.replicas) == samples_per_step(cfg, parts.replicas)
    if not same_steps:
        # the epoch goes on from the same sample of its order: nothing skipped or repeated
        progress.step_in_epoch = progress.consumed // samples_per_step(cfg, parts.replicas)
    if not (same_steps and runtime.is_main):  # rank 0 carries the epoch's sums so far
        progress.totals = torch.zeros(3, dtype=torch.float64)
    _continue_with(saved, state.replicas, cfg, parts.replicas, optimizer)
    where = f"epoch {progress.epoch + 1}" + (
        f", step {progress.step_in_epoch}" if progress.step_in_epoch else ""
    )
    log.info(f"resumed from {path} at {where}")
    if changed:
        log.info("settings changed since the checkpoint: " + ", ".join(changed))
    return progress


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)


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


__all__ = [
    "FORMAT",
    "Checkpoint",
    "Checkpointer",
    "check_resumable",
    "copy_atomic",
    "load",
    "migrate",
    "prune_epochs",
    "read_for_resume",
    "resume",
    "run_dir_of",
    "samples_per_step",
    "save_atomic",
]
