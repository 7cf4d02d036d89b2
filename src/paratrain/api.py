"""The entry points: one function per subcommand, callable from Python as from the CLI.

Each takes its options (config/), checks them before any work, and either does the work
in this process or, for ``--nproc N`` outside a launcher, starts N workers running the
same command through one helper (:func:`launch_or_run`). What a command prints goes
through ``say`` (print by default), on rank 0 only.
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
    from paratrain.bench.step import BenchResult

T = TypeVar("T")
Say = Callable[[str], Any]

# set by the launcher for its workers: what it checked need not be checked N times again
CHECKED = "PARATRAIN_CHECKED"


def launch_or_run(
    nproc: int,
    argv: list[str],
    work: Callable[[DistEnv], T],
    *,
    max_restarts: int = 0,
    master_port: int | None = None,
) -> T | None:
    """``work(env)`` here when this process is the job's only one, or already one of a
    launched job's (torchrun, srun); else start ``nproc`` workers running ``paratrain
    <argv>`` through torch's elastic launcher, wait, and return None (a failed worker's
    exit code becomes this process's)."""
    env = detect(os.environ)
    if nproc <= 1 or env.source != "single":
        return work(env)
    from paratrain.distributed.launch import launch

    os.environ[CHECKED] = "1"
    try:
        code = launch(nproc, argv, max_restarts=max_restarts, master_port=master_port)
    finally:
        os.environ.pop(CHECKED, None)
    if code:
        raise SystemExit(code)
    return None


def _told_once(env: DistEnv, check: Callable[[], T]) -> T:
    """A check every rank makes alike: its error is told once, by rank 0."""
    try:
        return check()
    except UserError as exc:
        if env.world_size > 1 and not exc.agreed:
            raise AgreedUserError(str(exc)) from None
        raise


def check_model_input(cfg: TrainConfig, world: int) -> None:
    """registry.check_model_input before any process starts, for ``world`` ranks."""
    import torch

    from paratrain.distributed.runtime import runs_on_cuda
    from paratrain.models.registry import check_model_input as check

    check(cfg, world, torch.cuda.device_count() if runs_on_cuda(cfg.device) else 0)


# ---------------------------------------------------------------- train


def train(cfg: TrainConfig, *, dry_run: bool = False, say: Say = print) -> dict | None:
    """Train as configured: launch ``cfg.nproc`` workers, or be one.

    Returns the run summary in the process that trained (rank 0's view); None in a
    launcher, whose workers report through the run directory, and for a dry run."""
    cfg.validate()
    env = detect(os.environ)
    if cfg.data is None:  # the embedded digits set
        from paratrain.data.builtin import digits_dir, digits_ready, ensure_digits

        if env.is_main and not os.environ.get(CHECKED):
            say("; ".join(preset_notes(cfg)))
        if dry_run and not digits_ready(cfg.cache_dir):  # a dry run writes nothing
            cfg.validate()
            if autopilot_needed(cfg):
                say(
                    "the embedded digits set is not written yet; auto settings are chosen on "
                    "it by the first run (a dry run writes nothing)"
                )
                return None
            check_devices(cfg)
            say(describe_train(cfg, env, unwritten=digits_dir(cfg.cache_dir)))
            return None
        cfg = replace(cfg, data=str(ensure_digits(cfg.cache_dir)))
    if not os.environ.get(CHECKED):
        _told_once(env, lambda: preflight(cfg))
        if env.source == "single" and not dry_run and (warning := oversubscribed(cfg)):
            print(f"paratrain: warning: {warning}", file=sys.stderr)
    choices = []
    if autopilot_needed(cfg):
        if env.source != "single":
            raise UserError(
                "auto settings are chosen by `paratrain train` itself, before it starts its "
                "processes; under torchrun or srun give values (a run's config.yaml has them)"
            )
        if not dry_run and not cfg.name:  # the range test's curve goes into the run folder
            cfg = replace(cfg, name=claim_new_name(Path(cfg.output_dir)))
        cfg, choices = choose_automatically(cfg, dry_run, say)
        check_devices(cfg)
    if dry_run:
        say(describe_train(cfg, env, choices=choices))
        return None
    claimed = None
    if cfg.nproc > 1 and env.source == "single" and not cfg.name and not cfg.resume:
        # restarted workers must find this run again, so its name is fixed up front
        cfg = replace(cfg, name=claim_new_name(Path(cfg.output_dir)))
        claimed = Path(cfg.output_dir) / cfg.name
    try:
        return launch_or_run(
            cfg.nproc,
            ["train", *to_argv(cfg)],
            lambda env: _train_worker(cfg, env),
            max_restarts=cfg.max_restarts,
            master_port=cfg.master_port,
        )
    finally:  # workers that stopped before writing anything leave no empty run folder
        if claimed is not None and claimed.is_dir() and not any(claimed.iterdir()):
            claimed.rmdir()


