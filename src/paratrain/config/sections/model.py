"""The network: its name, the weights it starts from, what is frozen and how its parts learn."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.schema import setting


@dataclass(frozen=True)
class ModelSettings:
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
    zero_init_residual: bool = setting(
        False,
        "start each residual block's last BatchNorm at zero, so every block starts as the "
        "identity (torchvision's zero_init_residual, timm's zero_init_last); from scratch "
        "only, as --weights replace it",
        group="model",
        resume="fixed",
        resume_why="it sets the initial weights",
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
    teacher: str | None = setting(
        None,
        "a trained model the run learns from as well as from the labels (knowledge "
        "distillation): a model name, as --model; it runs in eval mode, without gradients, "
        "in the run's precision (replicated under ddp, sharded under fsdp)",
        group="model",
        pattern=r"[A-Za-z0-9_./-]+",
        pattern_text="a model name (see `paratrain models`)",
        metavar="MODEL",
        resume="fixed",
        resume_why="the run learnt from that teacher",
    )
    teacher_weights: str | None = setting(
        None,
        "the teacher's weights: a paratrain checkpoint or weights file, or a name as "
        "--weights takes; they must fit the teacher with the data's classes exactly",
        group="model",
        path="weights",
        metavar="NAME|FILE",
        resume="fixed",
        resume_why="the run learnt from those weights",
    )
    kd_alpha: float = setting(
        0.5,
        "the distillation share of the loss: (1 - a) x the labels' cross-entropy + a x T^2 "
        "x KL(teacher || student) at --kd-temperature T",
        group="model",
        low=0.0,
        high=1.0,
    )
    kd_temperature: float = setting(
        4.0,
        "softens the teacher's and the student's distributions for distillation",
        group="model",
        low=0.0,
        low_open=True,
        high=100.0,
    )
