"""Checkpoints: typed and versioned, made of parts that save and load themselves, written
by the Checkpointer through the strategy's own I/O, read back by resume().

A checkpoint (:class:`Checkpoint`) holds the unwrapped model and the optimizer (in the
single-device layout every strategy shares), written and read by the model's
``checkpoint_io.io_for`` (parallel/checkpoint_io.py: one whole file, or each rank's shards),
and the run's other parts, each a ``Stateful`` (torch.distributed.checkpoint's shape,
as torchtitan's CheckpointManager keeps them): where training stands, the best score and
its monitor, the recipe's EMA weights and grad scaler, the schedule and the budget,
the trackers' run ids, every rank's RNG states. This module imports none of them: the
run hands it a dict of parts by name, and a new part is one more entry there. On disk a
checkpoint is a plain dict of tensors and plain values, loaded with ``weights_only``; an
older format is migrated when read (:func:`migrate`), so a renamed setting never breaks
an older file.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.api import CheckpointException

from paratrain.config import TrainConfig
from paratrain.config.schema import settings
from paratrain.config.train import migrate_settings
from paratrain.distributed import comm
from paratrain.distributed.runtime import Runtime
from paratrain.engine.checkpointing.run_dir import run_dir_of
from paratrain.engine.run import faults
from paratrain.engine.run.preempt import interrupts_deferred
from paratrain.errors import AgreedUserError, UserError
from paratrain.log import get_logger
from paratrain.parallel import sharded
from paratrain.parallel.checkpoint_io import io_for
from paratrain.parallel.parts import ModelParts

# 1: paratrain 0.1's flat dict (no "format" key); 2: typed parts; 3: the run's parts by
# name under "parts", the best score with its monitor's name, the epoch's "score"
FORMAT = 3


class Stateful(Protocol):
    """A part of the checkpoint: it saves and loads itself (``None``: the checkpoint
    has no such part; the part keeps what it has)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class Ranked(Protocol):
    """What picks best.pt: ``offer(score)`` is whether it is the best so far."""

    def offer(self, score: float) -> bool: ...


class Fields(dict):
    """A part's state, read by key or by attribute."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass
class Checkpoint:
    """Everything a checkpoint holds. ``model`` is empty and ``optimizer`` None in a
    sharded checkpoint's ``state.pt`` (they are in the shards), and ``optimizer`` None
    in a file of weights only; ``parts``: each run part's state by name."""

    model: dict[str, torch.Tensor]
    config: dict[str, Any]
    classes: list[str]
    optimizer: dict[str, Any] | None = None
    parts: dict[str, Any] = field(default_factory=dict)
    replicas: int = 1  # data-parallel ranks: what the global batch was a multiple of
    processes: int = 1
    strategy: str = "ddp"
    layout: dict[str, int] = field(default_factory=dict)  # parallel/base.Layout, as run
    lr: float | None = None
    score: float | None = None  # the --monitor score of the evaluation it follows
    sharded: bool = False
    optimizer_groups: list[dict[str, Any]] | None = None  # sharded: groups by name
    format: int = FORMAT

    def to_dict(self) -> dict[str, Any]:
        """The checkpoint as saved: tensors and plain values only."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "checkpoint") -> Checkpoint:
        """A checkpoint of any format, migrated to this one."""
        values = migrate(raw, source)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def part(self, name: str) -> dict[str, Any]:
        """A part's state (empty where the checkpoint has none)."""
        found = self.parts.get(name)
        return found if isinstance(found, dict) else {}

    @property
    def progress(self) -> Fields:
        """Where training stood (engine/run/state.Progress's state), read by key or by
        attribute (``.epoch``)."""
        return Fields(self.part("progress"))

    @property
    def best_score(self) -> float | None:
        return self.part("best").get("score")

    @property
    def monitor(self) -> str:
        """The --monitor the best score is by."""
        return str(self.part("best").get("monitor", self.config.get("monitor") or "top1"))

    @property
    def ema(self) -> dict[str, Any] | None:
        """The EMA weights' state, where the run kept them."""
        return self.part("recipe").get("ema")

    def train_config(self, source: str = "checkpoint") -> TrainConfig:
        """The run's settings as this paratrain reads them."""
        return TrainConfig.from_dict(self.config, source=source)

    def weights(self, path: str | Path, ema: bool = False) -> dict[str, torch.Tensor]:
        """The raw weights, or with ``ema`` the moving-average weights."""
        if not ema:
            return self.model
        if not self.ema:
            raise UserError(
                f"--ema: {path} holds no EMA weights (its run kept none: --ema-decay 0, or a "
                "strategy that keeps no average)"
            )
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
        version = 2
    if version == 2:  # the run's parts were fields; the best was top-1's (or --monitor's)
        progress = dict(values.pop("progress", None) or {})
        best = progress.pop("best_top1", None)
        monitor = (values.get("config") or {}).get("monitor") or "top1"
        values["parts"] = {
            "progress": progress,
            "best": {"score": best, "monitor": monitor} if best is not None else None,
            "recipe": {"ema": values.pop("ema", None), "scaler": values.pop("scaler", None)},
            "end": {"schedule": values.pop("schedule", None), "budget": None},
            "rng": values.pop("rng", None),
        }
        values["score"] = values.pop("val_top1", None)
        # what such a run trained with, before --balance and --monitor auto existed
        values["config"] = {"balance": "none", "monitor": monitor, **(values.get("config") or {})}
    values["format"] = FORMAT
    # a checkpoint from before --task trained one class an image
    config = {"task": "multiclass", **(values.get("config") or {})}
    values["config"] = migrate_settings(config, source, saved=True)
    return values


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


