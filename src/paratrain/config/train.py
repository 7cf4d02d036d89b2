"""TrainConfig: every setting of a training run, declared once, and the presets.

The same settings arrive from flags, from a YAML file (``--config``, or a run's own
``config.yaml``) or from Python; ``resolve_train`` turns what the user gave into the
config: presets fill only what was not given (by flag or by file alike), then every
value and every cross-field rule is checked before any work.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from paratrain.config.schema import (
    Options,
    build,
    check_paths,
    coerce_all,
    looks_like_file,
    read_yaml,
    setting,
)
from paratrain.errors import UserError

OPTIMIZERS = ("sgd", "adamw", "lars", "lamb")
STRATEGIES = "paratrain.parallel:STRATEGIES"  # the registry of --strategy's names

DEVICE = r"cpu|cuda(:\d{1,3})?"
DEVICE_TEXT = "cpu, cuda or cuda:N"
RUN_NAME = r"[^/\\\0]+"  # one folder name: no separators
NAME_MAX = 255  # bytes in a file name (Linux's NAME_MAX)
MAX_IMAGE_SIZE = 4096
INTERPOLATIONS = ("bilinear", "bicubic")  # how images are resized
TIMM_PREFIX = "timm/"  # --model timm/<name>: a timm model
DURATION = r"(\d+(\.\d+)?[smh])+"  # 90s, 15m, 2h, 1h30m
TRACKERS = "paratrain.report.trackers:TRACKERS"  # the registry of --logger's names
SCORES = "paratrain.report.scores:SUMMARIES"  # the registry of --monitor's names
CACHE_MODES = "paratrain.data.cache:MODES"  # --cache's words: the cache kinds and more
NUMBERS3 = r"\s*[0-9.eE+-]+\s*,\s*[0-9.eE+-]+\s*,\s*[0-9.eE+-]+\s*"  # R,G,B
# what a named --weights brings (mean, std, sizes, interpolation): its registry's
# metadata, read by the models package (config never imports it)
WEIGHTS_PREPROCESSING = "paratrain.models.pretrained:preprocessing"
SMALL_IMAGES = "paratrain.data.sizes:suggested_size"  # the size a folder's images suggest
SMALL_IMAGES_WHY = "paratrain.data.sizes:why"
MAX_SECONDS = 30 * 24 * 3600  # a time limit longer than this is a mistake (and overflows)


@dataclass
class TrainConfig(Options):
    # data
    data: str | None = setting(
        None,
        "the images: a folder DIR/<class>/* or DIR/{train,val}/<class>/*; a Hugging Face "
        "dataset, hf:NAME or a save_to_disk/parquet folder; WebDataset shards, "
        "wds:PATTERN (local paths or URLs, {000..099} expands); a CSV listing, csv:FILE.csv "
        "(an image path and its class a row)",
        group="data",
        path="data",
        metavar="DATA",
        default_text="the embedded digits set",
        resume="quiet",
    )
    data_split: str | None = setting(
        None,
        "the dataset split to train on (hf: and dataset folders)",
        group="data",
        metavar="NAME",
        default_text="train",
        resume="fixed",
        resume_why="the train/val split would change",
    )
    val_split: str | None = setting(
        None,
        "the validation split: a dataset split's name (hf:), or a shard pattern (wds:)",
        group="data",
        metavar="NAME",
        default_text="validation/valid/val/test where the dataset has one, else "
        "--val-fraction of the training data",
        resume="fixed",
        resume_why="the train/val split would change",
    )
    image_column: str | None = setting(
        None,
        "the dataset column holding the images (hf: and dataset folders)",
        group="data",
        metavar="NAME",
        default_text="the column of Image type",
        resume="fixed",
        resume_why="the images would change",
    )
    label_column: str | None = setting(
        None,
        "the dataset column holding the labels (hf: and dataset folders)",
        group="data",
        metavar="NAME",
        default_text="the ClassLabel column, else label/labels/target/class",
        resume="fixed",
        resume_why="the labels would change",
    )
    val_fraction: float = setting(
        0.2,
        "share of each class held out for validation",
        group="data",
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
        resume="fixed",
        resume_why="the train/val split would change",
    )
    split_seed: int = setting(
        0,
        "seed of the train/val split",
        group="data",
        low=0,
        high=2**32 - 1,
        resume="fixed",
        resume_why="the train/val split would change",
    )
    image_size: int = setting(
        224, "training crop size in pixels", group="data", low=8, high=MAX_IMAGE_SIZE
    )
    crop_scale_min: float = setting(
        0.08,
        "smallest area share of RandomResizedCrop",
        group="data",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    hflip: float = setting(0.5, "horizontal flip probability", group="data", low=0.0, high=1.0)
    workers: int | None = setting(
        None,
        "loader processes per rank",
        group="data",
        short="-j",
        low=0,
        high=64,
        default_text="from the cores",
        resume="quiet",
    )
    train_crop: int | None = setting(
        None,
        "training crop in pixels, where it differs from --image-size",
        group="data",
        low=8,
        high=MAX_IMAGE_SIZE,
        default_text="--image-size",
    )
    val_resize: int | None = setting(
        None,
        "validation images' short side before the center crop",
        group="data",
        low=8,
        high=MAX_IMAGE_SIZE,
        default_text="val crop x 256/224",
    )
    val_crop: int | None = setting(
        None,
        "validation center crop in pixels; above the training size it evaluates at a higher "
        "resolution than training (FixRes: objects look larger after RandomResizedCrop)",
        group="data",
        low=8,
        high=MAX_IMAGE_SIZE,
        default_text="--image-size",
        aliases=("--val-size",),
    )
    progressive: str | None = setting(
        None,
        "progressive resizing START:END: train at START pixels for most of the run, rising "
        "to END over its later epochs (FFCV's shape; batch and lr unchanged)",
        group="data",
        pattern=r"\d+:\d+",
        pattern_text="two sizes in pixels, START:END",
        metavar="START:END",
        resume="fixed_mid_epoch",
    )
    monitor: str = setting(
        "top1",
        "the validation score that picks best.pt (report/scores)",
        group="data",
        choices_from=SCORES,
        resume="quiet",
    )
    tta: str = setting(
        "none",
        "test-time augmentation in evaluation: flip averages each image's logits with its mirror's",
        group="data",
        choices=("none", "flip"),
    )
    interpolation: str = setting(
        "bilinear",
        "how images are resized",
        group="data",
        choices=INTERPOLATIONS,
        default_text="the weights', else bilinear",
    )
    mean: str | None = setting(
        None,
        "per-channel mean the images are normalised with, R,G,B in 0..1",
        group="data",
        pattern=NUMBERS3,
        pattern_text="three numbers separated by commas",
        default_text="the weights', else ImageNet's 0.485,0.456,0.406",
    )
    std: str | None = setting(
        None,
        "per-channel standard deviation the images are normalised with, R,G,B",
        group="data",
        pattern=NUMBERS3,
        pattern_text="three numbers separated by commas",
        default_text="the weights', else ImageNet's 0.229,0.224,0.225",
    )
    bad_images: str = setting(
        "error",
        "unreadable images: list them all and stop, or leave them out",
        group="data",
        choices=("error", "skip"),
        resume="quiet",
    )
    cache: str = setting(
        "auto",
        "decode every image once, resized, onto local disk, as one of the cache kinds",
        group="data",
        choices_from=CACHE_MODES,
        resume="quiet",
    )
    cache_max_gb: float = setting(
        4.0,
        "memory budget of raw cached pixels in auto mode (beyond it: packed JPEG)",
        group="data",
        low=0.0,
        low_open=True,
        resume="quiet",
    )
    augment_on: str = setting(
        "auto",
        "where training images are cropped, resized, flipped and normalised (and, without the "
        "cache, JPEGs decoded where that is faster): on the model's device, or in the loader "
        "on the CPU; auto: the loader, except JPEGs decoded on a GPU where measured faster",
        group="data",
        choices=("auto", "device", "cpu"),
    )
    cache_dir: str | None = setting(
        None,
        "where the decoded cache and the embedded data set are written",
        group="data",
        metavar="DIR",
        default_text="~/.cache/paratrain",
        resume="quiet",
    )
    # model
    model: str = setting(
        "resnet18",
        "torchvision model name (see `paratrain models`)",
        group="model",
        pattern=r"[A-Za-z0-9_./-]+",
        pattern_text="a model name (see `paratrain models`)",
        resume="fixed",
        resume_why="its weights belong to another architecture",
    )
    weights: str | None = setting(
        None,
        "weights to start from: a name from torchvision's weights registry (IMAGENET1K_V1, "
        "ResNet50_Weights.IMAGENET1K_V2; pretrained: the model's best) or, for "
        "timm/<model>, pretrained or a tag (a1_in1k), fetched once into the hub caches; "
        "or a local state dict or paratrain checkpoint. Tensors that do not fit (the "
        "head) are left out and reported",
        group="model",
        path="weights",
        metavar="NAME|FILE",
        resume="quiet",
    )
    weights_strict: bool = setting(
        False,
        "any key or shape mismatch in --weights is an error",
        group="model",
        resume="quiet",
    )
    freeze_backbone: bool = setting(
        False,
        "train only the classifier head (fc / classifier / head); use with --weights",
        group="model",
        resume="fixed",
        resume_why="its optimizer state covers other parameters",
    )
    freeze_epochs: int = setting(
        0,
        "train only the classifier head for the first K epochs (the backbone's BatchNorm "
        "statistics kept), then everything",
        group="model",
        low=0,
    )
    head_lr_mult: float = setting(
        1.0,
        "the classifier head's learning rate, as a multiple of the others'",
        group="model",
        low=0.0,
        low_open=True,
        resume="fixed",
        resume_why="its optimizer's parameter groups follow it",
    )
    layer_decay: float | None = setting(
        None,
        "layer-wise learning-rate decay: each block's rate is this times the next one's, "
        "from the head down to the stem (e.g. 0.75 for ViTs and ConvNeXts)",
        group="model",
        low=0.0,
        high=1.0,
        low_open=True,
        resume="fixed",
        resume_why="its optimizer's parameter groups follow it",
    )
    # optimisation
    epochs: int = setting(10, "passes over the training images", group="optimisation", low=1)
    max_steps: int | None = setting(
        None,
        "stop after this many optimizer steps, with an evaluation and a checkpoint (a quick "
        "smoke run, as Lightning's fast_dev_run)",
        group="optimisation",
        low=1,
    )
    limit_val_batches: int | None = setting(
        None,
        "evaluate on only the first N batches of each rank's validation shard (a smoke run: "
        "not every image, so not the exact figure)",
        group="optimisation",
        low=1,
    )
    budget: str | None = setting(
        None,
        "wall-clock to train in (90s, 15m, 2h, 1h30m), from the command's start: the "
        "schedule is fitted to it from the measured step, evaluation and save times, and "
        "the run ends on time with a last evaluation and checkpoint (--epochs: ignored)",
        group="optimisation",
        pattern=DURATION,
        pattern_text="a duration such as 90s, 15m, 2h or 1h30m",
        metavar="DURATION",
    )
    budget_recipe: str = setting(
        "auto",
        "with --budget, the resolution: low-res trains at 5/8 of the size and evaluates at "
        "3/4, twice the batch at the same learning rate (more epochs in the time: sooner to "
        "a good model in short runs); auto chooses it when fewer than 10 epochs at the sizes "
        "as given fit (timed on a few synthetic steps), from scratch and with no size set "
        "(--train-crop, --val-size, --progressive); fixed keeps the sizes as given",
        group="optimisation",
        choices=("auto", "low-res", "fixed"),
    )
    batch_size: int | Literal["auto"] = setting(
        16,
        "per process; the global batch is this x world size; auto: the largest that fits the "
        "device's memory (a multiple of 8)",
        group="optimisation",
        low=1,
        auto=True,
        short="-b",
    )
    lr: float | Literal["auto"] | None = setting(
        None,
        "peak learning rate, used as given at any world size (timm's --lr); unset: "
        "--lr-base scaled with the global batch; auto: a range test picks it (its curve in "
        "the run folder)",
        group="optimisation",
        low=0.0,
        low_open=True,
        auto=True,
        default_text="from --lr-base",
    )
    lr_base: float = setting(
        0.16,
        "the peak rate for a global batch of --lr-base-size, scaled linearly with the "
        "global batch (batch size x world size x --grad-accum) when --lr is not given",
        group="optimisation",
        low=0.0,
        low_open=True,
    )
    lr_base_size: int = setting(
        256, "the global batch --lr-base is for", group="optimisation", low=1
    )
    lrf: float = setting(
        0.1, "final lr as a fraction of lr", group="optimisation", low=0.0, high=1.0
    )
    momentum: float = setting(
        0.9, "SGD momentum", group="optimisation", low=0.0, high=1.0, high_open=True
    )
    weight_decay: float = setting(
        0.005, "L2 penalty (decoupled for adamw)", group="optimisation", low=0.0
    )
    sched: str = setting(
        "cosine",
        "learning-rate schedule, updated every step: cosine to lr x lrf; step (x --lr-gamma "
        "every --lr-step-size epochs); multistep (x --lr-gamma at each --lr-milestones epoch); "
        "constant",
        group="optimisation",
        choices=("cosine", "step", "multistep", "constant"),
    )
    lr_step_size: int = setting(30, "step: epochs between decays", group="optimisation", low=1)
    lr_gamma: float = setting(
        0.1,
        "step, multistep: the factor of each decay",
        group="optimisation",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    lr_milestones: str | None = setting(
        None,
        "multistep: comma-separated epochs at which the rate decays (e.g. 30,60,80)",
        group="optimisation",
        pattern=r"\d+(,\d+)*",
        pattern_text="epochs separated by commas",
    )
    warmup_epochs: int = setting(0, "linear warm-up epochs", group="optimisation", low=0)
    warmup_steps: int = setting(
        0, "linear warm-up in steps instead of epochs", group="optimisation", low=0
    )
    warmup_start: float = setting(
        0.01,
        "the warm-up starts at this fraction of the peak rate",
        group="optimisation",
        low=0.0,
        high=1.0,
    )
    seed: int = setting(
        0,
        "seed of weights and sampling",
        group="optimisation",
        low=0,
        high=2**32 - 1,
        resume="fixed_mid_epoch",
    )
    # recipe
    opt: str = setting(
        "sgd",
        "optimizer; adamw and lamb bring lr 0.001 and weight decay 0.05 unless given; lars "
        "and lamb (layer-wise rates for large batches) are timm's (the extra paratrain[timm])",
        group="recipe",
        choices=OPTIMIZERS,
        resume="fixed",
        resume_why="its optimizer state belongs to another optimizer",
    )
    norm_weight_decay: float | None = setting(
        None,
        "weight decay of normalisation layers' weights and biases (0: none, as the "
        "large-batch recipes do)",
        group="recipe",
        low=0.0,
        default_text="--weight-decay",
    )
    bias_weight_decay: float | None = setting(
        None,
        "weight decay of the other layers' biases",
        group="recipe",
        low=0.0,
        default_text="--weight-decay",
    )
    auto_augment: str = setting(
        "none",
        "an augmentation policy after crop and flip (torchvision's): TrivialAugmentWide, "
        "RandAugment (--ra-ops, --ra-magnitude), AutoAugment's ImageNet policy, AugMix",
        group="recipe",
        choices=("none", "trivialaugment", "randaugment", "autoaugment", "augmix"),
    )
    ra_ops: int = setting(2, "RandAugment: operations per image", group="recipe", low=1, high=14)
    ra_magnitude: int = setting(
        9, "RandAugment: magnitude of every operation", group="recipe", low=0, high=30
    )
    augmix_severity: int = setting(
        3, "AugMix: severity of its operations", group="recipe", low=1, high=10
    )
    random_erase: float = setting(
        0.0,
        "probability of erasing a random rectangle of each image",
        group="recipe",
        low=0.0,
        high=1.0,
    )
    ra_reps: int = setting(
        1,
        "repeated augmentation: an epoch's images come K times each, differently augmented "
        "and on different ranks (the epoch keeps its length: 1/K of the images, K times)",
        group="recipe",
        low=1,
        high=16,
        resume="fixed_mid_epoch",
    )
    label_smoothing: float = setting(
        0.0, "cross-entropy label smoothing", group="recipe", low=0.0, high=1.0, high_open=True
    )
    ema_decay: float | None = setting(
        None,
        "keep an exponential moving average of the "
        "weights with this decay (e.g. 0.999), evaluated every "
        "epoch and saved beside the raw weights",
        group="recipe",
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
    )
    mixup: float = setting(0.0, "MixUp Beta alpha, e.g. 0.2 (0: off)", group="recipe", low=0.0)
    cutmix: float = setting(0.0, "CutMix Beta alpha, e.g. 1.0 (0: off)", group="recipe", low=0.0)
    # speed
    precision: str = setting(
        "auto",
        "auto: bf16 autocast where the device computes bf16 "
        "natively (CUDA with bf16, CPUs with AVX512-BF16/AMX), else fp32; "
        "16-mixed: fp16 with a GradScaler, CUDA only",
        group="speed",
        choices=("auto", "32", "bf16-mixed", "16-mixed"),
    )
    grad_accum: int = setting(
        1,
        "micro-batches per optimizer step; the global batch and the lr scaling count them",
        group="speed",
        low=1,
    )
    clip_grad: float | None = setting(
        None, "clip the total gradient norm to this value", group="speed", low=0.0, low_open=True
    )
    grad_compression: str = setting(
        "none",
        "compress gradients for communication with a DDP hook (powersgd needs nccl)",
        group="speed",
        choices=("none", "fp16", "bf16", "powersgd"),
        resume="quiet",
    )
    bucket_cap_mb: float = setting(
        25.0,
        "DDP gradient bucket size in MB",
        group="speed",
        low=0.0,
        low_open=True,
        resume="quiet",
    )
    memory_format: str = setting(
        "auto",
        "auto: channels_last for convolutional models",
        group="speed",
        choices=("auto", "channels_last", "contiguous"),
        resume="quiet",
    )
    compile: bool = setting(
        False,
        "torch.compile the model (around DDP, so its graphs split at "
        "the gradient buckets); the first steps compile",
        group="speed",
        resume="quiet",
    )
    # parallelism
    nproc: int | Literal["auto"] = setting(
        1,
        "processes to start on this machine; auto: one per GPU, or on a CPU the layout "
        "measured faster here",
        group="parallelism",
        low=1,
        auto=True,
        resume="quiet",
    )
    strategy: str = setting(
        "ddp",
        "how the model is spread over processes and devices; auto: the fastest that fits "
        "the device memory (see `paratrain plan`)",
        group="parallelism",
        choices_from=STRATEGIES,
        auto=True,
        resume="quiet",
    )
    devices: str | None = setting(
        None,
        "split: comma-separated devices, one stage each (cuda:0,cuda:1 or cpu,cpu)",
        group="parallelism",
        resume="quiet",
    )
    stages: int = setting(
        2, "pipeline: stages per model", group="parallelism", low=2, high=1024, resume="quiet"
    )
    microbatches: int = setting(
        4,
        "pipeline: micro-batches per batch (must divide --batch-size)",
        group="parallelism",
        low=1,
        resume="quiet",
    )
    schedule: str = setting(
        "1f1b",
        "pipeline schedule",
        group="parallelism",
        choices=("gpipe", "1f1b"),
        resume="quiet",
    )
    split_points: str | None = setting(
        None,
        "split, pipeline: comma-separated units where stages 2.. begin (e.g. layer3,layer4)",
        group="parallelism",
        default_text="balanced from measured time",
        resume="quiet",
    )
    sync_bn: bool = setting(
        False, "synchronise BatchNorm statistics across processes", group="parallelism"
    )
    backend: str | None = setting(
        None,
        "process-group backend",
        group="parallelism",
        choices=("gloo", "nccl"),
        default_text="nccl on CUDA, gloo on CPU",
        resume="quiet",
    )
    device: str | None = setting(
        None,
        "cpu, cuda or cuda:N",
        group="parallelism",
        pattern=DEVICE,
        pattern_text=DEVICE_TEXT,
        default_text="cuda:LOCAL_RANK where there is CUDA",
        resume="quiet",
    )
    timeout: float = setting(
        600.0,
        "seconds a collective may wait",
        group="parallelism",
        low=0.0,
        low_open=True,
        high=MAX_SECONDS,
        resume="quiet",
    )
    max_restarts: int = setting(
        0,
        "with --nproc: restart all workers this often after a "
        "failure; they resume from the last checkpoint",
        group="parallelism",
        low=0,
        high=1000,
        resume="quiet",
    )
    master_port: int | None = setting(
        None,
        "with --nproc: the rendezvous port",
        group="parallelism",
        low=1,
        high=65535,
        default_text="a free one",
        resume="quiet",
    )
    # failures and checkpoints
    keep: int = setting(
        0, "also keep the newest K epoch checkpoints", group="checkpoints", low=0, resume="quiet"
    )
    save_every_steps: int = setting(
        0,
        "also save last.pt every N steps (0: at the end of epochs only)",
        group="checkpoints",
        low=0,
        resume="quiet",
    )
    deterministic: bool = setting(
        False,
        "deterministic algorithms: a resumed run ends bit for bit like an uninterrupted one on CPU",
        group="checkpoints",
    )
    on_nonfinite: str = setting(
        "abort",
        "a NaN/inf loss on any rank: stop every rank, or skip the step on every rank",
        group="checkpoints",
        choices=("abort", "skip"),
    )
    requeue: bool = setting(
        False,
        "under SLURM: after saving on SIGUSR1/SIGTERM, requeue the job (scontrol requeue)",
        group="checkpoints",
        resume="quiet",
    )
    preempt_grace: float = setting(
        20.0,
        "seconds a rank may take to reach a step boundary "
        "after SIGTERM/SIGUSR1 before it exits anyway",
        group="checkpoints",
        low=0.0,
        low_open=True,
        high=3600,
        resume="quiet",
    )
    # output
    output_dir: str = setting(
        "runs", "parent of run directories", group="output", metavar="DIR", resume="quiet"
    )
    name: str | None = setting(
        None,
        "run directory name",
        group="output",
        pattern=RUN_NAME,
        pattern_text="a folder name (no path separators)",
        default_text="a timestamp",
        resume="quiet",
    )
    resume: str | None = setting(
        None,
        "checkpoint (a .pt file, a sharded checkpoint's folder, or a run directory for its "
        "last one), or auto for the newest in the run directory",
        group="output",
        path="entry",
        auto=True,
        metavar="PATH|auto",
        resume="quiet",
    )
    logger: str | None = setting(
        None,
        "experiment trackers, comma-separated; each needs its extra, if any",
        group="output",
        choices_from=TRACKERS,
        listed=True,
        metavar="NAME[,NAME]",
        resume="quiet",
    )
    tensorboard: bool = setting(
        False, "the same as --logger tensorboard", group="output", resume="quiet"
    )
    tracker_timeout: float = setting(
        5.0,
        "seconds an experiment tracker's server has to answer: once before the launch, "
        "and each call during the run",
        group="output",
        low=0.1,
        high=600.0,
        resume="quiet",
    )
    on_tracker_error: str = setting(
        "fail",
        "a tracker that cannot be reached or started before training: fail (one line) or "
        "warn (train without it); one that fails during the run never stops training",
        group="output",
        choices=("fail", "warn"),
        resume="quiet",
    )

    def check_paths(self) -> None:
        """The files and folders named (data, weights, resume) are there."""
        check_paths(self)

    def combinations(self) -> None:
        """Rules between settings that hold whatever the strategy (each strategy checks
        its own: parallel/<name>.py)."""
        if self.warmup_epochs and self.warmup_steps:
            raise UserError("--warmup-epochs and --warmup-steps are alternatives; give one")
        if self.sched == "multistep" and not self.lr_milestones:
            raise UserError("--sched multistep needs --lr-milestones (e.g. 30,60,80)")
        if self.name is not None and (
            self.name in (".", "..") or len(self.name.encode()) > NAME_MAX
        ):
            raise UserError(
                f"--name {self.name[:40]}{'...' if len(self.name) > 40 else ''}: a run's "
                f"name is one folder inside --output-dir: not . or .., at most {NAME_MAX} bytes"
            )
        if self.budget and (self.budget_seconds or 0) < 1:
            raise UserError(f"--budget {self.budget}: give at least a second")
        if self.budget_recipe == "low-res":
            if not self.budget:
                raise UserError("--budget-recipe low-res is a recipe for --budget; give one")
            if given := self.sizes_given():
                raise UserError(
                    f"--budget-recipe low-res sets the training and validation sizes; leave "
                    f"out {', '.join(given)}"
                )
        if self.progressive:
            start, end = self.progressive_sizes
            if not 8 <= start <= end <= MAX_IMAGE_SIZE:
                raise UserError(
                    f"--progressive {self.progressive}: START and END are sizes in pixels "
                    f"from 8 to {MAX_IMAGE_SIZE}, START at most END"
                )
            if self.train_crop:
                raise UserError("--progressive sets the training size; leave out --train-crop")
        if self.freeze_epochs and self.freeze_backbone:
            raise UserError(
                "--freeze-epochs thaws the backbone after K epochs and --freeze-backbone "
                "never does; give one"
            )
        if self.freeze_epochs >= self.epochs and not self.budget:  # --budget plans epochs
            raise UserError(
                f"--freeze-epochs {self.freeze_epochs} with --epochs {self.epochs}: the "
                "backbone would stay frozen for the whole run; give more --epochs, fewer "
                "--freeze-epochs, or --freeze-backbone to train the head alone"
            )
        if self.std and min(triple(self.std)) <= 0:
            raise UserError(f"--std {self.std}: every channel's deviation must be above 0")
        if self.val_resize is not None and self.val_resize < self.eval_crop:
            raise UserError(
                f"--val-resize {self.val_resize} is smaller than the validation crop "
                f"{self.eval_crop}"
            )

    def sizes_given(self) -> list[str]:
        """The flags that set the training or validation size apart from --image-size."""
        return [
            flag
            for flag, value in (
                ("--train-crop", self.train_crop),
                ("--val-size", self.val_crop),
                ("--progressive", self.progressive),
            )
            if value
        ]

    def has_auto(self) -> bool:
        """Whether a setting is still auto (bench/autopilot decides it before the run)."""
        return "auto" in (self.nproc, self.strategy, self.batch_size, self.lr)

    @property
    def dataset(self) -> str:
        """--data once decided (without it, the embedded digits set is written first)."""
        if self.data is None:
            raise RuntimeError("data is still the embedded set: api.train writes it first")
        return self.data

    @property
    def batch(self) -> int:
        """--batch-size once decided (auto is resolved before any run, bench/autopilot)."""
        return concrete(self.batch_size, "batch_size")

    @property
    def processes(self) -> int:
        """--nproc once decided."""
        return concrete(self.nproc, "nproc")

    def rate(self, replicas: int) -> float:
        """The peak learning rate on ``replicas`` copies of the model: --lr as given, else
        --lr-base scaled linearly from --lr-base-size to the global batch."""
        if self.lr is not None:
            return concrete(self.lr, "lr")
        return self.lr_base * self.global_batch(replicas) / self.lr_base_size

    @property
    def loggers(self) -> tuple[str, ...]:
        """The trackers asked for (--logger, and --tensorboard), each once, in order."""
        names = (self.logger or "").split(",") + (["tensorboard"] if self.tensorboard else [])
        return tuple(dict.fromkeys(n for n in names if n))

    def global_batch(self, replicas: int) -> int:
        """Images per optimizer step over every copy of the model."""
        return self.batch * replicas * self.grad_accum

    @property
    def train_size(self) -> int:
        """The training crop: what the model sees in training (with --progressive, the
        largest it sees)."""
        if self.progressive:
            return max(self.progressive_sizes)
        return self.train_crop or self.image_size

    @property
    def progressive_sizes(self) -> tuple[int, int]:
        """--progressive's START and END."""
        start, end = (int(x) for x in (self.progressive or "0:0").split(":"))
        return start, end

    @property
    def budget_seconds(self) -> float | None:
        """--budget in seconds."""
        return seconds_of(self.budget) if self.budget else None

    @property
    def eval_crop(self) -> int:
        """The validation center crop (with --progressive, its END unless given)."""
        if self.val_crop:
            return self.val_crop
        return self.progressive_sizes[1] if self.progressive else self.image_size

    @property
    def eval_resize(self) -> int:
        """The validation short side before the crop (torchvision's 256/224 by default)."""
        return self.val_resize or resize_for_crop(self.eval_crop)

    @property
    def stored_size(self) -> int:
        """The short side the decoded cache keeps: what the larger of training and
        validation needs (validation's resize, unless training crops need more)."""
        return max(self.eval_resize, resize_for_crop(self.train_size))

    @property
    def norm_mean(self) -> tuple[float, float, float]:
        """The per-channel mean images are normalised with (ImageNet's by default)."""
        return triple(self.mean) if self.mean else IMAGENET_MEAN

    @property
    def norm_std(self) -> tuple[float, float, float]:
        """The per-channel standard deviation images are normalised with."""
        return triple(self.std) if self.std else IMAGENET_STD

    def milestone_list(self) -> list[int]:
        return [int(m) for m in (self.lr_milestones or "").split(",") if m]

    def split_point_list(self) -> list[str] | None:
        """--split-points as a list of unit names (None: balance automatically)."""
        if not self.split_points:
            return None
        return [point.strip() for point in self.split_points.split(",") if point.strip()]

    def to_dict(self) -> dict[str, Any]:
        """Every setting by name: what config.yaml and a checkpoint keep."""
        return dataclasses.asdict(self)

    def save(self, path: Path) -> None:
        """The resolved config as YAML, reusable with --config: every setting given, so no preset applies again."""
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], source: str = "config") -> TrainConfig:
        """Exactly these values (the rest default; no preset); unknown keys and wrong
        types are UserErrors."""
        return build(cls, migrate_settings(values, source), source)

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        """A YAML file's settings exactly (no preset); see resolve_train for the CLI's path."""
        return cls.from_dict(read_yaml(path), source=str(path))


