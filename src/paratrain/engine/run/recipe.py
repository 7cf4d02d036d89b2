"""Recipe options around the loop: optimizer, loss, MixUp/CutMix, EMA weights.

Each is built once from the config and handed to the loop, which stays the same whether
an option is on or off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim import sgd as sgd_module  # private: checked by private_sgd_fits
from torch.optim.swa_utils import AveragedModel

from paratrain.config import TrainConfig
from paratrain.engine.run.precision import Precision
from paratrain.engine.run.schedule import peak_lr
from paratrain.engine.run.task import MultiClass, MultiLabelLoss, Task, multilabel_mixer, task_of
from paratrain.errors import AgreedUserError
from paratrain.log import get_logger
from paratrain.models.registry import logits_of
from paratrain.parallel import optim_state
from paratrain.parallel.base import get as get_strategy
from paratrain.parallel.parts import ModelParts
from paratrain.report.metrics import AVERAGED

# --ema-decay auto: the average spans about this many epochs' steps (chosen on the
# suite's choose half, docs/benchmarks.md "Across a suite of sets")
EMA_EPOCHS = 2


@dataclass
class Recipe:
    """What the loop applies around each step; built once from the config."""

    criterion: nn.Module
    precision: Precision
    mixer: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # -> mixed, soft
    ema: EMA | None = None
    grad_accum: int = 1
    clip_grad: float | None = None
    freezing: Freezing | None = None  # --freeze-epochs
    teacher: Distiller | None = None  # --teacher
    task: Task = field(default_factory=MultiClass)  # what a label means (engine/run/task)

    def criterion_for(self, images: torch.Tensor) -> Callable:
        """The loss of a micro-batch of ``images``: the criterion, or with a teacher the
        criterion mixed with the distillation loss against the teacher's logits."""
        if self.teacher is None:
            return self.criterion
        return self.teacher.criterion(images, self.criterion, self.precision)

    def start_epoch(self, epoch: int) -> None:
        """--freeze-epochs: frozen or not for ``epoch`` (said where the backbone thaws)."""
        if self.freezing is not None and self.freezing.set_epoch(epoch):
            get_logger().info(f"epoch {epoch + 1}: the backbone thaws; every layer trains")

    def evaluated(self) -> dict[str, nn.Module]:
        """The models evaluated besides the trained one, by the suffix of their metrics
        columns: the EMA weights' (``_ema``), where kept."""
        return {AVERAGED: self.ema.module} if self.ema is not None else {}

    def state_dict(self) -> dict[str, Any]:
        """What of the recipe a checkpoint keeps: the EMA weights, the grad scaler."""
        scaler = self.precision.scaler
        return {
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "scaler": scaler.state_dict() if scaler is not None else None,
            "task": self.task.name,
            "threshold": self.task.threshold,  # several labels an image: chosen on validation
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        if state.get("threshold") is not None and self.task.threshold is not None:
            self.task.threshold = state["threshold"]
        scaler = self.precision.scaler
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        if self.ema is not None:
            if state.get("ema"):
                self.ema.load_state_dict(state["ema"])
            else:
                get_logger().warning(
                    "the checkpoint holds no EMA weights: the average starts from the resumed ones"
                )


class Distiller:
    """--teacher: the loss is ``(1 - alpha)`` x the criterion on the labels plus
    ``alpha x T^2`` x KL(teacher || student) at temperature T (Hinton et al.; T^2 keeps
    the soft loss's gradients at the hard one's scale). The teacher runs in eval mode,
    without gradients, in the run's precision."""

    def __init__(self, module: nn.Module, alpha: float, temperature: float):
        self.module, self.alpha, self.temperature = module, alpha, temperature

    def criterion(self, images: torch.Tensor, base: Callable, precision: Precision) -> Callable:
        with torch.no_grad(), precision.autocast():
            taught = logits_of(self.module(images)).float()
        alpha, temperature = self.alpha, self.temperature

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            hard = base(logits, targets)
            soft = nn.functional.kl_div(
                nn.functional.log_softmax(logits.float() / temperature, dim=1),
                nn.functional.log_softmax(taught.to(logits.device) / temperature, dim=1),
                log_target=True,
                reduction="batchmean",
            )
            return (1 - alpha) * hard + alpha * temperature**2 * soft

        return loss


class Freezing:
    """--freeze-epochs K: for the first K epochs only the classifier head learns.

    Every parameter stays in the optimizer and in the strategy's gradient reduction, so
    nothing is rebuilt or rewrapped when the backbone thaws, under any strategy (DDP's
    buckets, FSDP's shards and a pipeline's stages stay as they were); the backbone's
    gradients are dropped before the optimizer steps (no update, no weight decay, no
    momentum), and its BatchNorm layers normalise with their running statistics without
    updating them. Whether it is frozen follows from the epoch alone, so a resumed run
    freezes exactly as the uninterrupted one."""

    def __init__(self, parts: ModelParts, epochs: int):
        grouping = parts.grouping
        if grouping is None or grouping.head is None:
            raise AgreedUserError(
                "--freeze-epochs: the model has no classifier head paratrain knows "
                "(fc, classifier, heads, head) to keep training"
            )
        self.epochs, self.active = epochs, False
        self.params: list[nn.Parameter] = []
        for module in parts.unwrapped():
            for name, param in module.named_parameters():
                if not grouping.in_head(name):
                    self.params.append(param)
            for name, layer in module.named_modules():
                if isinstance(layer, nn.modules.batchnorm._BatchNorm) and not grouping.in_head(
                    name
                ):
                    layer.register_forward_pre_hook(self._hold)

    def _hold(self, module: nn.Module, _args: tuple) -> None:
        if self.active:
            module.training = False

    def set_epoch(self, epoch: int) -> bool:
        """Frozen or not for ``epoch``; True where the backbone thaws at its start."""
        self.active = epoch < self.epochs
        return epoch == self.epochs

    def drop_grads(self) -> None:
        """The backbone's gradients gone while frozen: the optimizer skips them."""
        if self.active:
            for param in self.params:
                param.grad = None


def build_recipe(
    cfg: TrainConfig,
    parts: ModelParts,
    num_classes: int,
    precision: Precision,
    class_counts: Sequence[int] | None = None,
    teacher: nn.Module | None = None,
    label_sets: np.ndarray | None = None,
) -> Recipe:
    """The recipe of ``cfg``: criterion, precision, MixUp/CutMix, EMA, accumulation,
    clipping; ``class_counts``: the training images of each class (--balance loss);
    ``teacher``: --teacher, placed by the strategy; ``label_sets``: the table of a
    multi-label split (data/label_sets.py)."""
    distiller = (
        Distiller(teacher, cfg.kd_alpha, cfg.kd_temperature) if teacher is not None else None
    )
    return Recipe(
        teacher=distiller,
        criterion=build_criterion(cfg, class_counts).to(parts.output_device),
        precision=precision,
        mixer=build_mixer(cfg, num_classes),
        task=task_of(label_sets, parts.output_device),
        ema=EMA(parts, cfg.ema_decay)
        if isinstance(cfg.ema_decay, float) and cfg.ema_decay
        else None,
        grad_accum=cfg.grad_accum,
        clip_grad=cfg.clip_grad,
        freezing=Freezing(parts, cfg.freeze_epochs) if cfg.freeze_epochs else None,
    )


def param_groups(parts: ModelParts, cfg: TrainConfig) -> list[dict]:
    """The parameters that train (a frozen backbone's do not), in one group, or by kind
    with their own weight decay (--norm-weight-decay, --bias-weight-decay), and by
    learning-rate scale (--head-lr-mult, --layer-decay: the schedule sets each group's
    rate times its ``lr_scale``)."""
    grouping = parts.grouping or optim_state.grouping(cfg)
    params: dict[str, nn.Parameter] = {}
    found: dict[tuple[str, float], list[str]] = {}
    for module in parts.unwrapped():  # a split model's stages, in order
        params.update(dict(module.named_parameters()))
        for kind, scale, names in optim_state.named_groups(module, grouping):
            found.setdefault((kind, scale), []).extend(names)
    decay = {
        "decay": cfg.weight_decay,
        "norm": cfg.norm_weight_decay,
        "bias": cfg.bias_weight_decay,
    }
    return [
        {
            "params": [params[n] for n in names],
            "kind": kind,
            "lr_scale": scale,
            "weight_decay": cfg.weight_decay if decay[kind] is None else decay[kind],
        }
        for (kind, scale), names in found.items()
    ]


def build_optimizer(parts: ModelParts, cfg: TrainConfig, world_size: int) -> torch.optim.Optimizer:
    """SGD, AdamW, or timm's LARS or LAMB, over the parameters that train."""
    lr = peak_lr(cfg, world_size)
    groups = param_groups(parts, cfg)
    params = [p for group in groups for p in group["params"]]
    # one fused kernel over every parameter: ResNet-18's SGD step 3.6 ms instead of 8.4 ms
    # on 2 CPU threads (the per-tensor loop is torch's default off CUDA), where the
    # model's parts allow it (not over sharded parameters: parallel/fsdp.py)
    fused = parts.fused_optimizer and all(p.device.type in ("cpu", "cuda") for p in params)
    if cfg.opt == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=cfg.weight_decay, fused=fused)
    if cfg.opt in ("lars", "lamb"):
        optimizers = timm_optimizers()
        if cfg.opt == "lars":  # SGD with momentum, each layer's step scaled by its trust ratio
            return optimizers.Lars(
                groups, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
            )
        return optimizers.Lamb(groups, lr=lr, weight_decay=cfg.weight_decay)
    return StorageOrderSGD(
        groups, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=fused
    )


