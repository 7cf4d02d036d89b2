"""The entry points: one function per subcommand, callable from Python as from the CLI.

Each turns its options (config/) into calls of the engine, bench, report and launch:
checks first (engine/prerun/preflight, once, before any process starts), then the work in this
process or, for ``--nproc N`` outside a launcher, in N workers running the same command
(distributed/launch.launch_or_run). What a command prints goes through ``say`` (print by
default), on rank 0 only.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from paratrain.config import (
    BENCH_SETTINGS,
    BenchOptions,
    CheckOptions,
    EvalOptions,
    ExportOptions,
    ModelsOptions,
    PlanOptions,
    PredictOptions,
    RecipesOptions,
    RunsOptions,
    ScaleOptions,
    SlurmOptions,
    TrainConfig,
    to_argv,
)
from paratrain.config.run_dirs import claim_new_name
from paratrain.distributed.env import DistEnv, detect
from paratrain.errors import AgreedUserError, UserError
from paratrain.log import mark_start

if TYPE_CHECKING:
    from paratrain.bench.speed import BenchResult

T = TypeVar("T")
Say = Callable[[str], Any]


# The command line's entry, set by the `paratrain` command (cli.run): a launcher there may
# fork its workers into it. Unset, as in a Python session, they start as new interpreters.
fork_into: Callable[[list[str]], None] | None = None


def launch_or_run(nproc: int, argv: list[str], work: Callable[[DistEnv], T], **kw: Any) -> T | None:
    """distributed/launch.launch_or_run, imported when a command runs (it loads torch);
    its workers forked into ``fork_into`` where that is set (and safe)."""
    from paratrain.distributed.launch import Fork
    from paratrain.distributed.launch import launch_or_run as run

    fork = Fork(fork_into, _worker_imports) if fork_into is not None else None
    return run(nproc, argv, work, fork=fork, **kw)


def _worker_imports() -> None:
    """What every worker needs, imported in a launcher that forks them: once for all."""
    import torchvision  # noqa: F401

    import paratrain.engine.trainer  # noqa: F401


def _told_once(env: DistEnv, check: Callable[[], T]) -> T:
    """A check every rank makes alike: its error is told once, by rank 0."""
    try:
        return check()
    except UserError as exc:
        if env.world_size > 1 and not exc.agreed:
            raise AgreedUserError(str(exc)) from None
        raise


# ---------------------------------------------------------------- train


def _train_worker(cfg: TrainConfig, env: DistEnv) -> dict:
    from paratrain.engine.trainer import train_worker

    return train_worker(cfg, env)


def _check(
    cfg: TrainConfig, env: DistEnv, checked: bool, dry_run: bool, say: Say, embedded: bool
) -> None:
    """What a run can be found wrong about, checked once (engine/prerun/preflight.py). A
    launcher of workers leaves the model to them: they load its package anyway (an auto
    setting loads it here: it builds the model). ``embedded``: the digits' own line has
    told the presets."""
    from paratrain.config import preset_notes
    from paratrain.engine.prerun import preflight

    world = preflight.job_world(cfg, env)
    if checked:  # a launched worker: what its launcher left
        _told_once(env, lambda: preflight.check_model_input(cfg, world))
        return
    launches = env.source == "single" and not dry_run and cfg.nproc not in (1, "auto")
    model_here = not launches or cfg.has_auto()
    if env.is_main and not embedded:  # a size taken from the data (the cache's too), and
        # how to have another; a budget's schedule
        for note in preset_notes(cfg, ("small images", "large images", "budget")):
            say(note)
    _told_once(env, lambda: preflight.preflight(cfg, world, model=model_here))


def train(cfg: TrainConfig, *, dry_run: bool = False, say: Say = print) -> dict | None:
    """Train as configured: launch ``cfg.nproc`` workers, or be one.

    Returns the run summary in the process that trained (rank 0's view); None in a
    launcher, whose workers report through the run directory, and for a dry run."""
    from paratrain.data.sources.base import handed_over
    from paratrain.engine.prerun import preflight
    from paratrain.engine.prerun.describe import embedded_data
    from paratrain.report.loggers import DOWN

    cfg.validate()
    env = detect(os.environ)
    checked = preflight.already_checked()
    mark_start(reset=not checked and env.source == "single")  # a command of its own
    embedded = cfg.data is None
    if embedded:  # the embedded digits set: written once, or described unwritten
        if (found := embedded_data(cfg, env, dry_run, say)) is None:
            return None
        cfg = found
    _check(cfg, env, checked, dry_run, say, embedded)
    chosen: list[str] = []
    if cfg.has_auto():
        from paratrain.bench import autopilot

        cfg, chosen = autopilot.choose(cfg, env, dry_run, say)
    if not checked and env.source == "single" and not dry_run:
        if warning := preflight.oversubscribed(cfg):
            print(f"paratrain: warning: {warning}", file=sys.stderr)
    if dry_run:
        if cfg.budget and cfg.data is not None:  # about how many epochs fit, timed here
            from paratrain.bench.speed import budget_plan
            from paratrain.data.loaders import read_split
            from paratrain.engine.prerun.preflight import job_world

            split = read_split(cfg)
            world = job_world(cfg, env)
            chosen = [*chosen, budget_plan(cfg, len(split.train), len(split.val), world)]
        from paratrain.engine.prerun.describe import dry_run as describe

        say(describe(cfg, env, chosen=chosen))
        return None
    claimed = None
    if cfg.processes > 1 and env.source == "single" and not cfg.name and not cfg.resume:
        # restarted workers must find this run again, so its name is fixed up front
        cfg = replace(cfg, name=claim_new_name(Path(cfg.output_dir)))
        claimed = Path(cfg.output_dir) / str(cfg.name)
    try:
        with handed_over():  # the checks' listing of the data, for the run's processes
            return launch_or_run(
                cfg.processes,
                ["train", *to_argv(cfg)],
                lambda env: _train_worker(cfg, env),
                max_restarts=cfg.max_restarts,
                master_port=cfg.master_port,
            )
    finally:  # workers that stopped before writing anything leave no empty run folder
        os.environ.pop(DOWN, None)  # what the checks found of the trackers, for this run
        if claimed is not None and claimed.is_dir() and not any(claimed.iterdir()):
            claimed.rmdir()


# ---------------------------------------------------------------- eval, predict, export


def evaluate(opts: EvalOptions, say: Say = print) -> dict | None:
    """A checkpoint on a data folder's validation part, at any world size; the report on
    rank 0 (also printed), None elsewhere and in a launcher."""
    from paratrain.engine.inference.evaluate import evaluate_checkpoint, prepare_evaluation
    from paratrain.report.evaluation import format_report

    opts.validate()
    env = detect(os.environ)
    job = prepare_evaluation(opts)
    if job.skipped:
        say(f"skipping {job.skipped} unreadable validation image(s), as the run did")
    if opts.dry_run:
        say(job.describe(opts))
        return None
    report = launch_or_run(
        opts.nproc, ["eval", *to_argv(opts)], lambda env: evaluate_checkpoint(job, opts, env)
    )
    if report is not None and env.is_main:
        say(json.dumps(report) if opts.json else format_report(report))
    return report


def predict(opts: PredictOptions, say: Say = print) -> list[dict]:
    """Top-k classes of every image given (files, or folders searched for images)."""
    from paratrain.engine.inference.predict import run_predict

    opts.validate()
    return run_predict(opts, say)


def export(opts: ExportOptions, say: Say = print) -> dict[str, str]:
    """A checkpoint as a torch.export program, safetensors or one checkpoint file."""
    from paratrain.engine.inference.export import check_export
    from paratrain.engine.inference.export import export as export_model

    opts.validate()
    if opts.dry_run:
        say(f"would write {check_export(str(opts.checkpoint), opts)} from {opts.checkpoint}")
        return {}
    written = export_model(str(opts.checkpoint), opts.format, opts.out, opts.ema)
    say(f"wrote {written['export']} (classes in {written['class_indices']})")
    return written


# ---------------------------------------------------------------- runs, models, recipes


def runs(opts: RunsOptions, say: Say = print) -> list[dict]:
    """One row per run directory under ``opts.dir``."""
    from paratrain.report.runs import collect, format_table

    opts.validate()
    rows = collect(opts.dir)
    if opts.json:
        say(json.dumps(rows))
    else:
        say(format_table(rows) if rows else f"no runs in {opts.dir}")
    return rows


def models(opts: ModelsOptions | None = None, say: Say = print) -> list[str]:
    """The model names --model accepts (torchvision's, or with --timm timm's), by
    family, with their parameter counts; --filter keeps those that match."""
    from paratrain.models.registry import COUNT_AT_MOST, model_families

    timm, pattern = bool(opts and opts.timm), opts.filter if opts else None
    families = model_families(timm, pattern)
    if not families:
        raise UserError(f"no model matches --filter {pattern}")
    lines, names = [], []
    for family, members in families.items():
        lines.append(f"{family}:")
        for name, count in members:
            size = f"{count / 1e6:8.1f}M" if count is not None else " " * 9
            lines.append(f"  {name:<40}{size}")
            names.append(name)
    if timm and any(count is None for m in families.values() for _, count in m):
        lines.append(f"(parameter counts for at most {COUNT_AT_MOST} models: --filter to narrow)")
    say("\n".join(lines))
    return names


def recipes(opts: RecipesOptions | None = None, say: Say = print) -> list[str]:
    """The shipped recipes (--recipe NAME), each with its first line."""
    from paratrain.config.train import recipe_summaries

    summaries = recipe_summaries()
    for name, first in summaries.items():
        say(f"{name}: {first}")
    return list(summaries)


# ---------------------------------------------------------------- bench, scale, plan


def bench(cfg: TrainConfig, opts: BenchOptions, say: Say = print) -> BenchResult | None:
    """Step speed on synthetic data: the result on rank 0, else None."""
    from paratrain.bench.speed import bench_worker, describe_bench, format_result
    from paratrain.engine.prerun import preflight

    cfg.validate()
    opts.validate()
    env = detect(os.environ)
    world = preflight.job_world(cfg, env)
    _told_once(env, lambda: preflight.check_devices(cfg, world))
    _told_once(env, lambda: preflight.check_model_input(cfg, world))
    if opts.dry_run:
        say(describe_bench(cfg, opts))
        return None
    argv = ["bench", *to_argv(cfg, BENCH_SETTINGS), *to_argv(opts)]
    result = launch_or_run(cfg.processes, argv, lambda env: bench_worker(cfg, opts, env))
    if result is not None and not opts.result_file:
        say(json.dumps(asdict(result)) if opts.json else format_result(result))
    return result


def scale(cfg: TrainConfig, opts: ScaleOptions, say: Say = print) -> dict | None:
    """Measured and predicted scaling (bench/scale.py); writes the report under
    ``opts.out`` and returns it. With ``opts.calibrate`` nothing is measured here."""
    from paratrain.bench.scale import run_scale

    cfg.validate()
    opts.validate()
    if opts.calibrate is None and detect(os.environ).source != "single":
        raise UserError(
            "`paratrain scale` starts its own processes; run it outside torchrun and srun"
        )
    return run_scale(cfg, opts, say)


def plan(cfg: TrainConfig, opts: PlanOptions, say: Say = print) -> dict | None:
    """Per-device memory of each strategy; which fit; the recommendation."""
    from paratrain.bench import memory

    cfg.validate()
    opts.validate()
    memory.check_plan(cfg, opts)
    if opts.dry_run:
        say(memory.describe_plan(cfg, opts))
        return None
    result, table = memory.plan(cfg, opts)
    say(json.dumps(result) if opts.json else table)
    return result


# ---------------------------------------------------------------- slurm, check


def slurm(job: SlurmOptions, cfg: TrainConfig, train_args: list[str], say: Say = print) -> int:
    """Print the sbatch script for ``paratrain train <train_args>``. The training flags
    get the checks `train --dry-run` makes that do not need the cluster's files: every
    value, every combination, the model at its image size."""
    from paratrain.distributed.slurm import sbatch_script
    from paratrain.engine.prerun.preflight import check_settings

    job.validate()
    cfg.validate()
    check_settings(cfg, job.nodes * job.per_node, model=True)
    say(sbatch_script(job, train_args).rstrip("\n"))
    return 0


def check(opts: CheckOptions, say: Say = print) -> int:
    """The self-test on ``opts.nproc`` processes; 0 when every check passed."""
    from paratrain.bench.check import check_worker

    opts.validate()
    if opts.dry_run:
        say(f"would test collectives and bandwidth on {opts.nproc} process(es)")
        return 0
    code = launch_or_run(
        opts.nproc, ["check", *to_argv(opts)], lambda env: check_worker(opts, env, say)
    )
    return 0 if code is None else code


COMMANDS: dict[str, Callable[..., Any]] = {
    "eval": evaluate,
    "predict": predict,
    "export": export,
    "runs": runs,
    "models": models,
    "recipes": recipes,
    "bench": bench,
    "scale": scale,
    "plan": plan,
    "check": check,
}
