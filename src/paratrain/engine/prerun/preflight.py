"""Everything a run can be found wrong about before it trains, checked once.

The launcher (or the single process) runs these before it starts workers, so a mistake
is one line, once, and never N lines or a hang on other ranks: files and folders, the
data's layout, the weights, the packages an option needs, what the machine's devices
can run and the strategy's own rules. Launched workers find ``PARATRAIN_CHECKED`` set
and do not check these again. The model against its input size is checked where the
model's package is loaded anyway: by a launcher that starts no workers, else by the
workers before anything else (every rank finds the same; rank 0 tells it), so a
launcher does not load torchvision (a second) only to check a size.
"""

from __future__ import annotations

import importlib.util
import os

from paratrain.config import TrainConfig
from paratrain.distributed.env import DistEnv, detect
from paratrain.distributed.launch import CHECKED
from paratrain.errors import UserError
from paratrain.parallel.base import get as strategy_of
from paratrain.report.trackers.base import kind as tracker_kind
from paratrain.version import install_extra


def already_checked() -> bool:
    """Whether the launcher that started this process checked the run already."""
    return bool(os.environ.get(CHECKED))


def preflight(cfg: TrainConfig, world: int, model: bool = True) -> None:
    """What every rank would otherwise find wrong at once, checked here, for a job of
    ``world`` processes (``model``: the model against its input size too)."""
    from paratrain.data.folder import validation_side
    from paratrain.data.sources.base import offer, source_of
    from paratrain.engine.checkpointing.run_dir import check_run_dir_free

    check_settings(cfg, world)
    cfg.check_paths()
    check_run_dir_free(cfg)
    source = source_of(cfg)
    if not source.sharded:  # shards are listed by the nodes that read them
        listing = source.listing()
        validation_side(listing, source, cfg.val_fraction, cfg.split_seed)  # can split
        offer(source, listing)  # the run's processes read it rather than list again
    check_extras(cfg)
    check_trackers(cfg)
    if cfg.weights:  # named weights fetched here, once, before any worker starts
        from paratrain.models.registry import fetch_weights

        fetch_weights(cfg.model, cfg.weights)
    if cfg.teacher is not None and not source.sharded:
        check_teacher(cfg, len(listing.classes))
    check_devices(cfg, world)
    if model:
        check_model_input(cfg, world)


def check_teacher(cfg: TrainConfig, classes: int) -> None:
    """--teacher built once here, its weights read (fetched where named) and fitted to
    the data's classes, so that a wrong one is one line before any worker starts."""
    from paratrain.models.registry import build_teacher

    if cfg.teacher_weights is None:
        raise UserError(
            f"--teacher {cfg.teacher} needs --teacher-weights: a teacher of random weights "
            "teaches nothing"
        )
    build_teacher(cfg, classes)


def check_settings(cfg: TrainConfig, world: int | None, model: bool = False) -> None:
    """The rules of the chosen strategy (parallel/<name>.py), for ``world`` processes
    where known; with ``model``, the model against its image size too (what a job
    script checks before it is queued)."""
    if cfg.strategy != "auto":
        strategy_of(cfg.strategy).check_settings(cfg, world)
    if model:
        from paratrain.models.registry import check_input_size

        check_input_size(cfg.model, cfg.image_size)


# settings that need a package besides paratrain's own: (module, paratrain's extra, when)
EXTRAS = (
    ("timm", "timm", lambda cfg: cfg.model.startswith("timm/"), "--model timm/..."),
    ("timm", "timm", lambda cfg: cfg.opt in ("lars", "lamb"), "--opt lars and lamb"),
    ("nvidia.dali", "dali", lambda cfg: cfg.loader == "dali", "--loader dali"),
)


def check_extras(cfg: TrainConfig) -> None:
    """An option whose package is not installed: one line naming what to install (a
    tracker's package and extra are its registry entry's)."""
    needed = [(module, extra, what) for module, extra, wanted, what in EXTRAS if wanted(cfg)]
    for name in cfg.loggers:
        tracker = tracker_kind(name)
        if tracker.package is not None and tracker.extra is not None:
            needed.append((tracker.package, tracker.extra, f"--logger {name}"))
    for module, extra, what in needed:
        if not _installed(module):
            raise UserError(f"{what} needs the {module} package: {install_extra(extra)}")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package (nvidia. of nvidia.dali) is absent
        return False


def check_trackers(cfg: TrainConfig) -> None:
    """Every tracker's server reached once, within --tracker-timeout: one that does not
    answer is one line (--on-tracker-error fail), or is left out of the run, said once
    (warn; the run's processes inherit which, report/loggers.DOWN)."""
    from paratrain.log import get_logger
    from paratrain.report.loggers import DOWN, unreachable

    found = unreachable(cfg.loggers, cfg.tracker_timeout)
    if found and cfg.on_tracker_error == "fail":
        name, why = next(iter(found.items()))
        raise UserError(f"--logger {name}: {why} (--on-tracker-error warn trains without it)")
    for name, why in found.items():
        get_logger().warning(f"--logger {name}: {why}; training without it")
    if found:
        os.environ[DOWN] = ",".join(found)


def check_devices(cfg: TrainConfig, world: int) -> None:
    """Options this machine's devices cannot run, refused once here, not by every rank."""
    import torch

    from paratrain.distributed.runtime import choose_device, resolve_precision, runs_on_cuda

    if cfg.device is not None:
        choose_device(DistEnv(), cfg.device)  # a CUDA device this machine lacks: one line
    cuda = runs_on_cuda(cfg.device)
    if cfg.strategy != "auto":
        strategy_of(cfg.strategy).check_machine(cfg, world)
    if cuda:
        gpus = torch.cuda.device_count()
        if cfg.nproc != "auto" and cfg.nproc > gpus and cfg.device in (None, "cuda"):
            raise UserError(
                f"--nproc {cfg.nproc} needs {cfg.nproc} GPUs and this machine has {gpus}: "
                f"NCCL cannot run two ranks on one GPU; use --nproc {gpus}, or --device cpu "
                "(gloo on the CPU)"
            )
        return
    resolve_precision(cfg.precision, torch.device("cpu"))  # 16-mixed: the one-line error
    if cfg.backend == "nccl":
        raise UserError("--backend nccl needs CUDA devices; use gloo on CPU")


def check_model_input(cfg: TrainConfig, world: int) -> None:
    """The model takes the training and validation sizes, and no BatchNorm layer sees a
    single image at once (how many it sees is the strategy's to say)."""
    import torch

    from paratrain.distributed.runtime import runs_on_cuda
    from paratrain.models.registry import check_model_input as check

    gpus = torch.cuda.device_count() if runs_on_cuda(cfg.device) else 0
    if cfg.strategy == "auto":  # decided later; a batch of 2 at least takes the sizes
        check(cfg, 2)
    else:
        check(cfg, strategy_of(cfg.strategy).norm_batch(cfg, world, gpus))


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


def job_world(cfg: TrainConfig, env: DistEnv | None = None) -> int:
    """The processes the job will have: --nproc when this process launches them, else
    the launcher's (torchrun, srun)."""
    env = env or detect(os.environ)
    if env.source == "single" and cfg.nproc != "auto":
        return max(cfg.nproc, 1)
    return env.world_size