LATEST, BEST = "last", "best"


class Checkpointer:
    """Checkpoints of a run: last (every save), best (by the --monitor score), the newest
    --keep epochs; written by the model's own I/O (whole, or each rank's shards)."""

    def __init__(
        self,
        cfg: TrainConfig,
        run_dir: Path,
        runtime: Runtime,
        model: ModelParts,
        optimizer: torch.optim.Optimizer,
        states: dict[str, Stateful],
        best: Ranked,
        classes: list[str],
    ):
        self.cfg, self.dir, self.runtime = cfg, run_dir / "checkpoints", runtime
        self.model, self.optimizer, self.io = model, optimizer, io_for(model)
        self.states, self.best, self.classes = states, best, classes
        self.fault = faults.planned(runtime.rank)  # tests: a full disk at a chosen save

    def save(self, progress: Any, score: float | None = None, background: bool = False) -> None:
        """A collective: every rank calls it (``progress``: where training stands, its
        epoch and step; ``score``: the epoch's --monitor score, after an evaluation).
        Ctrl-C meanwhile takes effect once the checkpoint is written; a write that
        fails stops every rank alike, told once."""
        with interrupts_deferred():
            problem = None
            try:
                self._save(progress, score, background)
            except (OSError, CheckpointException) as exc:  # a full disk, a quota, read-only
                reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0][:160]
                problem = (
                    f"could not write a checkpoint in {self.dir} ({reason}); the one written "
                    "before it is intact and --resume continues from it"
                )
            told = [p for p in comm.all_gather_object(problem) if p]
            if told:  # every rank stops alike, and the reason is told once
                raise AgreedUserError(told[0])

    def finish(self, failing: bool = False) -> None:
        """A checkpoint still being written in the background (--async-save) written
        before the run ends; ``failing``: the run is ending on an error already, so a
        failed write is said rather than raised over it."""
        try:
            self.io.wait()
        except Exception as exc:
            if not failing:
                raise
            get_logger().error(f"the last checkpoint in {self.dir} was not written: {exc}")

    def _save(self, progress: Any, score: float | None, background: bool = False) -> None:
        best = score is not None and self.best.offer(score)  # every rank: the same score
        parts = {name: part.state_dict() for name, part in self.states.items()}  # collectives
        rest = Checkpoint(
            model={},
            config=self.cfg.to_dict(),
            classes=self.classes,
            parts=parts,
            replicas=self.model.replicas,
            processes=self.runtime.world_size,
            strategy=self.cfg.strategy,
            layout=dataclasses.asdict(self.model.layout),
            lr=_base_lr(self.optimizer),
            score=score,
        ).to_dict()  # the model and optimizer: the I/O's (a sharded one keeps them apart)
        last = self.io.path(self.dir, LATEST)
        fault = self.fault
        self.io.save(last, self.model, self.optimizer, rest,
                     lambda path: faults.disk_full(fault, progress.global_step, path),
                     background=background)  # fmt: skip
        if self.runtime.is_main and score is not None:
            if best:
                self.io.copy(last, self.io.path(self.dir, BEST))
            if self.cfg.keep:
                self.io.copy(last, self.io.path(self.dir, f"epoch-{progress.epoch:04d}"))
                prune_epochs(self.dir, self.cfg.keep)


def _base_lr(optimizer: torch.optim.Optimizer) -> float:
    """The schedule's rate when saved (a group's rate over its ``lr_scale``): for a reader."""
    group = optimizer.param_groups[0]
    return float(group["lr"]) / group.get("lr_scale", 1.0)


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
    mid_epoch = int(state.progress.get("step_in_epoch", 0)) > 0
    fixed, order, changed = [], [], []
    for s in settings(TrainConfig):
        old, new = getattr(saved, s.name), getattr(cfg, s.name)
        if old == new or s.rule.resume == "quiet" or new == "auto":
            continue  # auto: decided from the data at the run's start, and compared then
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


@dataclass(frozen=True)
class Resumed:
    """What a resumed run continues from: the checkpoint's settings and replica count,
    and the settings that changed since and take effect."""

    saved: TrainConfig
    replicas: int
    changed: list[str]


def resume(
    path: Path,
    cfg: TrainConfig,
    model: ModelParts,
    optimizer: torch.optim.Optimizer,
    states: dict[str, Stateful],
    classes: list[str],
) -> Resumed:
    """Put the model, the optimizer and every part back where the checkpoint left them,
    under this run's settings where they may differ (batch, accumulation, world size,
    rates, epochs: the caller continues exactly; the rest refused in check_resumable).
    The strategy's I/O reads the model and optimizer (each rank its shards, resharded,
    where both it and the checkpoint are sharded); each part loads its own state."""
    io = io_for(model)
    state = read_for_resume(path) if io.reads_shards(path) else load(path)
    saved, changed = check_resumable(state, cfg, classes, path)
    io.load_into(path, model, optimizer, state)
    for name, part in states.items():
        part.load_state_dict(state.parts.get(name))
    return Resumed(saved, state.replicas, changed)


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)


__all__ = [
    "FORMAT",
    "Checkpoint",
    "Checkpointer",
    "Resumed",
    "Stateful",
    "check_resumable",
    "load",
    "migrate",
    "prune_epochs",
    "read_for_resume",
    "resume",
    "run_dir_of",
    "samples_per_step",
]
