"""N processes x batch b compute what 1 process computes with batch N*b (gloo, CPU)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.distributed.env import detect
from paratrain.distributed.runtime import Runtime
from paratrain.engine.run.recipe import build_optimizer
from paratrain.models.registry import build_model, logits_of
from paratrain.parallel.parallelize import parallelize
from spawn import in_single_process, run_distributed

pytestmark = pytest.mark.slow
GLOBAL_BATCH = 16
SIZE = 32  # at 16 pixels ResNet-18 ends at 1x1, and fp32 BatchNorm gradients themselves drift 1.6e-5 from fp64


class NoBatchNormNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 16, 3, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, classes),
        )

    def forward(self, x):
        return self.body(x)


def _one_step(rank, world, model_name, sync_bn):
    cfg = TrainConfig(model="resnet18", image_size=SIZE, sync_bn=sync_bn, lr=0.1, seed=3)
    torch.manual_seed(0)
    x = torch.randn(GLOBAL_BATCH, 3, SIZE, SIZE)
    y = torch.randint(0, 10, (GLOBAL_BATCH,))
    per_rank = GLOBAL_BATCH // world
    x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
    if model_name == "no-bn":
        torch.manual_seed(cfg.seed)
        model = NoBatchNormNet()
    else:
        model = build_model(cfg, 10)
    runtime = Runtime(
        env=detect(os.environ), device=torch.device("cpu"), backend="gloo" if world > 1 else None
    )
    parts = parallelize(model, cfg, runtime)
    optimizer = build_optimizer(parts, cfg, world)
    before = parts.state_dict()
    loss = nn.functional.cross_entropy(logits_of(parts(x)), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return before, parts.state_dict()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("model_name, sync_bn", [("no-bn", False), ("resnet18", True)])
def test_one_step_matches_one_process_with_n_times_the_batch(world, model_name, sync_bn):
    reference_before, reference = in_single_process(_one_step, model_name, False)
    results = run_distributed(_one_step, world, model_name, sync_bn)
    for before, after in results:
        assert after.keys() == reference.keys()
        for key, value in reference.items():
            if value.is_floating_point():
                assert _relative(after[key], value) <= 1e-5, key
                moved = _relative(reference[key], reference_before[key])
                if "weight" in key and moved > 0:  # the update itself, not just the weights
                    update = after[key].double() - before[key].double()
                    ref_update = value.double() - reference_before[key].double()
                    assert _relative(update, ref_update) <= 1e-3, key
            else:
                assert torch.equal(after[key], value), key


def test_without_sync_bn_the_batchnorm_statistics_differ():
    _, reference = in_single_process(_one_step, "resnet18", False)
    results = run_distributed(_one_step, 2, "resnet18", False)
    stats = [k for k in reference if k.endswith("running_mean")]
    # DDP broadcasts rank 0's buffers: rank 0's local statistics, not the global ones
    differing = [k for k in stats if _relative(results[0][1][k], reference[k]) > 1e-3]
    assert len(differing) == len(stats)
