"""The public entry points: what the CLI calls, callable from Python too."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from paratrain.config import TrainConfig
from paratrain.data.builtin import ensure_digits
from paratrain.data.folder import build_split
from paratrain.distributed.env import detect
from paratrain.errors import UserError

# The embedded default: 8x8 digit scans need neither 224 pixels nor strong crops, and a
# mirrored digit is another digit. Measured on 2 CPU cores, --nproc 2: about 2 minutes,
# 95-97% validation top-1.
DIGITS_PRESET = {
    "model": "resnet18",
    "image_size": 16,
    "epochs": 8,
    "batch_size": 32,
    "lr": 0.02,
    "crop_scale_min": 0.7,
    "hflip": 0.0,
    "warmup_epochs": 1,
}


# What AdamW is usually run with (timm, torchvision's ViT recipes use similar values).
ADAMW_DEFAULTS = {"lr": 0.001, "weight_decay": 0.05}


def require_tensorboard() -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise UserError(
            "--tensorboard needs the tensorboard package: pip install tensorboard"
        ) from None


def resolve(values: dict) -> tuple[TrainConfig, bool]:
    """Build the config from user values; with no --data, fill in the digits preset.

    Returns the config and whether the embedded default data set is used. Values the user
    gave always win over the preset.
    """
    builtin = not values.get("data")
    given = values
    if builtin:
        values = {**DIGITS_PRESET, **values}
    if given.get("opt") == "adamw":  # SGD's learning rate would be far too large for AdamW
        values = {**values, **ADAMW_DEFAULTS, **given}
    cfg = TrainConfig.from_dict(values, source="arguments").validate()
    if cfg.tensorboard:
        require_tensorboard()
    if builtin:
        cfg.data = str(ensure_digits(cfg.cache_dir))
    return cfg, builtin


def preflight(cfg: TrainConfig) -> None:
    """Check, in one process, what every rank would otherwise find wrong at once.

    The model name is not checked here: that needs torchvision, seconds of start-up
    before any worker starts. Every rank builds the same model, so a bad name fails on
    every rank alike, and rank 0 alone reports it."""
    build_split(cfg.data, cfg.val_fraction, cfg.split_seed)
    if cfg.weights:
        from paratrain.models.registry import read_state_dict  # torchvision: 0.8 s to import

        read_state_dict(cfg.weights)
    if cfg.resume and cfg.resume != "auto" and not Path(cfg.resume).is_file():
        raise UserError(f"--resume: checkpoint not found: {cfg.resume}")


def train(config: TrainConfig, argv: Sequence[str] | None = None) -> dict | None:
    """Train as configured: launch ``config.nproc`` workers, or be one.

    Returns the run summary in the process that trained (rank 0's view), None in a
    launcher process, whose workers report through the run directory.
    """
    config.validate()
    if config.tensorboard:
        require_tensorboard()
    env = detect(os.environ)
    _check_device_options(config)
    if config.strategy == "dp":
        from paratrain.parallel.dp import check_available

        check_available(env.world_size)
    if config.nproc > 1 and env.source == "single":
        from paratrain.distributed.launch import launch

        preflight(config)
        if not config.name and not config.resume:
            # restarted workers must find this run again, so its name is fixed up front
            config.name = time.strftime("%Y%m%d-%H%M%S")
            argv = [*argv, "--name", config.name] if argv is not None else None
        config_file = None if argv is not None else _argv_for(config)
        try:
            code = launch(
                config.nproc,
                argv if argv is not None else config_file,
                max_restarts=config.max_restarts,
                master_port=config.master_port,
            )
        finally:
            if config_file is not None:
                Path(config_file[-1]).unlink(missing_ok=True)
        if code:
            raise SystemExit(code)
        return None
    return _train_worker(config, env)


def _check_device_options(config: TrainConfig) -> None:
    """Options that need CUDA, refused once here rather than by every rank."""
    import torch

    on_cpu = config.device == "cpu" or not torch.cuda.is_available()
    if not on_cpu:
        return
    if config.precision == "16-mixed":
        from paratrain.engine.precision import resolve

        resolve(config.precision, torch.device("cpu"))  # raises the one-line error
    if config.grad_compression == "powersgd":
        from paratrain.parallel.ddp import POWERSGD_NEEDS_NCCL

        raise UserError(POWERSGD_NEEDS_NCCL)


def _train_worker(config: TrainConfig, env) -> dict:
    from paratrain.distributed.runtime import distributed
    from paratrain.engine.trainer import fit
    from paratrain.log import setup_logging

    setup_logging(env.rank, env.world_size)
    with distributed(env, config.device, config.backend, config.timeout) as runtime:
        return fit(config, runtime)


def _argv_for(config: TrainConfig) -> list[str]:
    """Worker arguments for a config built in Python: it travels as a YAML file."""
    import tempfile

    handle = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="paratrain-", delete=False)
    with handle:
        config.save(Path(handle.name))
    return ["train", "--config", handle.name]


def evaluate_checkpoint(
    checkpoint_path: str,
    data: str | None,
    batch_size: int = 64,
    workers: int | None = None,
    nproc: int = 1,
    argv: Sequence[str] | None = None,
    ema: bool = False,
) -> dict | None:
    """Evaluate a checkpoint on a data folder's validation part, at any world size."""
    from paratrain.engine import checkpoint
    from paratrain.engine.predict import weights_of

    if batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    env = detect(os.environ)
    state = checkpoint.load(checkpoint_path)
    saved = TrainConfig.from_dict(state["config"], source=checkpoint_path)
    data_dir = data or saved.data
    if not data_dir:
        raise UserError("--data is needed: the checkpoint does not name its data")
    split = build_split(data_dir, saved.val_fraction, saved.split_seed)
    if split.classes != state["classes"]:
        raise UserError(
            f"classes of {data_dir} ({len(split.classes)}) differ from the checkpoint's "
            f"({len(state['classes'])}): {split.classes[:5]} vs {state['classes'][:5]}"
        )
    weights = weights_of(state, checkpoint_path, ema)
    if nproc > 1 and env.source == "single":
        from paratrain.distributed.launch import launch

        code = launch(nproc, list(argv or []))
        if code:
            raise SystemExit(code)
        return None
    report_dir = _eval_dir(checkpoint_path, "-ema" if ema else "")
    return _evaluate_worker(weights, saved, split, batch_size, workers, env, report_dir)


def _eval_dir(state_path: str, suffix: str = "") -> Path:
    """<run>/eval for a checkpoint inside a run directory, else eval-<name> beside it."""
    from paratrain.engine.checkpoint import run_dir_of

    path, run = Path(state_path), run_dir_of(state_path)
    return run / f"eval{suffix}" if run else path.parent / f"eval-{path.stem}{suffix}"


def _evaluate_worker(
    weights, saved: TrainConfig, split, batch_size, workers, env, report_dir: Path
) -> dict:
    from torch.utils.data import DataLoader

    from paratrain.data.loaders import default_workers
    from paratrain.data.samplers import ShardedEvalSampler
    from paratrain.data.transforms import eval_samples
    from paratrain.distributed.runtime import distributed
    from paratrain.engine.evaluate import evaluate
    from paratrain.log import setup_logging
    from paratrain.models.registry import create_model

    setup_logging(env.rank, env.world_size)
    with distributed(env, saved.device, saved.backend, saved.timeout) as rt:
        model = create_model(saved.model, len(split.classes), saved.image_size)
        model.load_state_dict(weights)
        model.to(rt.device)
        dataset = eval_samples(split.val, saved.image_size)
        n_workers = workers if workers is not None else default_workers(env.local_world_size)
        loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=ShardedEvalSampler(len(dataset), rt.rank, rt.world_size),
            num_workers=n_workers,
        )
        result = evaluate(model, loader, rt.device, len(split.classes), detailed=True)
        report = {**result.as_dict(), "world_size": rt.world_size}
        if rt.is_main:
            from paratrain.report.evaluation import write_evaluation

            out = write_evaluation(result.confusion, result.predictions, split, report_dir)
            report.update(
                per_class=dict(zip(split.classes, result.per_class_accuracy(), strict=True)),
                report_dir=str(out),
            )
        return report


