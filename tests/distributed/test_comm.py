"""Gradient compression hooks on 2 gloo ranks: they train to a finite loss, and the
compressed average stays close to the exact one."""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

from imagefolders import make_image_folder
from spawn import fit_on_rank, run_distributed


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_compressed_gradients_train_to_a_finite_loss(tmp_path, kind):
    # 24 training images: 3 micro-batches of 4 per rank, none of a single image
    data = make_image_folder(tmp_path / "data", classes=3, per_class=10)
    values = dict(
        data=str(data),
        output_dir=str(tmp_path / "runs"),
        image_size=16,
        batch_size=4,
        workers=0,
        epochs=1,
        cache="off",
        grad_compression=kind,
        grad_accum=2,
        name=kind,
    )
    summary = run_distributed(fit_on_rank, 2, values)[0]
    assert summary["world_size"] == 2
    assert math.isfinite(summary["final"]["train_loss"]) and summary["final"]["val_count"] == 6


def _hook_average(rank, world_size, kind):
    from torch import nn

    from paratrain.parallel.ddp import register_compression

    torch.manual_seed(0)
    model = nn.Linear(64, 8)
    wrapped = nn.parallel.DistributedDataParallel(model)
    register_compression(wrapped, kind)
    torch.manual_seed(rank + 1)  # every rank its own data
    wrapped(torch.randn(16, 64)).square().mean().backward()
    return model.weight.grad.clone()


def test_compressed_average_is_close_to_the_exact_one():
    exact = run_distributed(_hook_average, 2, "none")[0]
    for kind, tolerance in (("fp16", 1e-3), ("bf16", 1e-2)):
        compressed = run_distributed(_hook_average, 2, kind)
        assert torch.equal(compressed[0], compressed[1])  # every rank the same average
        torch.testing.assert_close(compressed[0], exact, rtol=tolerance, atol=tolerance)
        assert not torch.equal(compressed[0], exact)  # and it was compressed


def _bench(rank, world_size):
    from paratrain.bench.speed import run_bench
    from paratrain.config import TrainConfig
    from paratrain.distributed.env import detect
    from paratrain.distributed.runtime import Runtime

    runtime = Runtime(env=detect(os.environ), device=torch.device("cpu"), backend="gloo")
    config = TrainConfig(image_size=16, batch_size=4, precision="32")
    return run_bench(config, runtime, steps=3, warmup=1)


def test_bench_on_two_ranks_reports_totals_and_communication():
    first, second = run_distributed(_bench, 2)
    assert second is None  # rank 0 reports
    assert first.world_size == 2
    assert first.images_per_s == pytest.approx(2 * first.images_per_s_per_process)
    assert first.no_sync_step_ms > 0 and first.communication_ms >= 0


def _ddp_settings(rank, world_size, grad_accum):
    from torch import nn

    from paratrain.config import TrainConfig
    from paratrain.distributed.env import detect
    from paratrain.distributed.runtime import Runtime
    from paratrain.parallel.parallelize import parallelize

    runtime = Runtime(env=detect(os.environ), device=torch.device("cpu"), backend="gloo")
    config = TrainConfig(grad_accum=grad_accum, bucket_cap_mb=2.0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    (ddp,) = parallelize(model, config, runtime)
    losses = []
    for step in range(3):  # a static graph traces the first step and reuses it after
        torch.manual_seed(step * 10 + rank)
        loss = ddp(torch.randn(2, 3, 8, 8)).square().mean()
        loss.backward()
        losses.append(model[0].weight.grad.clone())
        model.zero_grad(set_to_none=True)
    return ddp.static_graph, ddp.gradient_as_bucket_view, ddp.bucket_bytes_cap, losses


def test_ddp_is_tuned_and_static_unless_accumulating():
    for grad_accum, static in ((1, True), (2, False)):
        first, second = run_distributed(_ddp_settings, 2, grad_accum)
        assert first[:3] == (static, True, 2 * 2**20)
        for a, b in zip(first[3], second[3], strict=True):
            assert torch.equal(a, b)  # gradients averaged on every step, static or not


class _Block(torch.nn.Module):
    """A small residual block: two of them make the model's repeated blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)

    def forward(self, x):
        return x + torch.relu(self.norm(self.conv(x)))


def _compiled_steps(rank, world_size, compiled, grad_accum, scope="model"):
    from torch import nn

    from paratrain.config import TrainConfig
    from paratrain.distributed.env import detect
    from paratrain.distributed.runtime import Runtime
    from paratrain.parallel.parallelize import parallelize

    runtime = Runtime(env=detect(os.environ), device=torch.device("cpu"), backend="gloo")
    config = TrainConfig(compile=compiled, grad_accum=grad_accum, compile_scope=scope)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        _Block(),
        _Block(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )
    parts = parallelize(model, config, runtime)
    grads = []
    for step in range(2):
        for micro in range(grad_accum):
            torch.manual_seed(100 * step + 10 * micro + rank)
            with parts.no_sync() if micro < grad_accum - 1 else contextlib.nullcontext():
                parts(torch.randn(4, 3, 12, 12)).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
    compiled_blocks = [i for i, m in enumerate(model) if "_compiled_call_impl" in vars(m)]
    return grads, sorted(parts.state_dict()), type(parts[0]).__name__, compiled_blocks


@pytest.mark.parametrize(("scope", "accums"), [("model", (1, 2)), ("blocks", (2,))])
def test_compiled_ddp_gives_eager_gradients_with_and_without_accumulation(scope, accums):
    """Compiled around DDP (``model``), or each repeated block in place inside it
    (``blocks``): the gradients are eager's, and so are the state dict's keys."""
    for grad_accum in accums:
        eager = run_distributed(_compiled_steps, 2, False, grad_accum)
        compiled = run_distributed(_compiled_steps, 2, True, grad_accum, scope)
        assert eager[0][2] == "DistributedDataParallel" and eager[0][3] == []
        if scope == "model":
            assert compiled[0][2] == "OptimizedModule" and compiled[0][3] == []
        else:  # DDP around the model, its two blocks compiled in place
            assert compiled[0][2] == "DistributedDataParallel" and compiled[0][3] == [3, 4]
        assert compiled[0][1] == eager[0][1]  # unified state dict keys, no _orig_mod.
        for rank in (0, 1):
            for got, want in zip(compiled[rank][0], eager[rank][0], strict=True):
                for g, w in zip(got, want, strict=True):
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        for g0, g1 in zip(compiled[0][0][-1], compiled[1][0][-1], strict=True):
            assert torch.equal(g0, g1)  # averaged: every rank holds the same gradient