def autopilot_needed(cfg: TrainConfig) -> bool:
    return "auto" in (cfg.nproc, cfg.strategy, cfg.batch_size, cfg.lr)


def choose_automatically(cfg: TrainConfig, dry_run: bool, say: Say) -> tuple[TrainConfig, list]:
    """Every auto setting made a value (bench/autopilot.py), each told with its reason."""
    from paratrain.bench import autopilot

    if cfg.resume:
        raise UserError(
            "a resumed run continues with the values its config.yaml recorded: give them, "
            "not auto (--config <run>/config.yaml)"
        )
    plot_dir = None if dry_run else Path(cfg.output_dir) / cfg.name
    cfg, choices = autopilot.resolve(cfg, say=say, plot_dir=plot_dir)
    for choice in choices:
        say(choice.line())
    return cfg, choices


def preflight(cfg: TrainConfig) -> None:
    """What every rank would otherwise find wrong at once, checked once before any
    process starts: files and folders, the data's layout, the weights file, options
    this machine cannot run. The model against the image size is checked by every rank
    right after (it needs torchvision, a second of start-up the launcher need not pay)."""
    from paratrain.data.folder import build_split
    from paratrain.engine.checkpoint import check_run_dir_free

    cfg.check_paths()
    check_run_dir_free(cfg)
    build_split(cfg.data, cfg.val_fraction, cfg.split_seed)
    if cfg.weights:
        from paratrain.models.registry import read_state_dict

        read_state_dict(cfg.weights)
    if cfg.tensorboard:
        require_tensorboard()
    check_devices(cfg)


def require_tensorboard() -> None:
    """--tensorboard needs the package; say so before any work rather than at the first epoch."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise UserError(
            "--tensorboard needs the tensorboard package: pip install tensorboard"
        ) from None


def check_devices(cfg: TrainConfig) -> None:
    """Options this machine's devices cannot run, refused once here, not by every rank."""
    import torch

    from paratrain.distributed.runtime import choose_device, runs_on_cuda

    if cfg.device is not None:
        choose_device(DistEnv(), cfg.device)  # a CUDA device this machine lacks: one line
    on_cpu = not runs_on_cuda(cfg.device)
    if cfg.strategy == "dp":
        from paratrain.parallel.dp import check_available

        check_available(detect(os.environ).world_size)
    if cfg.strategy == "split":
        from paratrain.parallel.split import parse_devices

        parse_devices(cfg)
    if not on_cpu:
        gpus = torch.cuda.device_count()
        if cfg.nproc != "auto" and cfg.nproc > gpus and cfg.device in (None, "cuda"):
            raise UserError(
                f"--nproc {cfg.nproc} needs {cfg.nproc} GPUs and this machine has {gpus}: "
                f"NCCL cannot run two ranks on one GPU; use --nproc {gpus}, or --device cpu "
                "(gloo on the CPU)"
            )
        return
    if cfg.precision == "16-mixed":
        from paratrain.engine.precision import resolve

        resolve(cfg.precision, torch.device("cpu"))  # raises the one-line error
    if cfg.grad_compression == "powersgd":
        from paratrain.parallel.ddp import POWERSGD_NEEDS_NCCL

        raise UserError(POWERSGD_NEEDS_NCCL)
    if cfg.backend == "nccl":
        raise UserError("--backend nccl needs CUDA devices; use gloo on CPU")