def timm_optimizers():
    """timm.optim, where LARS and LAMB are maintained; one line when it is missing."""
    try:
        import timm.optim
    except ImportError:
        from paratrain.errors import UserError
        from paratrain.version import install_extra

        raise UserError(
            f"--opt lars and --opt lamb are timm's optimizers: {install_extra('timm')}"
        ) from None
    return timm.optim


def _storage_order(t: torch.Tensor) -> torch.Tensor:
    """A channels_last 4-D tensor seen in the order it lies in memory (N, H, W, C): a
    contiguous view of the same elements."""
    return t.permute(0, 2, 3, 1)


def _in_storage_order(tensors: list, viewed: list[bool]) -> list:
    pairs = zip(tensors, viewed, strict=True)
    return [_storage_order(t) if v and t is not None else t for t, v in pairs]


def _is_channels_last(t: torch.Tensor | None) -> bool:
    return (
        t is not None
        and t.dim() == 4
        and not t.is_contiguous()
        and t.is_contiguous(memory_format=torch.channels_last)
    )


def _missing_buffers(optimizer: torch.optim.SGD) -> None:
    """Zero momentum buffers where torch's fused kernel goes wrong without them: for
    parameters that first get a gradient after the others (a backbone thawed by
    --freeze-epochs), where the kernel is given a malformed call; and on a first step
    that may be skipped (``found_inf``: a GradScaler, or --on-nonfinite skip on CUDA),
    where the kernel leaves the buffers it made with ``empty_like`` unwritten and the
    next step reads garbage. Both reproduced in tests/upstream/test_upstream_cpu.py. A zero
    buffer is what SGD's first step starts from at paratrain's dampening of 0: momentum
    x 0 + gradient, the same result to the bit."""
    skippable = getattr(optimizer, "found_inf", None) is not None
    for group in optimizer.param_groups:
        if group["momentum"] == 0 or not group.get("fused"):
            continue
        stepped = [p for p in group["params"] if p.grad is not None]
        missing = [p for p in stepped if optimizer.state[p].get("momentum_buffer") is None]
        if missing and (skippable or len(missing) < len(stepped)):
            for param in missing:
                optimizer.state[param]["momentum_buffer"] = torch.zeros_like(
                    param, memory_format=torch.preserve_format
                )