def bench(
    config: TrainConfig,
    steps: int = 20,
    warmup: int = 5,
    argv: Sequence[str] | None = None,
    sweep_bytes: int = 0,
    result_file: str | None = None,
):
    """`paratrain bench`: step speed on synthetic data; the result on rank 0, else None.

    ``sweep_bytes`` adds all-reduce timings up to that message size, and ``result_file``
    receives both as JSON (how `paratrain scale` collects its launched runs)."""
    if steps < 1 or warmup < 0:
        raise UserError(f"--steps must be at least 1 and --warmup 0 or more, got {steps}, {warmup}")
    config.validate()
    env = detect(os.environ)
    _check_device_options(config)
    if config.nproc > 1 and env.source == "single":
        from paratrain.distributed.launch import launch

        code = launch(config.nproc, list(argv or []))
        if code:
            raise SystemExit(code)
        return None
    from paratrain.bench.collectives import sweep_all_reduce
    from paratrain.bench.step import run_bench
    from paratrain.distributed.runtime import distributed

    with distributed(env, config.device, config.backend, config.timeout) as rt:
        result = run_bench(config, rt, steps, warmup)
        sweep = sweep_all_reduce(sweep_bytes) if sweep_bytes and rt.world_size > 1 else None
    if result_file and result is not None:
        Path(result_file).write_text(json.dumps({"bench": asdict(result), "all_reduce": sweep}))
    return result