def oversubscribed(cfg: TrainConfig) -> str | None:
    """A warning when --nproc starts more CPU processes than this machine has cores."""
    from paratrain.distributed.runtime import runs_on_cuda, usable_cores

    if runs_on_cuda(cfg.device) or cfg.nproc == "auto" or cfg.nproc <= usable_cores():
        return None
    return (
        f"--nproc {cfg.nproc} on {usable_cores()} CPU core(s): the processes take turns on "
        "the cores and each holds its own copy of the model; --nproc auto measures what is "
        "fastest here"
    )


def describe_train(
    cfg: TrainConfig, env: DistEnv, unwritten: Path | None = None, choices: list | None = None
) -> str:
    """What `train --dry-run` prints: the resolved config, then what would run.
    ``unwritten``: where the embedded digits set would first be written."""
    import torch
    import yaml

    from paratrain.data.cache import survey
    from paratrain.data.folder import build_split
    from paratrain.distributed.runtime import runs_on_cuda
    from paratrain.engine.precision import resolve
    from paratrain.engine.schedule import describe_schedule, peak_lr

    launched = cfg.nproc > 1 and env.source == "single"
    world = cfg.nproc if launched else env.world_size
    cuda = runs_on_cuda(cfg.device)
    check_model_input(cfg, world)
    device = "cuda" if cuda else "cpu"
    backend = cfg.backend or ("nccl" if cuda else "gloo")
    replicas = cfg.replicas(world)
    global_batch = cfg.batch_size * replicas * cfg.grad_accum
    peak = peak_lr(cfg, replicas)
    precision = resolve(cfg.precision, torch.device(device))
    if unwritten is not None:
        data = f"the embedded digits set, written to {unwritten} by the first run"
        cache = "decided once the digits set is written"
    else:
        split = build_split(cfg.data, cfg.val_fraction, cfg.split_seed)
        data = (
            f"{cfg.data}: {len(split.classes)} classes, {len(split.train)} train / "
            f"{len(split.val)} val images ({split.layout})"
        )
        plan = survey(
            split.train + split.val,
            cfg.image_size,
            cfg.cache,
            cfg.cache_max_gb,
            cfg.cache_dir,
            short=cfg.stored_size,
        )
        resumes = _resumable(cfg, split.classes)
        cache = {
            "ready": f"ready ({plan.nbytes / 2**30:.2f} GB at {plan.directory})",
            "build": f"would be built: {plan.nbytes / 2**30:.2f} GB at {plan.directory}",
            "skip": f"off ({plan.reason})",
        }[plan.action]
    how = (
        f"{world} processes started here by torch's elastic launcher (c10d rendezvous)"
        if launched
        else f"{world} process(es) ({env.source})"
    )
    lines = [
        "paratrain train --dry-run: checked; nothing was run.",
        "resolved config:",
        *("  " + line for line in yaml.safe_dump(cfg.to_dict(), sort_keys=False).splitlines()),
        "would run:",
        f"  processes: {how}",
        f"  device: {device}, backend {backend if world > 1 else 'none (one process)'}, "
        f"strategy {cfg.strategy}",
        f"  data: {data}",
        f"  model: {cfg.model}, trained at {cfg.train_size}px, evaluated at {cfg.eval_crop}px "
        f"(resized to {cfg.eval_resize}); runs at those sizes",
        f"  global batch: {global_batch} ({cfg.batch_size} x {replicas} replica(s)"
        + (f" x {cfg.grad_accum} micro-batches)" if cfg.grad_accum > 1 else ")"),
        f"  {cfg.opt}: {describe_schedule(peak, cfg)}",
        f"  precision: {precision}" + (" (auto)" if cfg.precision == "auto" else ""),
        f"  decoded-image cache: {cache}",
    ]
    lines += [f"  chosen: {choice.line()}" for choice in choices or []]
    if launched and (warning := oversubscribed(cfg)):
        lines.append(f"  warning: {warning}")
    if unwritten is None:
        lines.append(f"  resume: {resumes}")
    return "\n".join(lines)


