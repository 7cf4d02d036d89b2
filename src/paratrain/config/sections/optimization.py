"""How the weights move: batch, rates, optimizer, weight decay, and the recipe (augmentation policy, label smoothing, EMA, mixup)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from paratrain.config.schema import setting
from paratrain.config.words import OPTIMIZERS


@dataclass(frozen=True)
class OptimizationSettings:
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
    momentum: float = setting(
        0.9, "SGD momentum", group="optimisation", low=0.0, high=1.0, high_open=True
    )
    weight_decay: float = setting(
        0.005, "L2 penalty (decoupled for adamw)", group="optimisation", low=0.0
    )
    seed: int = setting(
        0,
        "seed of weights and sampling",
        group="optimisation",
        low=0,
        high=2**32 - 1,
        resume="fixed_mid_epoch",
    )
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
    ema_decay: float | Literal["auto"] | None = setting(
        "auto",
        "keep an exponential moving average of the weights with this decay (warmed up over "
        "the first steps as timm's: (1 + n) / (10 + n) after n), evaluated every epoch "
        "beside the raw weights; best.pt and the run's best top-1 are then the average's "
        "(eval, predict and export take it with --ema); auto: an average over about two "
        "epochs' steps where the strategy keeps one, none under --budget or with several "
        "labels an image; 0: none",
        group="recipe",
        low=0.0,
        high=1.0,
        high_open=True,
        auto=True,
    )
    mixup: float = setting(0.0, "MixUp Beta alpha, e.g. 0.2 (0: off)", group="recipe", low=0.0)
    cutmix: float = setting(0.0, "CutMix Beta alpha, e.g. 1.0 (0: off)", group="recipe", low=0.0)
