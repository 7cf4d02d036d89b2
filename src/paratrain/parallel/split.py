"""--strategy split --devices cuda:0,cuda:1: one process, consecutive stages of the model
on the listed devices, activations moved from each stage to the next (naive model
parallelism: one device computes at a time). On CPU, ``--devices cpu,cpu`` runs the same
code, which is how it is tested without GPUs."""

from __future__ import annotations

import re

import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.config.words import DEVICE, DEVICE_TEXT
from paratrain.distributed.runtime import Runtime
from paratrain.errors import AgreedUserError, UserError
from paratrain.log import get_logger
from paratrain.parallel import partition
from paratrain.parallel.base import DeviceMemory, MemoryProfile, Strategy, parse_list, staged_memory
from paratrain.parallel.parts import ModelParts, memory_format_for


def device_list(cfg: TrainConfig) -> list[str]:
    """--devices as a list of device names, each checked for its form."""
    names = parse_list(cfg.devices)
    if len(names) < 2:
        raise UserError(
            f"--strategy split needs --devices with at least 2 devices, got {cfg.devices!r}"
        )
    for name in names:
        if not re.fullmatch(DEVICE, name):
            raise UserError(f"--devices: not a device name: {name!r} ({DEVICE_TEXT})")
    return names


def parse_devices(cfg: TrainConfig) -> list[torch.device]:
    """--devices as devices this machine has."""
    devices = []
    for name in device_list(cfg):
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


class Split(Strategy):
    name = "split"
    why = "one stage per device in one process: only one device computes at a time"
    one_process = True
    one_process_hint = "it spans --devices from one; --strategy pipeline runs stages apart"
    min_devices = 2
    speed_order = 3
    takes = frozenset()

    def check_own(self, cfg: TrainConfig, world: int | None) -> None:
        device_list(cfg)

    def check_machine(self, cfg: TrainConfig, world: int) -> None:
        parse_devices(cfg)

    def memory(self, profile: MemoryProfile) -> DeviceMemory:
        return staged_memory(self.name, profile, pipelined=False)

    def wrap(self, model: nn.Module, cfg: TrainConfig, runtime: Runtime) -> ModelParts:
        """Consecutive stages of the model on ``--devices``, in this one process."""
        if runtime.world_size > 1:  # every rank alike: told once
            raise AgreedUserError(
                "--strategy split runs in one process; use --strategy pipeline across processes"
            )
        devices = parse_devices(cfg)
        memory_format = memory_format_for(model, cfg.memory_format, devices[0])
        model = model.to(memory_format=memory_format)
        # profiled on the CPU, where the whole model is (it may not fit any one device)
        sample = partition.sample_images(cfg.train_size, cfg.batch, memory_format)
        limits = [partition.device_memory(device) for device in devices]
        known = [limit for limit in limits if limit is not None]
        traced, starts = partition.plan_stages(
            model,
            len(devices),
            sample,
            cfg.split_point_list(),
            model_name=cfg.model,
            slots=partition.optimizer_slots(cfg.opt, cfg.momentum),
            limit=min(known) if len(known) == len(limits) else None,
        )
        get_logger().info(
            partition.format_plan(
                partition.describe(traced, starts), [str(d) for d in devices], len(sample)
            )
        )
        stages = partition.build_stages(traced, starts)
        placed = (stage.to(device) for stage, device in zip(stages, devices, strict=True))
        return ModelParts(placed, devices=devices, memory_format=memory_format)


STRATEGY = Split()