def _resumable(cfg: TrainConfig, classes: list[str]) -> str:
    """What --resume would continue, checked as the run would check it."""
    from paratrain.engine import checkpoint, sharded

    if cfg.resume is None:
        return "no (a new run)"
    if cfg.resume == "auto":
        found = checkpoint.find_resumable(Path(cfg.output_dir), cfg.name)
        if found is None:
            return "auto: nothing to resume yet (a new run)"
    else:
        found = checkpoint.resume_target(cfg.resume)
    folder = sharded.find(found) if found.is_dir() else None
    state = sharded.read_state(folder) if folder is not None else checkpoint.load(found)
    _, changed = checkpoint.check_resumable(state, cfg, classes, found)
    step = f", step {state['step_in_epoch']}" if state.get("step_in_epoch") else ""
    also = f"; changed: {', '.join(changed)}" if changed else ""
    if state["epoch"] >= cfg.epochs:
        also += f"; nothing left to train at --epochs {cfg.epochs}"
    return f"{found} at epoch {state['epoch'] + 1}{step}{also}"


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
    from paratrain.data.folder import build_split
    from paratrain.engine import checkpoint
    from paratrain.engine.predict import weights_of
    from paratrain.models.registry import check_weights_fit

    opts.validate()
    env = detect(os.environ)
    state = checkpoint.load(opts.checkpoint, with_optimizer=False)
    saved = TrainConfig.from_dict(state["config"], source=opts.checkpoint)
    data_dir = opts.data or saved.data
    if not data_dir:
        raise UserError("--data is needed: the checkpoint does not name its data")
    split = build_split(data_dir, saved.val_fraction, saved.split_seed)
    if split.classes != state["classes"]:
        raise UserError(
            f"classes of {data_dir} ({len(split.classes)}) differ from the checkpoint's "
            f"({len(state['classes'])}): {split.classes[:5]} vs {state['classes'][:5]}"
        )
    if saved.bad_images == "skip":  # as the run did: its validation left them out
        from paratrain.data.scan import find_bad_images

        bad = {path for path, _ in find_bad_images([p for p, _ in split.val], 0, 1, 0, True)}
        if bad:
            say(f"skipping {len(bad)} unreadable validation image(s), as the run did")
            split = replace(split, val=[s for s in split.val if s[0] not in bad])
    weights = weights_of(state, opts.checkpoint, opts.ema)
    check_weights_fit(saved.model, len(split.classes), saved.train_size, weights, opts.checkpoint)
    if opts.dry_run:
        say(
            f"would evaluate {opts.checkpoint} ({saved.model} at {saved.image_size}px, "
            f"{len(split.classes)} classes) on {len(split.val)} validation images of "
            f"{data_dir} with {opts.nproc} process(es)"
        )
        return None
    report_dir = _eval_dir(opts.checkpoint, "-ema" if opts.ema else "")
    report = launch_or_run(
        opts.nproc,
        ["eval", *to_argv(opts)],
        lambda env: _evaluate_worker(weights, saved, split, opts, env, report_dir),
    )
    if report is not None and env.is_main:
        from paratrain.report.evaluation import format_report

        say(json.dumps(report) if opts.json else format_report(report))
    return report


def _eval_dir(state_path: str, suffix: str = "") -> Path:
    """<run>/eval for a checkpoint inside a run directory, else eval-<name> beside it."""
    from paratrain.engine.checkpoint import run_dir_of

    path, run = Path(state_path), run_dir_of(state_path)
    return run / f"eval{suffix}" if run else path.parent / f"eval-{path.stem}{suffix}"


def _evaluate_worker(
    weights, saved: TrainConfig, split, opts: EvalOptions, env: DistEnv, report_dir: Path
) -> dict:
    from torch.utils.data import DataLoader

    from paratrain.data.loaders import default_workers
    from paratrain.data.samplers import ShardedEvalSampler
    from paratrain.data.transforms import eval_samples
    from paratrain.distributed.runtime import distributed
    from paratrain.engine.evaluate import evaluate as evaluate_model
    from paratrain.log import setup_logging
    from paratrain.models.registry import create_model

    setup_logging(env.rank, env.world_size)
    # this machine's device, not the training run's: a CUDA checkpoint evaluates on a CPU
    with distributed(env, opts.device, None, saved.timeout) as runtime:
        model = create_model(saved.model, len(split.classes), saved.train_size)
        model.load_state_dict(weights)
        model.to(runtime.device)
        dataset = eval_samples(split.val, saved.eval_crop, saved.eval_resize, saved.interpolation)
        workers = (
            opts.workers if opts.workers is not None else default_workers(env.local_world_size)
        )
        loader = DataLoader(
            dataset,
            batch_size=opts.batch_size,
            sampler=ShardedEvalSampler(len(dataset), runtime.rank, runtime.world_size),
            num_workers=workers,
        )
        result = evaluate_model(model, loader, runtime.device, len(split.classes), detailed=True)
        report = {**result.as_dict(), "world_size": runtime.world_size}
        if runtime.is_main:
            from paratrain.report.evaluation import write_evaluation

            out = write_evaluation(result.confusion, result.predictions, split, report_dir)
            report.update(
                per_class=dict(zip(split.classes, result.per_class_accuracy(), strict=True)),
                report_dir=str(out),
            )
        return report


