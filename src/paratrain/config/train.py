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
)
from paratrain.config.sections.data import DataSettings
from paratrain.config.sections.model import ModelSettings
from paratrain.config.sections.optimization import OptimizationSettings
from paratrain.config.sections.output import OutputSettings
from paratrain.config.sections.runtime import RuntimeSettings
from paratrain.config.sections.schedule import ScheduleSettings
from paratrain.config.words import (
    LARGE_IMAGES,
    LARGE_IMAGES_WHY,
    MAX_IMAGE_SIZE,
    NAME_MAX,
    SMALL_IMAGES,
    SMALL_IMAGES_WHY,
    WEIGHTS_PREPROCESSING,
)
from paratrain.errors import UserError
from paratrain.files import write_atomic


@dataclass(frozen=True)
class TrainConfig(
    OutputSettings,
    RuntimeSettings,
    ScheduleSettings,
    OptimizationSettings,
    ModelSettings,
    DataSettings,
    Options,
):
    """Every setting of a training run: its sections' (config/sections/), in that order,
    flat (``cfg.image_size``), and the rules between them."""

    def check_paths(self) -> None:
        """The files and folders named (data, weights, resume) are there."""
        check_paths(self)

    def combinations(self) -> None:
        """Rules between settings that hold whatever the strategy (each strategy checks
        its own: parallel/<name>.py)."""
        if self.warmup_epochs and self.warmup_steps:
            raise UserError("--warmup-epochs and --warmup-steps are alternatives; give one")
        if self.teacher_weights is not None and self.teacher is None:
            raise UserError("--teacher-weights needs --teacher: the model they belong to")
        if self.compile and self.activation_checkpointing:
            raise UserError(
                "--activation-checkpointing with --compile: torch.compile cannot yet trace "
                "the checkpointed blocks (their recompute keeps BatchNorm's statistics "
                "still); give one of them"
            )
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
        validation needs (validation's resize, unless training crops need more), or
        --cache-side where it is larger."""
        return max(self.eval_resize, resize_for_crop(self.train_size), self.cache_side or 0)

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
        write_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

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
    # A folder of images twice the side the cache keeps by default (validation's resize):
    # training crops are cut from the larger cached images, as a plain loop cuts them from
    # the originals (docs/benchmarks.md, few images at 50 epochs), where it fits the
    # cache's memory budget.
    Preset(
        "large images",
        lambda v: bool(v.get("data")) and bool(_provided(LARGE_IMAGES, v)),
        LARGE_IMAGES,
        lambda v: _provided(LARGE_IMAGES_WHY, v),
    ),
    # What AdamW (and LAMB, its layer-wise kin) is usually run with (timm's and torchvision's ViT recipes are close):
    # SGD's rate would be far too large for it.
    Preset(
        "adamw",
        lambda v: v.get("opt") in ("adamw", "lamb"),
        {"lr_base": 0.016, "weight_decay": 0.05},  # 0.001 at batch 16
        "--opt adamw or lamb",
    ),
    # A run given a wall-clock: the rate falls linearly to zero at its end, as budgeted
    # training does best (Li, Yumer and Ramanan, ICLR 2020); measured on the suite's
    # choose half, against cosine to a tenth (docs/benchmarks.md, the budget's schedule).
    Preset(
        "budget",
        lambda v: bool(v.get("budget")),
        {"sched": "linear", "lrf": 0.0},
        "--budget: a schedule that falls to zero at its end",
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
