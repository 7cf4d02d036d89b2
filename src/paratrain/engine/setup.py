"""setup(): a run's pieces, built once into a :class:`Run` (data, model and strategy,
optimizer, recipe, the end, checkpoints, step control), in the order each depends on
the one before; the loop (engine/trainer.py) reads everything from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from paratrain.config import TrainConfig
from paratrain.data.folder import DataSplit
from paratrain.data.label_sets import label_counts
from paratrain.data.loaders import Loaders, keep_sides, make_loaders, prepare_data, read_split
from paratrain.distributed import comm
from paratrain.distributed.runtime import Runtime, seed_everything
from paratrain.engine.checkpointing.checkpoint import (
    Checkpointer,
    Resumed,
    Stateful,
    resume,
    samples_per_step,
)
from paratrain.engine.checkpointing.run_dir import resolve_run
from paratrain.engine.end import End
from paratrain.engine.prerun import balance
from paratrain.engine.prerun.budget import Budget, choose_recipe, concrete, recipe_words
from paratrain.engine.prerun.describe import data_words, run_facts
from paratrain.engine.prerun.preflight import check_model_input
from paratrain.engine.prerun.task import decide_task
from paratrain.engine.run import precision as precision_module
from paratrain.engine.run.control import StepControl
from paratrain.engine.run.preempt import PreemptionGuard
from paratrain.engine.run.recipe import (
    Recipe,
    build_optimizer,
    build_recipe,
    continue_with,
    decide_ema,
)
from paratrain.engine.run.schedule import Schedule, build_schedule
from paratrain.engine.run.state import Best, Progress, RngStates
from paratrain.engine.run.step import Stepper
from paratrain.errors import AgreedUserError, UserError
from paratrain.log import get_logger
from paratrain.parallel.parallelize import build_parts, build_teacher
from paratrain.parallel.parts import ModelParts
from paratrain.report.loggers import Loggers, TrackerIds
from paratrain.report.metrics import MetricsWriter
from paratrain.report.run_files import announce, write_run_files


@dataclass
class Run:
    """A run's pieces, built once by :func:`setup`; the loop reads them from here."""

    cfg: TrainConfig  # frozen: nothing rewrites a setting once the run starts
    runtime: Runtime
    split: DataSplit
    run_dir: Path
    parts: ModelParts
    optimizer: torch.optim.Optimizer
    recipe: Recipe
    loaders: Loaders
    progress: Progress
    end: End
    saver: Checkpointer
    control: StepControl
    metrics: MetricsWriter
    loggers: Loggers
    stepper: Stepper
    first_step: float | None = None  # seconds from the command's start to its first step
    # the epoch just trained stopped before its end (--max-steps, --budget): its
    # checkpoint is a mid-epoch one, so a resumed run trains the rest of it
    cut_short: bool = False

    @property
    def schedule(self) -> Schedule:
        """The schedule as the end has planned it."""
        return self.end.schedule


def setup(cfg: TrainConfig, runtime: Runtime) -> Run:
    """Everything a run needs, in the order each piece depends on the one before."""
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    split = read_split(cfg, runtime)
    _agreed(check_model_input, cfg, runtime.world_size)  # before any file or image
    run_dir, resume_from = comm.agree(lambda: resolve_run(cfg))
    split = keep_sides(split, run_dir, resume_from is not None, runtime)
    intent, cfg = _budget_recipe(cfg, runtime, split, run_dir if resume_from else None)
    cache, split = prepare_data(cfg, split, runtime, run_dir)
    cfg = decide_task(cfg, split)  # --task auto: several labels an image or one
    cfg = balance.decide(cfg, split.train.labels, split.classes)  # --balance, --monitor auto
    parts = build_parts(cfg, len(split.classes), runtime)
    cfg = decide_ema(cfg, len(split.train), parts.replicas)  # --ema-decay auto
    optimizer = build_optimizer(parts, cfg, parts.replicas)
    counts = (  # each class's training images (several labels an image: from their sets)
        np.bincount(split.train.labels, minlength=len(split.classes))
        if split.label_sets is None
        else label_counts(split.train.labels, split.label_sets)
    )
    precision = precision_module.build(cfg, runtime)
    teacher = build_teacher(cfg, len(split.classes), runtime)  # --teacher
    recipe = build_recipe(cfg, parts, len(split.classes), precision, counts.tolist(), teacher,
                          split.label_sets)  # fmt: skip
    recipe.precision.prepare(parts)  # after the EMA copy: it averages the model as built
    seed_everything(cfg.seed + 1000 * runtime.rank)  # model randomness (dropout) differs per rank
    loaders = make_loaders(
        cfg, split, runtime, cache, parts.replica, parts.replicas, parts.fixed_batch
    )
    progress, best, ids = Progress(), Best(cfg.monitor), TrackerIds(run_dir, runtime.is_main)
    end = _end(cfg, parts, loaders)
    # the checkpoint's parts, each saving and loading itself; the RNG states last
    states: dict[str, Stateful] = {"progress": progress, "best": best, "recipe": recipe, "end": end,
              "loggers": ids, "rng": RngStates(runtime.rank)}  # fmt: skip
    if resume_from is not None:  # the same checkpoint and settings on every rank: told once
        resumed = _agreed(resume, resume_from, cfg, parts, optimizer, states, split.classes)
        _continue(resumed, resume_from, cfg, runtime, parts, optimizer, progress)
        end.budget_spent(progress.seconds)
    progress.totals = progress.totals.to(parts.output_device)  # summed where computed
    saver = Checkpointer(cfg, run_dir, runtime, parts, optimizer, states, best, split.classes)
    guard = PreemptionGuard(cfg.preempt_grace)
    sync_free = _sync_free(cfg, runtime, optimizer, recipe)
    control = StepControl(cfg, runtime, saver.save, guard, sync_free=sync_free)
    metrics = MetricsWriter(run_dir)
    if runtime.is_main and progress.epoch < cfg.epochs:
        write_run_files(intent, split, run_dir)  # the recipe by name: --config keeps it
        metrics.drop_after(progress.epoch)
        _announce(cfg, runtime, split, loaders, recipe, run_dir, resume_from)
    tracked = cfg.loggers if runtime.is_main else ()  # rank 0 alone reports
    loggers = Loggers(run_dir, tracked, cfg.to_dict(), runtime.world_size, cfg.tracker_timeout,
                      cfg.on_tracker_error, ids)  # fmt: skip
    stepper = Stepper(parts, optimizer, recipe, control)
    return Run(cfg, runtime, split, run_dir, parts, optimizer, recipe, loaders, progress, end,
               saver, control, metrics, loggers, stepper)  # fmt: skip