def scale(
    config: TrainConfig, options, out: str | Path, calibrate: str | Path | None = None, say=print
) -> dict:
    """`paratrain scale`: measured and predicted scaling; writes the report under ``out``
    and returns it. With ``calibrate`` (a CSV of n,seconds) nothing is measured here."""
    from paratrain.bench import costmodel
    from paratrain.bench import scale as scaling
    from paratrain.report.scaling import format_calibration, format_measured, write_report

    if calibrate is not None:
        points = scaling.read_epoch_times(Path(calibrate))
        report = scaling.calibration_report(costmodel.calibrate(points), options.max_n)
        text = format_calibration(report, str(calibrate))
    else:
        config.validate()
        _check_device_options(config)
        if detect(os.environ).source != "single":
            raise UserError(
                "`paratrain scale` starts its own processes; run it outside torchrun and srun"
            )
        profile, rows, samples = scaling.measure(config, options, say=say)
        report = scaling.report(config, options, profile, rows, samples)
        text = format_measured(report)
    paths = write_report(report, Path(out))
    say(text)
    say("wrote " + ", ".join(str(p) for p in paths))
    return report


def plan(
    model: str,
    image_size: int,
    batch_size: int,
    device_memory: str,
    devices: int = 2,
    opt: str = "sgd",
    microbatches: int = 4,
    schedule: str = "1f1b",
    classes: int = 1000,
    momentum: float = 0.9,
    say=print,
) -> dict:
    """`paratrain plan`: per-device memory of each strategy; which fit; the recommendation."""
    import torch

    from paratrain.bench import memory
    from paratrain.models.registry import create_model
    from paratrain.parallel.partition import optimizer_slots

    limit = memory.parse_size(device_memory)
    torch.manual_seed(0)
    net = create_model(model, classes, image_size)
    rows = memory.estimate(net, image_size, batch_size, devices,
                           optimizer_slots(opt, momentum), microbatches, schedule,
                           model_name=model)  # fmt: skip
    choice, why = memory.recommend(rows, limit, devices)
    heading = (f"{model} at {image_size}px, batch {batch_size} per device, {opt}, fp32, "
               f"{devices} device(s) of {device_memory}:")  # fmt: skip
    say(memory.format_plan(rows, limit, devices, choice, why, heading))
    return {"model": model, "image_size": image_size, "batch_size": batch_size,
            "devices": devices, "device_memory": limit, "rows": memory.as_dict(rows),
            "recommended": choice, "why": why}  # fmt: skip


def check(
    nproc: int = 2,
    backend: str | None = None,
    device: str | None = None,
    timeout_s: float = 120.0,
    argv: Sequence[str] | None = None,
) -> int:
    """`paratrain check`: run the self-test on ``nproc`` processes; 0 when all passed."""
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    env = detect(os.environ)
    if env.source == "single":
        from paratrain.distributed.launch import launch

        return launch(nproc, list(argv if argv is not None else ["check"]))
    from paratrain.bench.check import format_table, run_checks
    from paratrain.distributed.runtime import distributed

    with distributed(env, device, backend, timeout_s) as rt:
        if not rt.backend:  # one process still exercises the collectives, on a 1-rank group
            return _check_alone(rt, timeout_s)
        rows = run_checks(rt)
    if env.is_main:
        print(format_table(rows))
    return 0 if all(r.ok for r in rows) else 1


def _check_alone(rt, timeout_s: float) -> int:
    import datetime

    import torch.distributed as dist

    from paratrain.bench.check import format_table, run_checks
    from paratrain.distributed.runtime import Runtime, choose_backend

    backend = choose_backend(rt.device)
    store = dist.HashStore()
    dist.init_process_group(
        backend, store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=timeout_s)
    )
    try:
        rows = run_checks(Runtime(env=rt.env, device=rt.device, backend=backend))
    finally:
        dist.destroy_process_group()
    print(format_table(rows))
    return 0 if all(r.ok for r in rows) else 1
