"""fit(): the outline of a training run; train_epoch() and train_step(): the loop.

``setup`` (engine/setup.py) builds a run's pieces once into a Run; the loop reads
everything from it and asks one end condition (engine/end.py) at every step and epoch
boundary. One optimizer step is ``engine/run/step.train_step``: an explicit inner loop
over its micro-batches, then the agreement on the step, clipping and the optimizer.
Nothing in a step reads a value back from the device: losses and counts accumulate
where the model computes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

from paratrain.config import TrainConfig
from paratrain.data.cache.read import agree_intact
from paratrain.data.samplers import StepPlan
from paratrain.distributed import comm
from paratrain.distributed.env import DistEnv
from paratrain.distributed.runtime import Runtime
from paratrain.engine.checkpointing.run_dir import last_of_run, release_all
from paratrain.engine.inference.evaluate import EvalResult, evaluate
from paratrain.engine.run.preempt import Interrupted
from paratrain.engine.run.schedule import base_lr
from paratrain.engine.run.step import train_step as one_step
from paratrain.engine.setup import Run, setup
from paratrain.log import get_logger, since_start
from paratrain.report.metrics import AVERAGED, format_epoch
from paratrain.report.plots import plot_curves
from paratrain.report.run_files import nothing_left, progress_bar, summarise

__all__ = ["Run", "fit", "setup", "train_epoch", "train_step", "train_worker"]


def train_worker(cfg: TrainConfig, env: DistEnv) -> dict:
    """One process of a training job: its logger, its process group, fit()."""
    from paratrain.distributed.runtime import distributed
    from paratrain.log import setup_logging

    setup_logging(env.rank, env.world_size)
    with distributed(env, cfg.device, cfg.backend, cfg.timeout) as runtime:
        return fit(cfg, runtime)


def fit(cfg: TrainConfig, runtime: Runtime) -> dict:
    """Train as configured (:func:`_train`); the run folder is let go of at the end,
    however it ends, and removed if nothing was trained in it."""
    try:
        return _train(cfg, runtime)
    finally:
        release_all()


def _train(cfg: TrainConfig, runtime: Runtime) -> dict:
    """Train as configured, as this process's share of the job; returns rank 0's summary.

    The outline of every run, on every rank: set up (data, model, strategy, optimizer,
    recipe, the end, the checkpoint to resume from), then per epoch train, evaluate,
    save and record until the end says so; then summarise. Rank 0 alone writes files
    and speaks."""
    run = setup(cfg, runtime)
    cfg, progress = run.cfg, run.progress  # cfg: with --budget-recipe low-res, its sizes
    told = run.end.at_start(progress.epoch, progress.global_step, str(cfg.budget))
    if told is not None:  # resumed from the end, or with the budget spent: nothing rewritten
        return nothing_left(
            cfg, run.run_dir, runtime, progress.epoch, told and f"{run.run_dir}: {told}"
        )
    started = time.perf_counter()
    try:
        with run.control.guard, run.loggers:  # signals are acted on between steps
            epoch, more = progress.epoch, True
            while more:
                epoch_start = time.perf_counter()
                train_seconds = train_epoch(run, epoch)
                result, others = validate(run)
                cost = time.perf_counter() - epoch_start
                record_epoch(run, epoch, cost, train_seconds, result, others)
                more = run.end.after_epoch(epoch, time.perf_counter() - epoch_start,
                                           progress.global_step)  # fmt: skip
                epoch += 1
            run.loggers.finish(run.run_dir / "curves.png", last_of_run(run.run_dir))
    except KeyboardInterrupt:  # checkpoints are written whole or not at all: say which
        run.saver.finish(failing=True)
        raise Interrupted(run.run_dir, last_of_run(run.run_dir)) from None
    except BaseException:  # a checkpoint still being written is written before the end
        run.saver.finish(failing=True)
        raise
    run.saver.finish()
    comm.barrier()
    seconds = time.perf_counter() - started
    skipped = progress.skipped_steps
    return summarise(cfg, run.run_dir, run.metrics, runtime, seconds, skipped, run.first_step)


def train_epoch(run: Run, epoch: int) -> float:
    """One epoch of optimizer steps over this replica's shard; returns its seconds."""
    cfg, parts, progress, sampler = run.cfg, run.parts, run.progress, run.loaders.sampler
    sampler.set_epoch(epoch, progress.consumed)  # a new order every epoch
    bar = progress_bar(run.runtime, len(sampler) * parts.replicas, epoch, run.end.whole)
    run.loggers.start_epoch()
    run.recipe.start_epoch(epoch)  # --freeze-epochs
    size = run.end.train_size(cfg, epoch)  # --progressive: this epoch's size
    if size != run.loaders.train_size:
        run.loaders.train_at(size)
        get_logger().info(f"epoch {epoch + 1}: training at {size}px")
    parts.train()
    run.optimizer.zero_grad(set_to_none=True)
    start, first = time.perf_counter(), progress.global_step
    batches, remaining, taken = iter(run.loaders.train), len(run.loaders.train), 0
    while remaining:
        count = min(cfg.grad_accum, remaining)  # the epoch's last step may have fewer
        remaining -= count
        run.schedule.apply(run.optimizer, epoch + progress.consumed / sampler.total)
        plan = run.loaders.step_plan(taken)  # --order global: how its micro-batches weigh
        images = train_step(run, itertools.islice(batches, count), count, plan)
        taken += 1
        if run.first_step is None:  # what a user waits for: from the command to training
            run.first_step = since_start()
            get_logger().info(f"first step {run.first_step:.1f} s after the command started")
        bar.update(images)
        if not bar.disable and progress.global_step % run.control.check_every == 0:
            totals = progress.totals.tolist()  # read back only where shown
            bar.set_postfix(loss=f"{totals[0] / max(totals[2], 1):.4f}")
        run.control.after_step(progress)
        trained = epoch + progress.consumed / sampler.total
        if run.end.after_step(trained, progress.global_step, bar, epoch):
            break
    run.cut_short = remaining > 0
    bar.close()
    seconds = time.perf_counter() - start
    trained = epoch + progress.consumed / sampler.total
    run.end.epoch_trained(trained, seconds, progress.global_step - first)
    return seconds


