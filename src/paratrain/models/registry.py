"""create_model(name), list_models(), and partial loading of local weight files."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn

from paratrain.config import TrainConfig
from paratrain.config.schema import looks_like_file
from paratrain.config.words import TIMM_PREFIX
from paratrain.errors import AgreedUserError, UserError
from paratrain.log import get_logger
from paratrain.models import pretrained
from paratrain.models.pretrained import timm_module

# Prefixes that wrappers add to parameter names: DDP/DataParallel and torch.compile.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def list_models(timm: bool = False) -> list[str]:
    """Every torchvision classification model name; with ``timm``, timm's (timm/<name>)."""
    if timm:
        return [TIMM_PREFIX + name for name in timm_module().list_models()]
    return sorted(torchvision.models.list_models(module=torchvision.models))


COUNT_AT_MOST = 40  # timm models built (on the meta device) to count their parameters


def model_families(timm: bool = False, pattern: str | None = None) -> dict[str, list[tuple]]:
    """The model names by family (the module that builds them), each with its parameter
    count where known: torchvision's from its weights' metadata; timm's by building
    them on the meta device, when a pattern leaves at most ``COUNT_AT_MOST``."""
    import fnmatch

    names = list_models(timm)
    if pattern:
        wild = any(c in pattern for c in "*?[")
        names = [
            n for n in names
            if (fnmatch.fnmatch(n.removeprefix(TIMM_PREFIX), pattern) if wild else pattern in n)
        ]  # fmt: skip
    count = _timm_count if timm else _torchvision_count
    counted = not timm or len(names) <= COUNT_AT_MOST
    family = _timm_families() if timm else {}
    families: dict[str, list[tuple]] = {}
    for name in names:
        home = family.get(name) if timm else _torchvision_family(name)
        families.setdefault(home or "other", []).append((name, count(name) if counted else None))
    return dict(sorted(families.items()))


def _torchvision_family(name: str) -> str:
    return torchvision.models.get_model_builder(name).__module__.rsplit(".", 1)[-1]


def _timm_families() -> dict[str, str]:
    """timm/<name> -> the timm module that builds it."""
    timm = timm_module()
    return {
        TIMM_PREFIX + name: module
        for module in timm.list_modules()
        for name in timm.list_models(module=module)
    }


def _torchvision_count(name: str) -> int | None:
    try:
        weights = torchvision.models.get_model_weights(name)
        return int(next(iter(weights)).meta["num_params"])
    except (ValueError, KeyError, StopIteration):
        return None


def _timm_count(name: str) -> int | None:
    try:
        with torch.device("meta"):
            model = timm_module().create_model(name.removeprefix(TIMM_PREFIX), pretrained=False)
        return sum(p.numel() for p in model.parameters())
    except Exception:  # a model that cannot be built on the meta device: no count
        return None


def _create_timm(name: str, num_classes: int, image_size: int | None) -> nn.Module:
    """timm's model, randomly initialised: named weights are fetched and loaded by
    start_from (models/pretrained.py), as every other model's."""
    timm, arch = timm_module(), name[len(TIMM_PREFIX) :]
    if not timm.is_model(arch):
        close = timm.list_models(f"*{arch.split('_')[0]}*")[:6]
        hint = f"; similar: {', '.join(TIMM_PREFIX + c for c in close)}" if close else ""
        raise UserError(f"unknown model {name!r} (see `paratrain models --timm`){hint}")
    try:  # vision transformers are built for one input size
        return timm.create_model(arch, pretrained=False, num_classes=num_classes,
                                 img_size=image_size)  # fmt: skip
    except TypeError:
        return timm.create_model(arch, pretrained=False, num_classes=num_classes)


def create_model(name: str, num_classes: int, image_size: int | None = None) -> nn.Module:
    """A randomly initialised torchvision (or timm/<name>) classifier with
    ``num_classes`` outputs."""
    if name.startswith(TIMM_PREFIX):
        return _create_timm(name, num_classes, image_size)
    available = list_models()
    if name not in available:
        close = [m for m in available if name.split("_")[0] in m][:6]
        hint = f"; similar: {', '.join(close)}" if close else ""
        raise UserError(f"unknown model {name!r} (see `paratrain models`){hint}")
    kwargs: dict = {"weights": None, "num_classes": num_classes}
    if name.startswith("vit_") and image_size:  # ViTs are built for one input size
        kwargs["image_size"] = image_size
    if name in ("inception_v3", "googlenet"):
        kwargs["aux_logits"] = False
        kwargs["init_weights"] = True
    return torchvision.models.get_model(name, **kwargs)