# What StorageOrderSGD reaches into (private to torch.optim.sgd): SGD._init_group and
# the functional sgd() with these keywords (tests/upstream/test_private_torch.py checks both)
SGD_KEYWORDS = (
    "weight_decay", "momentum", "lr", "dampening", "nesterov", "maximize",
    "has_sparse_grad", "foreach", "fused", "grad_scale", "found_inf",
)  # fmt: skip


@functools.cache
def private_sgd_fits() -> bool:
    """Whether this torch's private SGD pieces are the ones StorageOrderSGD was written
    for; if not, it steps as torch's SGD does (slower with channels_last), said once."""
    import inspect

    init = getattr(torch.optim.SGD, "_init_group", None)
    fits = callable(init) and len(inspect.signature(init).parameters) == 5  # self + 4
    sgd = getattr(sgd_module, "sgd", None)
    if fits and callable(sgd):
        fits = set(SGD_KEYWORDS) <= set(inspect.signature(sgd).parameters)
    else:
        fits = False
    if not fits:
        from paratrain.log import get_logger

        get_logger().warning(
            f"torch {torch.__version__} changed SGD's private _init_group or sgd(): "
            "paratrain's storage-order SGD step is off, torch's own SGD step runs instead"
        )
    return fits


class StorageOrderSGD(torch.optim.SGD):
    """torch's SGD, its kernel given channels_last weights in their storage order.

    The fused CPU kernel makes every non-contiguous parameter, gradient and momentum
    buffer contiguous and copies the results back: for a channels_last model that is five
    extra passes over every convolution weight. Elementwise updates do not care about
    the order, so the kernel gets each such (parameter, gradient, buffer) as contiguous
    views of the same memory. Measured on 2 CPU threads, ResNet-18's SGD step 7.0 ms with
    channels_last weights against 3.2 ms contiguous; a bf16 training step at 64 px
    53 -> 47 ms. The state (and so its state dict) is the same as SGD's."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """SGD's step, with channels_last (weight, gradient, buffer) triples given to the kernel as contiguous views of the same memory."""
        _missing_buffers(self)
        if not private_sgd_fits():  # a torch whose private SGD pieces changed: its own step
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            buffers: list[torch.Tensor | None] = []
            sparse = self._init_group(group, params, grads, buffers)
            if not buffers:  # momentum 0: SGD keeps no buffers
                buffers = [None] * len(params)
            # a triple all channels_last is seen in storage order; anything else as it is
            viewed = [
                all(_is_channels_last(t) for t in (p, g, b) if t is not None)
                for p, g, b in zip(params, grads, buffers, strict=True)
            ]
            buffer_views = _in_storage_order(buffers, viewed)
            sgd_module.sgd(
                _in_storage_order(params, viewed),
                _in_storage_order(grads, viewed),
                buffer_views,  # the first step fills in new buffers, in the views' shape
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
                has_sparse_grad=sparse,
                foreach=group["foreach"],
                fused=group["fused"],
                grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None),
            )
            if group["momentum"] != 0:
                for p, buffer, v in zip(params, buffer_views, viewed, strict=True):
                    self.state[p]["momentum_buffer"] = buffer.permute(0, 3, 1, 2) if v else buffer
        return loss


