"""DistributedDataParallel: one process per device, gradients averaged every step."""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratrain.config import TrainConfig
from paratrain.dist.runtime import Runtime


def apply(model: nn.Module, cfg: TrainConfig, runtime: Runtime):
    from paratrain.parallel import ModelParts

    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    wrapped = DistributedDataParallel(
        model,
        device_ids=device_ids,
        # DDP's buckets become the .grad tensors: one copy of the gradients, not two.
        gradient_as_bucket_view=True,
    )
    return ModelParts([wrapped])
