"""CUDA-only paths: nccl backend, torch's SyncBatchNorm, device placement.

Skipped where CUDA is absent (this project's CI machines); run them on a GPU machine with
`python -m pytest tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.distributed.env import DistEnv
from paratrain.distributed.runtime import Runtime, choose_backend, choose_device
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


def test_strategy_dp_trains_over_the_visible_gpus(tmp_path):
    from imagefolders import make_image_folder
    from paratrain import TrainConfig, train
    from paratrain.engine import checkpoint

    data = make_image_folder(tmp_path / "data", classes=3, per_class=12)
    summary = train(
        TrainConfig(
            data=str(data),
            strategy="dp",
            image_size=32,
            epochs=1,
            batch_size=8,
            workers=0,
            output_dir=str(tmp_path / "runs"),
            name="dp",
        )
    )
    assert summary["world_size"] == 1 and summary["final"]["val_count"] == 9
    state = checkpoint.load(tmp_path / "runs/dp/checkpoints/last.pt")
    assert not any(k.startswith("module.") for k in state["model"])  # saved unwrapped