def build_criterion(cfg: TrainConfig, class_counts: Sequence[int] | None = None) -> nn.Module:
    """Cross-entropy; it takes class indices, or class probabilities after MixUp/CutMix.
    Under --balance loss each class weighs (1/count)^--balance-power, scaled so that the
    average image weighs 1 (the loss's size, and so the rate's, stays the unweighted one)."""
    if cfg.task == "multilabel":
        return MultiLabelLoss(cfg.label_smoothing)
    weight = None
    if cfg.balance == "loss" and class_counts is not None:
        weight = class_weights(class_counts, cfg.balance_power)
    return nn.CrossEntropyLoss(weight=weight, label_smoothing=cfg.label_smoothing)


def class_weights(class_counts: Sequence[int], power: float) -> torch.Tensor:
    """Per-class loss weights ``count^-power``, their mean over the images 1."""
    counts = torch.tensor([max(int(c), 1) for c in class_counts], dtype=torch.float64)
    weights = counts.pow(-power)
    weights *= counts.sum() / (counts * weights).sum()
    return weights.float()


def build_mixer(cfg: TrainConfig, num_classes: int) -> Callable | None:
    """torchvision's batch MixUp / CutMix (one of the two per batch when both are on).

    Returns None when both are off. The mixer takes (images, labels) and returns the mixed
    images with soft targets; its randomness comes from each rank's own generator.
    """
    if cfg.task == "multilabel":
        return multilabel_mixer(cfg.mixup, cfg.cutmix)
    from torchvision.transforms import v2

    mixers = []
    if cfg.mixup > 0:
        mixers.append(v2.MixUp(alpha=cfg.mixup, num_classes=num_classes))
    if cfg.cutmix > 0:
        mixers.append(v2.CutMix(alpha=cfg.cutmix, num_classes=num_classes))
    if not mixers:
        return None
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)


def wants_average(cfg: TrainConfig) -> bool:
    """Whether the run asks for EMA weights: a decay given, or auto without --budget and
    with one label an image (decide_ema says why; the strategy may still keep none)."""
    if cfg.ema_decay == "auto":
        return not cfg.budget and cfg.task != "multilabel"
    return bool(cfg.ema_decay)


def auto_keeps_average(cfg: TrainConfig) -> bool:
    """Whether --ema-decay auto keeps an average: the run asks for one and its strategy
    keeps whole weights to average."""
    return wants_average(cfg) and get_strategy(cfg.strategy).keeps_average