def _agreed(check, *args):
    """``check(*args)``; its UserError, the same on every rank, as an agreed one (told
    once, every rank stopping)."""
    try:
        return check(*args)
    except UserError as exc:
        raise AgreedUserError(str(exc)) from None


def _continue(
    resumed: Resumed,
    path: Path,
    cfg: TrainConfig,
    runtime: Runtime,
    parts: ModelParts,
    optimizer: torch.optim.Optimizer,
    progress: Progress,
) -> None:
    """A resumed run goes on exactly: its epoch from the same sample under another global
    batch, this run's momentum and decay; what changed is said."""
    saved_step = samples_per_step(resumed.saved, resumed.replicas)
    progress.continue_under(saved_step, samples_per_step(cfg, parts.replicas), runtime.is_main)
    continue_with(resumed.saved, resumed.replicas, cfg, parts.replicas, optimizer)
    step = f", step {progress.step_in_epoch}" if progress.step_in_epoch else ""
    get_logger().info(f"resumed from {path} at epoch {progress.epoch + 1}{step}")
    if resumed.changed:
        get_logger().info("settings changed since the checkpoint: " + ", ".join(resumed.changed))


def _end(cfg: TrainConfig, parts: ModelParts, loaders: Loaders) -> End:
    """The run's end: its schedule over this run's steps an epoch, --max-steps, and
    --budget's plan."""
    steps = -(-len(loaders.train) // cfg.grad_accum)
    budget = None
    if cfg.budget_seconds is not None:
        budget = Budget(cfg.budget_seconds, 0.0, steps, len(loaders.val))
    schedule = build_schedule(cfg, parts.replicas, steps)
    return End(schedule, cfg.max_steps or 0, budget, cfg.freeze_epochs or 0)


def _budget_recipe(
    cfg: TrainConfig, runtime: Runtime, split: DataSplit, resumed: Path | None
) -> tuple[TrainConfig, TrainConfig]:
    """(the recipe by name, as config.yaml records it; the settings it trains with):
    --budget-recipe auto decided (engine/prerun/budget.py), low-res made sizes and said."""
    intent = choose_recipe(cfg, runtime, split, resumed)
    cfg = concrete(intent)
    if cfg is not intent:
        try:
            check_model_input(cfg, runtime.world_size)
        except UserError as exc:
            raise AgreedUserError(f"--budget-recipe low-res: {exc}") from None
        get_logger().info(
            f"--budget-recipe low-res: {recipe_words(intent)} (--budget-recipe fixed keeps "
            "the sizes as given)"
        )
    return intent, cfg


def _announce(cfg, runtime, split, loaders, recipe, run_dir, resume_from) -> None:
    """The start lines (rank 0): how the run is laid out, what it reads, how it steps."""
    facts = run_facts(
        cfg,
        processes=f"{runtime.world_size} process(es) ({runtime.env.source})",
        world=runtime.world_size,
        cuda=runtime.device.type == "cuda",
        backend=runtime.backend,
        data=data_words(cfg, split)
        + f", {loaders.workers} loader worker(s); {loaders.feed.words()}",
        precision=recipe.precision.mode,
        cache=f"{loaders.cache.kind} ({loaders.cache.directory})"
        if loaders.cache is not None
        else "off (decoding every epoch)",
        resume=f"from {resume_from}" if resume_from is not None else "",
    )
    announce(run_dir, facts)


def _sync_free(cfg: TrainConfig, runtime: Runtime, optimizer, recipe: Recipe) -> bool:
    """On CUDA, steps read nothing back (see engine/run/control.py), except where skipping a
    non-finite step needs the flag on the host: a GradScaler, EMA weights, or an
    optimizer that is not fused (the model's parts say where fused kernels cannot run)."""
    if runtime.device.type != "cuda":
        return False
    if cfg.on_nonfinite == "abort":
        return True
    fused = all(group.get("fused") for group in optimizer.param_groups)
    return fused and recipe.precision.scaler is None and recipe.ema is None
