"""--strategy split --devices cuda:0,cuda:1: one process, consecutive stages of the model
on the listed devices, activations moved from each stage to the next (naive model
parallelism: one device computes at a time). On CPU, ``--devices cpu,cpu`` runs the same
code, which is how it is tested without GPUs."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.distributed.runtime import Runtime
from paratrain.errors import AgreedUserError, UserError
from paratrain.log import get_logger
from paratrain.parallel import partition
from paratrain.parallel.parts import ModelParts, memory_format_for


def parse_devices(cfg: TrainConfig) -> list[torch.device]:
    """--devices as devices this machine has."""
    devices = []
    for name in cfg.device_list():
        device = torch.device(name)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise UserError(f"--devices {name}: CUDA is not available on this machine")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise UserError(
                    f"--devices {name}: this machine has {torch.cuda.device_count()} GPU(s)"
                )
        devices.append(device)
    return devices


def apply(model: nn.Module, cfg: TrainConfig, runtime: Runtime) -> ModelParts:
    """Consecutive stages of the model on ``--devices``, in this one process."""
    if runtime.world_size > 1:  # every rank alike: told once
        raise AgreedUserError(
            "--strategy split runs in one process; use --strategy pipeline across processes"
        )
    devices = parse_devices(cfg)
    memory_format = memory_format_for(model, cfg.memory_format, devices[0])
    model = model.to(memory_format=memory_format)
    # profiled on the CPU, where the whole model is (it may not fit any one device)
    sample = partition.sample_images(cfg.train_size, cfg.batch_size, memory_format)
    limits = [partition.device_memory(device) for device in devices]
    traced, starts = partition.plan_stages(
        model,
        len(devices),
        sample,
        cfg.split_point_list(),
        model_name=cfg.model,
        slots=partition.optimizer_slots(cfg.opt, cfg.momentum),
        limit=min(limits) if None not in limits else None,
    )
    get_logger().info(
        partition.format_plan(
            partition.describe(traced, starts), [str(d) for d in devices], len(sample)
        )
    )
    stages = partition.build_stages(traced, starts)
    placed = (stage.to(device) for stage, device in zip(stages, devices, strict=True))
    return ModelParts(placed, devices=devices, memory_format=memory_format)