def train_step(run: Run, micro_batches: Iterator, count: int, plan: StepPlan | None = None) -> int:
    """One optimizer step of the run (engine/run/step.py), then what the run keeps of it:
    the epoch's sums, the step counters, the trackers' scalars. Returns the step's images
    over every model copy."""
    progress = run.progress
    result = one_step(run.stepper, micro_batches, count, progress, plan=plan)
    if result.skipped is not True:
        progress.totals += result.sums
        lr = base_lr(run.optimizer)
        run.loggers.add(result.sums, progress.global_step + 1, lr, run.control.check_every)
    progress.step_in_epoch += 1
    progress.global_step += 1
    progress.consumed += result.trained
    return result.trained


def validate(run: Run) -> tuple[EvalResult, dict[str, EvalResult]]:
    """The model, and the recipe's other models (the EMA weights), on every validation
    image, each counted once: the model's result, the others' by their suffix."""
    run.control.check(run.progress)  # what the epoch's steps left unread, before anything uses it
    last = run.progress.epoch + 1 >= run.end.whole
    agree_intact(run.loaders.cache, wait=last)  # the cache's background check: damage stops
    run.parts.agree_buffers()
    classes = len(run.split.classes)
    with run.recipe.precision.autocast():
        tta, limit = run.cfg.tta == "flip", run.cfg.limit_val_batches
        val, device = run.loaders.val, run.runtime.device
        sets = run.split.label_sets  # several labels an image: their table
        result = evaluate(run.parts, val, run.parts.input_device, classes, tta=tta, limit=limit,
                          label_sets=sets)  # fmt: skip
        others = {
            suffix: evaluate(model, val, device, classes, tta=tta, limit=limit, label_sets=sets)
            for suffix, model in run.recipe.evaluated().items()
        }
    return result, others


def record_epoch(
    run: Run,
    epoch: int,
    epoch_seconds: float,
    train_seconds: float,
    result: EvalResult,
    others: dict[str, EvalResult],
) -> None:
    """Step the schedule, save, and write the epoch's metrics row, curves and line."""
    progress = run.progress
    epoch_lr = run.schedule.lr(epoch)
    totals = comm.all_reduce_sum(progress.totals).tolist()
    row = {
        "epoch": epoch + 1,
        "lr": epoch_lr,
        "train_loss": totals[0] / max(totals[2], 1),
        "train_acc": totals[1] / max(totals[2], 1),
        **result.row(),
        "val_count": result.count,
        "skipped_steps": progress.skipped_steps,
        "epoch_seconds": epoch_seconds,
        "train_images_per_s": totals[2] / max(train_seconds, 1e-9),
        "world_size": run.runtime.world_size,
        "first_step_s": run.first_step,
        "since_start_s": since_start(),  # when the epoch's evaluation ended, from the command
    }
    for suffix, other in others.items():  # the EMA weights' (val_loss_ema, val_top1_ema)
        row.update({f"val_loss{suffix}": other.loss, f"val_top1{suffix}": other.top1})
        if (mean_ap := other.scores().get("map")) is not None:  # several labels an image
            row[f"val_map{suffix}"] = mean_ap
    run.recipe.task.observe(result)  # several labels an image: the threshold chosen
    if not run.cut_short:  # else saved mid-epoch: a resumed run trains the rest of it
        progress.start_epoch(epoch + 1)
    judged = others.get(AVERAGED, result)  # the EMA weights, where kept, are the run's
    run.saver.save(progress, score=judged.score(run.cfg.monitor))  # --monitor picks best.pt
    if run.runtime.is_main:
        run.metrics.write(row)
        plot_curves(run.metrics.read(), run.run_dir / "curves.png")
        run.loggers.epoch(row, progress.global_step)
        get_logger().info(format_epoch(row, run.end.whole))