T = TypeVar("T", int, float)


def concrete(value: T | Literal["auto"], name: str) -> T:
    """A setting that may be auto, as the value it was resolved to: the one place auto
    becomes a number (asking before bench/autopilot resolved it is a bug, not a user's
    mistake)."""
    if isinstance(value, str):
        raise RuntimeError(f"{name} is still {value}: bench/autopilot.resolve decides it first")
    return value


IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def triple(text: str) -> tuple[float, float, float]:
    """ "R,G,B" as three floats (the setting's pattern has checked the form)."""
    r, g, b = (float(x) for x in text.split(","))
    return r, g, b


def as_text(values) -> str:
    """Three numbers as a --mean/--std value."""
    return ",".join(f"{float(v):g}" for v in values)


def seconds_of(duration: str) -> float:
    """90s, 15m, 2h, 1h30m as seconds (the setting's pattern has checked the form)."""
    unit = {"s": 1, "m": 60, "h": 3600}
    return sum(float(n) * unit[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([smh])", duration))


def resize_for_crop(crop: int) -> int:
    """The short side an image is resized to before a center crop of ``crop`` pixels:
    torchvision's reference 256/224."""
    return int(round(crop * 256 / 224))


@dataclass(frozen=True)
class Preset:
    """Values that suit a situation, filled in where the user gave none: fixed, or
    read by a provider ("module:function" of the resolved values) where another
    package knows them."""

    name: str
    applies: Callable[[dict[str, Any]], bool]  # on the values resolved so far
    values: dict[str, Any] | str
    why: str | Callable[[dict[str, Any]], str]

    def values_for(self, resolved: Mapping[str, Any]) -> dict[str, Any]:
        if isinstance(self.values, dict):
            return self.values
        return dict(_provided(self.values, resolved))

    def reason(self, resolved: Mapping[str, Any]) -> str:
        return self.why(dict(resolved)) if callable(self.why) else self.why

    def taken(self, values: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """(the settings that hold this preset's value, those the user set otherwise)."""
        offered = self.values_for(values)
        return (
            [k for k, v in offered.items() if values[k] == v],
            [k for k, v in offered.items() if values[k] != v],
        )


def _provided(where: str, values: Mapping[str, Any]) -> Any:
    """What the provider ``module:function`` says of the values (config imports none)."""
    module, _, name = where.partition(":")
    return getattr(importlib.import_module(module), name)(values)


def _named_weights(values: Mapping[str, Any]) -> bool:
    weights = values.get("weights")
    return isinstance(weights, str) and bool(weights) and not looks_like_file(weights)


PRESETS = (
    # The embedded default: 8x8 digit scans need neither 224 pixels nor strong crops, and a
    # mirrored digit is another digit. Measured on 2 CPU cores, --nproc 2: about 2 minutes,
    # 95-97% validation top-1.
    Preset(
        "digits",
        lambda v: not v.get("data"),
        {
            "model": "resnet18",
            "image_size": 16,
            "epochs": 8,
            "batch_size": 32,  # lr 0.02 a process: --lr-base 0.16 for 256
            "crop_scale_min": 0.7,
            "hflip": 0.0,
            "warmup_epochs": 1,
        },
        "no --data: the embedded digits set",
    ),
    # A folder of small images (64 px scans, thumbnails) trains near their own size, not
    # upsampled to ImageNet's 224 (3x slower for nothing); weights by name, later, keep
    # the size they were trained at.
    Preset(
        "small images",
        lambda v: bool(v.get("data")) and bool(_provided(SMALL_IMAGES, v)),
        SMALL_IMAGES,
        lambda v: _provided(SMALL_IMAGES_WHY, v),
    ),
    # What AdamW (and LAMB, its layer-wise kin) is usually run with (timm's and torchvision's ViT recipes are close):
    # SGD's rate would be far too large for it.
    Preset(
        "adamw",
        lambda v: v.get("opt") in ("adamw", "lamb"),
        {"lr_base": 0.016, "weight_decay": 0.05},  # 0.001 at batch 16
        "--opt adamw or lamb",
    ),
    # Pretrained weights were trained on images prepared one way: their mean and std,
    # resize, crop and interpolation (torchvision's weights.transforms(), timm's
    # pretrained_cfg) are what they expect to see.
    Preset(
        "weights",
        _named_weights,
        WEIGHTS_PREPROCESSING,
        lambda v: f"preprocessing of the weights {v['weights']}",
    ),
)


def resolve_train(
    given: Mapping[str, Any],
    source: str = "arguments",
    recipe: Mapping[str, Any] | None = None,
    recipe_source: str = "--recipe",
) -> TrainConfig:
    """The config from what the user gave (a YAML file's keys with the flags over them,
    or a mapping from Python): each preset that applies fills the settings the user did
    not give, later presets over earlier ones; a ``recipe`` (--recipe) over them; then
    everything is checked."""
    values = coerce_all(TrainConfig, migrate_settings(given, source), source)
    chosen = coerce_all(
        TrainConfig, migrate_settings(recipe or {}, recipe_source), recipe_source, checked=True
    )
    resolved = {**chosen, **values}
    for preset in PRESETS:
        if preset.applies(resolved):
            taken = {**chosen, **values}
            preset_values = preset.values_for(taken)  # from what the user chose
            resolved.update({k: v for k, v in preset_values.items() if k not in taken})
    return TrainConfig(**resolved).validate()


RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def shipped_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def recipe_summaries() -> dict[str, str]:
    """Each shipped recipe's name and its description: the first paragraph of the
    comment its file opens with, whole (one line, not the first line's words)."""
    summaries = {}
    for name in shipped_recipes():
        words: list[str] = []
        for line in (RECIPES / f"{name}.yaml").read_text().splitlines():
            text = line.lstrip("#").strip()
            if not line.startswith("#") or not text:
                break  # the paragraph ends at a blank comment line or the settings
            words.append(text)
        summaries[name] = " ".join(words)
    return summaries


def read_recipe(name_or_path: str) -> dict[str, Any]:
    """A recipe's settings: a shipped one by name, or a YAML file."""
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        path = RECIPES / f"{name_or_path}.yaml"
    if not path.is_file():
        raise UserError(
            f"--recipe {name_or_path}: no such file, and no shipped recipe of that name "
            f"(shipped: {', '.join(shipped_recipes())})"
        )
    return read_yaml(path)


def _per_process_lr(values: dict[str, Any], scaling: Any, source: str, saved: bool) -> None:
    """Before, --lr was one process's rate and lr_scaling: linear multiplied it by the
    replicas x --grad-accum; --lr is now the rate used. A checkpoint's settings are
    converted exactly (the same rates on resume); a config file is refused with how."""
    lr, batch = values.get("lr", 0.01), values.get("batch_size", 16)  # the defaults then
    linear = scaling == "linear" and isinstance(lr, int | float) and isinstance(batch, int)
    if not saved:
        how = (
            f"replace 'lr: {lr}' and 'lr_scaling: linear' with 'lr_base: {lr}' and "
            f"'lr_base_size: {batch}' (the same rates at every world size)"
            if linear
            else "delete the lr_scaling line (--lr is then the rate used, as before)"
        )
        raise UserError(
            f"{source}: lr_scaling is gone: --lr is now the rate used at any world size "
            f"(timm's convention); to keep this file's rates, {how}"
        )
    if linear:
        assert isinstance(lr, int | float)
        values.update(lr=None, lr_base=float(lr), lr_base_size=batch)


# Settings renamed or removed since an earlier paratrain: old name -> how to read it
# (config files and the configs inside checkpoints are read through this).
RENAMED: dict[str, Callable[[dict[str, Any], Any, str, bool], None]] = {
    "lr_scaling": _per_process_lr,
}


def migrate_settings(
    values: Mapping[str, Any], source: str = "config", saved: bool = False
) -> dict[str, Any]:
    """Settings written by an earlier paratrain, as this one names them. ``saved``: a
    checkpoint's settings, converted where the conversion is exact; in a file the user
    keeps (a config, a recipe), a setting that changed its meaning is refused in one line
    that says how to convert it."""
    migrated = dict(values)
    for old, convert in RENAMED.items():
        if old in migrated:
            convert(migrated, migrated.pop(old), source, saved)
    return migrated


def preset_notes(cfg: TrainConfig, names: tuple[str, ...] | None = None) -> list[str]:
    """What each applicable preset (of ``names``, where given) chose, as the config now
    has it."""
    values = cfg.to_dict()
    notes = []
    for p in PRESETS:
        if (names is not None and p.name not in names) or not p.applies(values):
            continue
        taken, kept = ([f"{k}={values[k]}" for k in keys] for keys in p.taken(values))
        note = f"{p.reason(values)}: " + (", ".join(taken) or "nothing taken")
        notes.append(note + (f" (yours: {', '.join(kept)})" if kept else ""))
    return notes
