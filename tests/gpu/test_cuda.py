"""CUDA-only paths: nccl backend, torch's SyncBatchNorm, device placement.

Skipped where CUDA is absent (this project's CI machines); run them on a GPU machine with
`python -m pytest tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.dist.env import DistEnv
from paratrain.dist.runtime import Runtime, choose_backend, choose_device
from paratrain.parallel import sync_batchnorm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_ranks_use_nccl_and_their_local_device():
    env = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, source="torchrun")
    device = choose_device(env)
    assert device.type == "cuda" and device.index == 1 % torch.cuda.device_count()
    assert choose_backend(device) == "nccl"


def test_sync_bn_on_cuda_is_torchs_own():
    env = DistEnv()
    runtime = Runtime(env=env, device=torch.device("cuda", 0), backend="nccl")
    model = sync_batchnorm.apply(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), runtime)
    assert isinstance(model[1], nn.SyncBatchNorm)