def logits_of(output: Any) -> torch.Tensor:
    """Models such as GoogLeNet return a named tuple in training mode."""
    logits: torch.Tensor = output.logits if hasattr(output, "logits") else output
    return logits


def strip_prefixes(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the ``module.`` and ``_orig_mod.`` prefixes that wrappers put before keys."""
    cleaned = {}
    for key, value in state.items():
        while key.startswith(WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        cleaned[key] = value
    return cleaned


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    missing: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        """Every tensor loaded, none left as initialised."""
        return not self.skipped and not self.missing

    def summary(self, path: str) -> str:
        """The report as lines: counts, then the first skipped and missing keys and why."""
        lines = [
            f"weights {path}: loaded {len(self.loaded)} tensors, skipped {len(self.skipped)}, "
            f"missing {len(self.missing)}"
        ]
        lines += [f"  skipped {key}: {why}" for key, why in self.skipped[:20]]
        if len(self.skipped) > 20:
            lines.append(f"  ... and {len(self.skipped) - 20} more skipped")
        lines += [f"  missing {key} (left as initialised)" for key in self.missing[:20]]
        if len(self.missing) > 20:
            lines.append(f"  ... and {len(self.missing) - 20} more missing")
        return "\n".join(lines)


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a torchvision weights file or a paratrain checkpoint as a plain state dict."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"weights file not found: {path}")
    obj: Any
    try:
        if path.suffix == ".safetensors":  # e.g. from `paratrain export --format safetensors`
            from safetensors.torch import load_file

            obj = load_file(str(path))
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a file that is not a pickle
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"weights file {path} could not be read as a state dict: {reason}"
        ) from None
    if isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping):
        obj = obj["model"]  # a paratrain checkpoint
    elif isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not obj:
        raise UserError(f"weights file {path} does not hold a state dict (a mapping of tensors)")
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if not tensors or not all(isinstance(k, str) for k in obj):
        raise UserError(f"weights file {path} does not hold a state dict (a mapping of tensors)")
    return strip_prefixes(tensors)


def load_weights(
    model: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = False, source: str = ""
) -> LoadReport:
    """Copy every tensor whose name and shape match; report what was skipped and missing."""
    own = model.state_dict()
    report = LoadReport()
    usable = {}
    for key, value in state.items():
        if key not in own:
            report.skipped.append((key, "not in model"))
        elif own[key].shape != value.shape:
            report.skipped.append(
                (key, f"shape {tuple(value.shape)} in file, {tuple(own[key].shape)} in model")
            )
        else:
            usable[key] = value
            report.loaded.append(key)
    report.missing = [key for key in own if key not in usable]
    if strict and not report.exact:
        first = report.skipped[0][0] if report.skipped else report.missing[0]
        raise UserError(
            f"--weights-strict: {source or 'weights'} does not match the model exactly "
            f"({len(report.skipped)} skipped, {len(report.missing)} missing; first: {first})"
        )
    model.load_state_dict(usable, strict=False)
    return report


# Where torchvision classifiers keep their last layer(s): ResNet/RegNet/Inception `fc`,
# VGG/AlexNet/MobileNet/EfficientNet/ConvNeXt/DenseNet `classifier`, ViT `heads`, Swin `head`.
HEAD_NAMES = ("fc", "classifier", "heads", "head")


def classifier_head(model: nn.Module, name: str = "") -> str:
    """The path of the model's classifier head (a timm model says where its is)."""
    timm_head = getattr(model, "pretrained_cfg", {}).get("classifier")
    if isinstance(timm_head, str):
        return timm_head
    for attr in HEAD_NAMES:
        if isinstance(getattr(model, attr, None), nn.Module):
            return attr
    raise UserError(
        f"--freeze-backbone: model {name or type(model).__name__} has none of the head "
        f"attributes {', '.join(HEAD_NAMES)}"
    )


def _stay_in_eval(module: nn.Module, _args: tuple) -> None:
    """A frozen BatchNorm normalises with its running statistics and never updates them,
    whatever mode the model was put in: training the head must not move the backbone."""
    module.training = False


def freeze_backbone(model: nn.Module, name: str = "") -> tuple[str, int, int]:
    """Only the head trains: returns (head attribute, trained parameters, all parameters)."""
    head = classifier_head(model, name)
    for param in model.parameters():
        param.requires_grad_(False)
    for param in model.get_submodule(head).parameters():
        param.requires_grad_(True)
    in_head = {id(m) for m in model.get_submodule(head).modules()}
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and id(module) not in in_head:
            module.register_forward_pre_hook(_stay_in_eval)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return head, trained, sum(p.numel() for p in model.parameters())


def fetch_weights(name: str, weights: str) -> None:
    """A weights file read, or named weights resolved and fetched onto this machine:
    what the launcher does once before any worker starts."""
    if looks_like_file(weights):
        read_state_dict(weights)
        return
    read_state_dict(pretrained.resolve(name, weights).fetch())


def start_from(
    model: nn.Module, name: str, weights: str, strict: bool = False, classes: int | None = None
) -> LoadReport:
    """``weights`` (a name its registry resolves and fetches, or a file) into ``model``,
    partially: what was loaded, left out and left as initialised is reported, and so is
    a new head sized to the data's classes."""
    if looks_like_file(weights):
        state, label = read_state_dict(weights), weights
    else:
        named = pretrained.resolve(name, weights)
        state = pretrained.adapt(read_state_dict(named.fetch()), model)
        label = named.label
    report = load_weights(model, state, strict, label)
    get_logger().info(report.summary(label))
    try:
        head = classifier_head(model, name)
    except UserError:
        return report
    replaced = [(k, why) for k, why in report.skipped if k.startswith(head + ".")]
    if replaced:
        outputs = state[replaced[0][0]].shape[0]
        size = f"{classes} outputs, one per class of the data" if classes else "new outputs"
        get_logger().info(
            f"new head `{head}` with {size}; the weights' {outputs}-output head left out"
        )
    return report


def zero_init_residual(model: nn.Module, name: str = "") -> int:
    """Zero the last BatchNorm's scale in each residual block (torchvision's ResNet
    BasicBlock.bn2 and Bottleneck.bn3; any timm block with ``zero_init_last``), so each
    block starts as its shortcut; the number of blocks. None found is a user error: the
    model has no such blocks."""
    from torchvision.models.resnet import BasicBlock, Bottleneck

    count = 0
    for module in model.modules():
        last = {BasicBlock: "bn2", Bottleneck: "bn3"}.get(type(module))
        if last is not None:
            nn.init.zeros_(getattr(module, last).weight)
            count += 1
        elif callable(zero_last := getattr(module, "zero_init_last", None)):
            zero_last()
            count += 1
    if not count:
        raise UserError(
            f"--zero-init-residual: {name or 'the model'} has no residual blocks it knows "
            "(torchvision's ResNets, timm's blocks with zero_init_last)"
        )
    return count


def build_model(
    cfg: TrainConfig, num_classes: int, device: torch.device | None = None
) -> nn.Module:
    """The configured model with its --weights and --freeze-backbone. Seeded alike on
    every rank, so every rank builds identical initial weights; a bad name or weights
    file fails on every rank alike, and rank 0 alone reports it. On the meta ``device``
    only its shapes are built (no memory, no weights read): a strategy that fills it
    from another rank (parallel/fsdp)."""
    torch.manual_seed(cfg.seed)
    meta = device is not None and device.type == "meta"
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = create_model(cfg.model, num_classes, cfg.train_size)
        if cfg.zero_init_residual and not cfg.weights:
            zero_init_residual(model, cfg.model)
        if cfg.weights and not meta:
            start_from(model, cfg.model, cfg.weights, cfg.weights_strict, num_classes)
    except UserError as exc:
        raise AgreedUserError(str(exc)) from None
    if cfg.freeze_backbone:
        head, trained, total = freeze_backbone(model, cfg.model)
        get_logger().info(
            f"--freeze-backbone: training only `{head}`, {trained:,} of {total:,} parameters"
            + ("" if cfg.weights else " (no --weights: the frozen backbone stays random)")
        )
    return model


@functools.lru_cache(maxsize=64)
def runs_at(name: str, image_size: int, batch: int = 2) -> str | None:
    """None when ``name`` trains on ``image_size``-pixel images in batches of ``batch``,
    else why it cannot.

    The model is built and run on the meta device (shapes only, no memory, no
    arithmetic), in training mode; an operation the meta device lacks is tried once for
    real on the CPU instead. The answer is kept for the process: the launcher's checks
    and a worker's own setup ask alike (0.1 to 0.3 s a question on a CPU, most of it
    BatchNorm's shape rules run in Python)."""
    for device in ("meta", "cpu"):
        try:
            with torch.device(device):
                model = create_model(name, 2, image_size)
                model(torch.zeros(batch, 3, image_size, image_size))
            return None
        except UserError:
            raise
        except NotImplementedError:
            continue  # the meta device lacks an operation: ask the CPU
        except Exception as exc:  # shapes that do not fit: RuntimeError, AssertionError, ...
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return text[:160]
    return None


def smallest_input_size(name: str, largest: int = 4096, batch: int = 2) -> int | None:
    """The smallest image size ``name`` trains on (sizes a model takes only grow)."""
    size = 8
    while runs_at(name, size, batch) is not None:
        size *= 2
        if size > largest:
            return None
    low, high = size // 2, size  # low fails (or is below 8), high works
    while high - low > 1:
        middle = (low + high) // 2
        if middle >= 8 and runs_at(name, middle, batch) is None:
            high = middle
        else:
            low = middle
    return high


def check_input_size(name: str, image_size: int, norm_batch: int = 2) -> None:
    """A one-line UserError, with the smallest size that works, when ``name`` cannot
    train on ``image_size``-pixel images: said before any image is decoded.
    ``norm_batch``: the images a BatchNorm layer sees at once in training; a batch of
    one leaves it a single value per channel where the feature map has shrunk to 1x1."""
    problem = runs_at(name, image_size)
    if problem is None and norm_batch < 2:
        problem = runs_at(name, image_size, norm_batch)
        if problem is None:
            return
        smallest = smallest_input_size(name, batch=norm_batch)
        hint = f", or an --image-size of at least {smallest}" if smallest is not None else ""
        raise UserError(
            f"--model {name} cannot train at {image_size}px on one image at a time "
            f"({problem}): a per-process batch (per micro-batch) of 2 or more works{hint}"
        )
    if problem is None:
        return
    smallest = smallest_input_size(name)
    hint = (
        f"; the smallest --image-size it takes is {smallest}"
        if smallest is not None and smallest > image_size
        else ""
    )
    raise UserError(f"--model {name} cannot run on {image_size}px images ({problem}){hint}")


def check_model_input(cfg: TrainConfig, norm_batch: int) -> None:
    """The model takes the training and validation sizes, and no BatchNorm layer is
    left one value per channel by the ``norm_batch`` images it sees at once (what the
    strategy says): checked on the meta device before any image is decoded."""
    check_input_size(cfg.model, cfg.eval_crop)
    check_input_size(cfg.model, cfg.train_size, norm_batch)
    if cfg.progressive:  # and the smallest size it starts at
        check_input_size(cfg.model, cfg.progressive_sizes[0], norm_batch)


def check_weights_fit(
    name: str, classes: int, image_size: int, weights: Mapping[str, Any], path: str | Path
) -> None:
    """A one-line UserError when a checkpoint's weights are not exactly those of
    ``name`` with ``classes`` outputs (names and shapes, compared on the meta device)."""
    with torch.device("meta"):
        expected = create_model(name, classes, image_size).state_dict()
    missing = [key for key in expected if key not in weights]
    unexpected = [key for key in weights if key not in expected]
    shapes = {
        key: tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        for key, value in weights.items()
    }
    wrong = [
        f"{key} {shapes[key]} vs {tuple(value.shape)}"
        for key, value in expected.items()
        if key in shapes and shapes[key] != tuple(value.shape)
    ]
    problems = [
        (missing, "missing"),
        (unexpected, "not in the model"),
        (wrong, "of another shape (file vs model)"),
    ]
    told = [f"{len(keys)} {what} ({', '.join(keys[:3])})" for keys, what in problems if keys]
    if told:
        raise UserError(
            f"{path}: its weights are not those of {name} with {classes} classes: "
            + "; ".join(told)
        )


def build_teacher(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """--teacher with --teacher-weights, on the CPU, in eval mode and without gradients;
    weights that are not exactly those of the teacher with the data's classes are one
    line (a head of another class count said as such)."""
    if cfg.teacher is None or cfg.teacher_weights is None:
        raise UserError(
            "--teacher needs --teacher-weights: a teacher of random weights teaches nothing"
        )
    teacher = create_model(cfg.teacher, num_classes, cfg.train_size)
    weights = cfg.teacher_weights
    if looks_like_file(weights):
        state, label = read_state_dict(weights), weights
    else:
        named = pretrained.resolve(cfg.teacher, weights)
        state = pretrained.adapt(read_state_dict(named.fetch()), teacher)
        label = named.label
    head = classifier_head(teacher, cfg.teacher)
    outputs = [v.shape[0] for k, v in state.items() if k.startswith(head + ".") and v.ndim >= 1]
    if outputs and outputs[-1] != num_classes:
        raise UserError(
            f"--teacher-weights {label}: its head has {outputs[-1]} outputs and the data "
            f"{num_classes} classes; a teacher must have been trained on the same classes"
        )
    report = load_weights(teacher, state, strict=False, source=label)
    if not report.exact:
        first = report.skipped[0][0] if report.skipped else report.missing[0]
        raise UserError(
            f"--teacher-weights {label}: not the weights of {cfg.teacher} ({len(report.skipped)} "
            f"left out, {len(report.missing)} missing; first: {first})"
        )
    teacher.eval().requires_grad_(False)
    return teacher