def decide_ema(cfg: TrainConfig, train_images: int, replicas: int) -> TrainConfig:
    """``cfg`` with --ema-decay concrete: auto averages over about EMA_EPOCHS epochs'
    optimizer steps (1 - 1 / steps, at least 10 steps, at most 0.9999) where the strategy
    keeps an average of the weights, and keeps none (0) where it does not; nor under
    --budget (a schedule fitted to the clock anneals fast at its end, where the average
    lagged the raw weights, at the low-res recipe's sizes and at the sizes as given:
    docs/benchmarks.md), nor with several labels an image (the decision threshold is
    chosen on the raw weights' scores); 0 and None: none."""
    if cfg.ema_decay != "auto":
        return replace(cfg, ema_decay=float(cfg.ema_decay or 0.0))
    if not auto_keeps_average(cfg):
        return replace(cfg, ema_decay=0.0)
    steps = EMA_EPOCHS * -(-train_images // (cfg.batch * replicas * cfg.grad_accum))
    return replace(cfg, ema_decay=round(min(1 - 1 / max(steps, 10), 0.9999), 6))


class EMA:
    """An exponential moving average of the weights (and BatchNorm buffers).

    Every rank keeps its own copy; after DDP's averaged step the weights are identical on
    every rank, so the copies are too, and the EMA model can be evaluated sharded.
    """

    def __init__(self, parts: ModelParts, decay: float):
        (module,) = parts.unwrapped()
        self.source, self.decay, self.steps = module, decay, 0
        self.averaged = AveragedModel(module, multi_avg_fn=self._average, use_buffers=True)

    def decay_now(self) -> float:
        """The decay of the next update: ``decay``, warmed up as timm's EMA does
        ((1 + n) / (10 + n) after n updates, while that is smaller), so that a short run's
        average is not mostly its random start."""
        return min(self.decay, (1 + self.steps) / (10 + self.steps))

    @torch.no_grad()
    def _average(
        self,
        averaged: list[torch.Tensor] | tuple[torch.Tensor, ...],
        current: list[torch.Tensor] | tuple[torch.Tensor, ...],
        _count: torch.Tensor | int,
    ) -> None:
        """torch's EMA update (get_ema_multi_avg_fn) at this step's decay: lerp for
        floating tensors, counters (BatchNorm's batches tracked) taken as they are."""
        if torch.is_floating_point(averaged[0]):
            torch._foreach_lerp_(averaged, current, 1 - self.decay_now())
        else:
            torch._foreach_copy_(averaged, current)

    @property
    def module(self) -> nn.Module:
        """The averaged model, to evaluate."""
        return self.averaged.module

    @torch.no_grad()
    def update(self) -> None:
        """Average in the weights the optimizer just stepped."""
        self.averaged.update_parameters(self.source)
        self.steps += 1

    def state_dict(self) -> dict:
        """The averaged weights and how many steps they average, for the checkpoint."""
        return {
            "model": {k: v.detach().cpu() for k, v in self.module.state_dict().items()},
            "n_averaged": int(self.averaged.n_averaged),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume the average where the checkpoint left it."""
        self.module.load_state_dict(state["model"])
        self.averaged.n_averaged.fill_(state["n_averaged"])
        self.steps = int(state["n_averaged"])


def continue_with(
    saved: TrainConfig, old_replicas: int, cfg: TrainConfig, replicas: int, optimizer
) -> None:
    """This run's momentum and weight decay in the loaded optimizer (the schedule's rate
    is set every step from where training stands); say what the rates became."""
    for group in optimizer.param_groups:
        if "momentum" in group:
            group["momentum"] = cfg.momentum
    _set_weight_decay(optimizer, cfg)
    new_lr, old_lr = peak_lr(cfg, replicas), peak_lr(saved, old_replicas)
    if old_replicas != replicas:
        get_logger().info(
            f"world size {old_replicas} -> {replicas}: global batch "
            f"{_global_batch(saved, old_replicas)} -> {_global_batch(cfg, replicas)}, "
            f"lr {old_lr:g} -> {new_lr:g}"
        )
    elif old_lr != new_lr:
        get_logger().info(f"peak lr {old_lr:g} -> {new_lr:g}")


def _set_weight_decay(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> None:
    """Each group's decay as this run's settings give it (groups are named by kind)."""
    decay = {
        "decay": cfg.weight_decay,
        "norm": cfg.norm_weight_decay,
        "bias": cfg.bias_weight_decay,
    }
    for group in optimizer.param_groups:
        value = decay.get(group.get("kind", "decay"))
        group["weight_decay"] = cfg.weight_decay if value is None else value


def _global_batch(cfg: TrainConfig, replicas: int) -> int:
    return cfg.batch * replicas * cfg.grad_accum