def predict(opts: PredictOptions, say: Say = print) -> list[dict]:
    """Top-k classes of every image given (files, or folders searched for images)."""
    from paratrain.engine.predict import check_inputs, write_csv
    from paratrain.engine.predict import predict as predict_images

    opts.validate()
    if opts.dry_run:
        paths = check_inputs(opts.checkpoint, opts.inputs, opts.ema)
        say(f"would predict {len(paths)} image(s) with {opts.checkpoint} on {opts.device}")
        return []

    def tell(rows: list[dict]) -> None:  # as each batch is done, not all at the end
        for row in rows:
            say(f"{row['path']}: " + ", ".join(f"{name} {p:.3f}" for name, p in row["top"]))

    rows, unreadable = predict_images(
        opts.checkpoint, opts.inputs, opts.top_k, opts.batch_size, opts.device, opts.ema, tell
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
    """A checkpoint as a torch.export program or as safetensors, with its class names."""
    from paratrain.engine.export import default_output
    from paratrain.engine.export import export as export_model
    from paratrain.engine.predict import load_for_inference

    opts.validate()
    if opts.dry_run:
        load_for_inference(opts.checkpoint, _cpu(), opts.ema)
        target = opts.out or default_output(opts.checkpoint, opts.format, opts.ema)
        say(f"would write {target} from {opts.checkpoint}")
        return {}
    written = export_model(opts.checkpoint, opts.format, opts.out, opts.ema)
    say(f"wrote {written['export']} (classes in {written['class_indices']})")
    return written


def _cpu():
    import torch

    return torch.device("cpu")


# ---------------------------------------------------------------- runs, models


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
    """Step speed on synthetic data: the result on rank 0, else None. ``sweep_bytes``
    adds all-reduce timings up to that size, and ``result_file`` receives both as JSON
    (how `paratrain scale` collects the runs it launches)."""
    cfg.validate()
    opts.validate()
    env = detect(os.environ)
    _told_once(env, lambda: check_devices(cfg))
    world = cfg.nproc if env.source == "single" else env.world_size
    _told_once(env, lambda: check_model_input(cfg, world))
    if opts.dry_run:
        say(
            f"would time {opts.steps} steps (after {opts.warmup}) of {cfg.model} at "
            f"{cfg.image_size}px, batch {cfg.batch_size} x {cfg.nproc} process(es)"
        )
        return None
    argv = ["bench", *to_argv(cfg, BENCH_SETTINGS), *to_argv(opts)]
    result = launch_or_run(cfg.nproc, argv, lambda env: _bench_worker(cfg, opts, env))
    if result is not None and not opts.result_file:
        from paratrain.bench.step import format_result

        say(json.dumps(asdict(result)) if opts.json else format_result(result))
    return result


def _bench_worker(cfg: TrainConfig, opts: BenchOptions, env: DistEnv):
    from paratrain.bench.collectives import sweep_all_reduce
    from paratrain.bench.step import run_bench
    from paratrain.distributed.runtime import distributed

    with distributed(env, cfg.device, cfg.backend, cfg.timeout) as runtime:
        result = run_bench(cfg, runtime, opts.steps, opts.warmup)
        sweep = None
        if opts.sweep_bytes and runtime.world_size > 1:
            sweep = sweep_all_reduce(opts.sweep_bytes)
    if opts.result_file and result is not None:
        Path(opts.result_file).write_text(
            json.dumps({"bench": asdict(result), "all_reduce": sweep})
        )
    return result


def scale(cfg: TrainConfig, opts: ScaleOptions, say: Say = print) -> dict | None:
    """Measured and predicted scaling; writes the report under ``opts.out`` and returns
    it. With ``opts.calibrate`` (a CSV of n,seconds) nothing is measured here."""
    from paratrain.bench import costmodel
    from paratrain.bench import scale as scaling
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
        check_devices(cfg)
        settings = scaling.settings_from(opts)
        check_model_input(cfg, 1)  # scale measures one process too
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
    import torch

    from paratrain.bench import memory
    from paratrain.models.registry import check_input_size, create_model
    from paratrain.parallel.partition import optimizer_slots

    cfg.validate()
    opts.validate()
    limit = memory.parse_size(opts.device_memory)
    check_input_size(cfg.model, cfg.image_size)
    if opts.dry_run:
        say(
            f"would profile {cfg.model} at {cfg.image_size}px and plan batch {cfg.batch_size} "
            f"on {opts.devices} device(s) of {opts.device_memory}"
        )
        return None
    torch.manual_seed(0)
    net = create_model(cfg.model, opts.classes, cfg.image_size)
    rows = memory.estimate(
        net,
        cfg.image_size,
        cfg.batch_size,
        opts.devices,
        optimizer_slots(cfg.opt, cfg.momentum),
        cfg.microbatches,
        cfg.schedule,
        model_name=cfg.model,
    )
    choice, why = memory.recommend(rows, limit, opts.devices)
    result = {
        "model": cfg.model,
        "image_size": cfg.image_size,
        "batch_size": cfg.batch_size,
        "devices": opts.devices,
        "device_memory": limit,
        "rows": memory.as_dict(rows),
        "recommended": choice,
        "why": why,
    }
    if opts.json:
        say(json.dumps(result))
    else:
        heading = (
            f"{cfg.model} at {cfg.image_size}px, batch {cfg.batch_size} per device, "
            f"{cfg.opt}, fp32, {opts.devices} device(s) of {opts.device_memory}:"
        )
        say(memory.format_plan(rows, limit, opts.devices, choice, why, heading))
    return result


# ---------------------------------------------------------------- slurm, check


def slurm(job: SlurmOptions, cfg: TrainConfig, train_args: list[str], say: Say = print) -> int:
    """Print the sbatch script for ``paratrain train <train_args>``. The training flags
    get the checks `train --dry-run` makes that do not need the cluster's files: every
    value, every combination, the model at its image size."""
    from paratrain.distributed.slurm import sbatch_script
    from paratrain.models.registry import check_input_size

    job.validate()
    cfg.validate()
    check_input_size(cfg.model, cfg.image_size)
    say(sbatch_script(job, train_args).rstrip("\n"))
    return 0


def check(opts: CheckOptions, say: Say = print) -> int:
    """The self-test on ``opts.nproc`` processes; 0 when every check passed."""
    opts.validate()
    if opts.dry_run:
        say(f"would test collectives and bandwidth on {opts.nproc} process(es)")
        return 0
    code = launch_or_run(
        opts.nproc, ["check", *to_argv(opts)], lambda env: _check_worker(opts, env, say)
    )
    return 0 if code is None else code


def _check_worker(opts: CheckOptions, env: DistEnv, say: Say) -> int:
    from paratrain.bench.check import format_table, run_checks
    from paratrain.distributed.runtime import distributed

    with distributed(env, opts.device, opts.backend, opts.timeout) as runtime:
        if not runtime.backend:  # one process still exercises the collectives
            return _check_alone(runtime, opts.timeout, say)
        rows = run_checks(runtime)
    if env.is_main:
        say(format_table(rows))
    return 0 if all(r.ok for r in rows) else 1


def _check_alone(runtime, timeout_s: float, say: Say) -> int:
    import datetime

    import torch.distributed as dist

    from paratrain.bench.check import format_table, run_checks
    from paratrain.distributed.runtime import Runtime, choose_backend

    backend = choose_backend(runtime.device)
    store = dist.HashStore()
    dist.init_process_group(
        backend, store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        rows = run_checks(Runtime(env=runtime.env, device=runtime.device, backend=backend))
    finally:
        dist.destroy_process_group()
    say(format_table(rows))
    return 0 if all(r.ok for r in rows) else 1


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
