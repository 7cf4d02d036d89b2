"""The entry points: one function per subcommand, callable from Python as from the CLI.

Each turns its options (config/) into calls of the engine, bench, report and launch:
checks first (engine/preflight, once, before any process starts), then the work in this
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
    preset_notes,
    to_argv,
)
from paratrain.config.run_dirs import claim_new_name
from paratrain.distributed.env import DistEnv, detect
from paratrain.errors import AgreedUserError, UserError

if TYPE_CHECKING:
    from paratrain.bench.speed import BenchResult

T = TypeVar("T")
Say = Callable[[str], Any]


def launch_or_run(nproc: int, argv: list[str], work: Callable[[DistEnv], T], **kw: Any) -> T | None:
    """distributed/launch.launch_or_run, imported when a command runs (it loads torch)."""
    from paratrain.distributed.launch import launch_or_run as run

    return run(nproc, argv, work, **kw)


def _told_once(env: DistEnv, check: Callable[[], T]) -> T:
    """A check every rank makes alike: its error is told once, by rank 0."""
    try:
        return check()
    except UserError as exc:
        if env.world_size > 1 and not exc.agreed:
            raise AgreedUserError(str(exc)) from None
        raise


# ---------------------------------------------------------------- train


def train(cfg: TrainConfig, *, dry_run: bool = False, say: Say = print) -> dict | None:
    """Train as configured: launch ``cfg.nproc`` workers, or be one.

    Returns the run summary in the process that trained (rank 0's view); None in a
    launcher, whose workers report through the run directory, and for a dry run."""
    from paratrain.engine import preflight
    from paratrain.engine.describe import dry_run as describe

    cfg.validate()
    env = detect(os.environ)
    checked = preflight.already_checked()
    if cfg.data is None:  # the embedded digits set
        from paratrain.data.builtin import digits_dir, digits_ready, ensure_digits

        if env.is_main and not checked:
            say("; ".join(preset_notes(cfg)))
        if dry_run and not digits_ready(cfg.cache_dir):  # a dry run writes nothing
            if "auto" in (cfg.nproc, cfg.strategy, cfg.batch_size, cfg.lr):
                say(
                    "the embedded digits set is not written yet; auto settings are chosen on "
                    "it by the first run (a dry run writes nothing)"
                )
                return None
            world = preflight.job_world(cfg, env)
            preflight.check_settings(cfg, world)
            preflight.check_devices(cfg, world)
            say(describe(cfg, env, unwritten=digits_dir(cfg.cache_dir)))
            return None
        cfg = replace(cfg, data=str(ensure_digits(cfg.cache_dir)))
    if not checked:
        _told_once(env, lambda: preflight.preflight(cfg, preflight.job_world(cfg, env)))
    chosen: list[str] = []
    if "auto" in (cfg.nproc, cfg.strategy, cfg.batch_size, cfg.lr):
        cfg, chosen = _choose_automatically(cfg, env, dry_run, say)
        world = preflight.job_world(cfg, env)
        preflight.check_settings(cfg, world)
        preflight.check_devices(cfg, world)
    if not checked and env.source == "single" and not dry_run:
        if warning := preflight.oversubscribed(cfg):
            print(f"paratrain: warning: {warning}", file=sys.stderr)
    if dry_run:
        say(describe(cfg, env, chosen=chosen))
        return None
    claimed = None
    if cfg.processes > 1 and env.source == "single" and not cfg.name and not cfg.resume:
        # restarted workers must find this run again, so its name is fixed up front
        cfg = replace(cfg, name=claim_new_name(Path(cfg.output_dir)))
        claimed = Path(cfg.output_dir) / str(cfg.name)
    try:
        return launch_or_run(
            cfg.processes,
            ["train", *to_argv(cfg)],
            lambda env: _train_worker(cfg, env),
            max_restarts=cfg.max_restarts,
            master_port=cfg.master_port,
        )
    finally:  # workers that stopped before writing anything leave no empty run folder
        if claimed is not None and claimed.is_dir() and not any(claimed.iterdir()):
            claimed.rmdir()


def _choose_automatically(
    cfg: TrainConfig, env: DistEnv, dry_run: bool, say: Say
) -> tuple[TrainConfig, list[str]]:
    """Every auto setting made a value (bench/autopilot.py), each told with its reason."""
    from paratrain.bench import autopilot

    if env.source != "single":
        raise UserError(
            "auto settings are chosen by `paratrain train` itself, before it starts its "
            "processes; under torchrun or srun give values (a run's config.yaml has them)"
        )
    if cfg.resume:
        raise UserError(
            "a resumed run continues with the values its config.yaml recorded: give them, "
            "not auto (--config <run>/config.yaml)"
        )
    if not dry_run and not cfg.name:  # the range test's curve goes into the run folder
        cfg = replace(cfg, name=claim_new_name(Path(cfg.output_dir)))
    plot_dir = None if dry_run else Path(cfg.output_dir) / str(cfg.name)
    cfg, choices = autopilot.resolve(cfg, say=say, plot_dir=plot_dir)
    for choice in choices:
        say(choice.line())
    return cfg, [choice.line() for choice in choices]


def _train_worker(cfg: TrainConfig, env: DistEnv) -> dict:
    from paratrain.distributed.runtime import distributed
    from paratrain.engine.trainer import fit
    from paratrain.log import setup_logging

    setup_logging(env.rank, env.world_size)
    with distributed(env, cfg.device, cfg.backend, cfg.timeout) as runtime:
        return fit(cfg, runtime)


# ---------------------------------------------------------------- eval, predict, export


def evaluate(opts: EvalOptions, say: Say = print) -> dict | None:
    """A checkpoint on a data folder's validation part, at any world size; the report on
    rank 0 (also printed), None elsewhere and in a launcher."""
    from paratrain.engine.evaluate import evaluate_checkpoint, prepare_evaluation
    from paratrain.report.evaluation import format_report

    opts.validate()
    env = detect(os.environ)
    job = prepare_evaluation(opts)
    if job.skipped:
        say(f"skipping {job.skipped} unreadable validation image(s), as the run did")
    if opts.dry_run:
        say(
            f"would evaluate {opts.checkpoint} ({job.saved.model} at {job.saved.image_size}px, "
            f"{len(job.split.classes)} classes) on {len(job.split.val)} validation images of "
            f"{job.split.root} with {opts.nproc} process(es)"
        )
        return None
    report = launch_or_run(
        opts.nproc, ["eval", *to_argv(opts)], lambda env: evaluate_checkpoint(job, opts, env)
    )
    if report is not None and env.is_main:
        say(json.dumps(report) if opts.json else format_report(report))
    return report


def predict(opts: PredictOptions, say: Say = print) -> list[dict]:
    """Top-k classes of every image given (files, or folders searched for images)."""
    from paratrain.engine.predict import check_inputs, write_csv
    from paratrain.engine.predict import predict as predict_images

    opts.validate()
    if opts.dry_run:
        paths = check_inputs(str(opts.checkpoint), opts.inputs, opts.ema)
        say(f"would predict {len(paths)} image(s) with {opts.checkpoint} on {opts.device}")
        return []

    def tell(rows: list[dict]) -> None:  # as each batch is done, not all at the end
        for row in rows:
            say(f"{row['path']}: " + ", ".join(f"{name} {p:.3f}" for name, p in row["top"]))

    rows, unreadable = predict_images(
        str(opts.checkpoint), opts.inputs, opts.top_k, opts.batch_size, opts.device, opts.ema, tell
    )
    if opts.csv:
        write_csv(rows, opts.csv)
    if unreadable:
        for path, why in unreadable:
            print(f"paratrain: skipped {path}: {why}", file=sys.stderr)
        raise UserError(
            f"{len(unreadable)} of {len(rows) + len(unreadable)} image(s) could not be read "
            "(listed above); the others were predicted"
        )
    return rows


def export(opts: ExportOptions, say: Say = print) -> dict[str, str]:
    """A checkpoint as a torch.export program, safetensors or one checkpoint file."""
    from paratrain.engine.export import check_export
    from paratrain.engine.export import export as export_model

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
    """Every model name --model accepts (torchvision's, or with --timm timm's)."""
    from paratrain.models.registry import list_models

    names = list_models(timm=bool(opts and opts.timm))
    say("\n".join(names))
    return names


def recipes(opts: RecipesOptions | None = None, say: Say = print) -> list[str]:
    """The shipped recipes (--recipe NAME), each with its first line."""
    from paratrain.config.train import RECIPES, shipped_recipes

    names = shipped_recipes()
    for name in names:
        first = (RECIPES / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ")
        say(f"{name}: {first}")
    return names


# ---------------------------------------------------------------- bench, scale, plan


def bench(cfg: TrainConfig, opts: BenchOptions, say: Say = print) -> BenchResult | None:
    """Step speed on synthetic data: the result on rank 0, else None."""
    from paratrain.bench.speed import bench_worker, format_result
    from paratrain.engine import preflight

    cfg.validate()
    opts.validate()
    env = detect(os.environ)
    world = preflight.job_world(cfg, env)
    _told_once(env, lambda: preflight.check_devices(cfg, world))
    _told_once(env, lambda: preflight.check_model_input(cfg, world))
    if opts.dry_run:
        say(
            f"would time {opts.steps} steps (after {opts.warmup}) of {cfg.model} at "
            f"{cfg.image_size}px, batch {cfg.batch_size} x {cfg.nproc} process(es)"
        )
        return None
    argv = ["bench", *to_argv(cfg, BENCH_SETTINGS), *to_argv(opts)]
    result = launch_or_run(cfg.processes, argv, lambda env: bench_worker(cfg, opts, env))
    if result is not None and not opts.result_file:
        say(json.dumps(asdict(result)) if opts.json else format_result(result))
    return result


def scale(cfg: TrainConfig, opts: ScaleOptions, say: Say = print) -> dict | None:
    """Measured and predicted scaling; writes the report under ``opts.out`` and returns
    it. With ``opts.calibrate`` (a CSV of n,seconds) nothing is measured here."""
    from paratrain.bench import costmodel
    from paratrain.bench import scale as scaling
    from paratrain.engine import preflight
    from paratrain.report.scaling import format_calibration, format_measured, write_report

    cfg.validate()
    opts.validate()
    if opts.calibrate is not None:
        points = scaling.read_epoch_times(Path(opts.calibrate))
        if opts.dry_run:
            say(f"would fit {len(points)} epoch times from {opts.calibrate}")
            return None
        report = scaling.calibration_report(costmodel.calibrate(points), opts.max_n)
        text = format_calibration(report, str(opts.calibrate))
    else:
        if detect(os.environ).source != "single":
            raise UserError(
                "`paratrain scale` starts its own processes; run it outside torchrun and srun"
            )
        preflight.check_devices(cfg, 1)
        settings = scaling.settings_from(opts)
        preflight.check_model_input(cfg, 1)  # scale measures one process too
        if opts.dry_run:
            say(
                f"would measure {cfg.model} at {cfg.image_size}px on 1..{settings.nproc_max} "
                f"processes and write {opts.out}"
            )
            return None
        profile, rows, samples = scaling.measure(cfg, settings, say=say)
        report = scaling.report(cfg, settings, profile, rows, samples)
        text = format_measured(report)
    paths = write_report(report, Path(opts.out))
    say(text)
    say("wrote " + ", ".join(str(p) for p in paths))
    return report


def plan(cfg: TrainConfig, opts: PlanOptions, say: Say = print) -> dict | None:
    """Per-device memory of each strategy; which fit; the recommendation."""
    from paratrain.bench import memory
    from paratrain.models.registry import check_input_size

    cfg.validate()
    opts.validate()
    memory.parse_size(opts.device_memory or "")
    check_input_size(cfg.model, cfg.image_size)
    if opts.dry_run:
        say(
            f"would profile {cfg.model} at {cfg.image_size}px and plan batch {cfg.batch_size} "
            f"on {opts.devices} device(s) of {opts.device_memory}"
        )
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
    from paratrain.engine.preflight import check_settings
    from paratrain.models.registry import check_input_size

    job.validate()
    cfg.validate()
    check_settings(cfg, job.nodes * job.per_node)
    check_input_size(cfg.model, cfg.image_size)
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

__all__ = [
    "COMMANDS",
    "bench",
    "check",
    "evaluate",
    "export",
    "launch_or_run",
    "models",
    "plan",
    "predict",
    "runs",
    "scale",
    "slurm",
    "train",
]
