"""Speed options, for correctness: precision modes, accumulation, clipping."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from paratrain import TrainConfig, train
from paratrain.distributed.env import DistEnv
from paratrain.distributed.runtime import Runtime
from paratrain.distributed.runtime import resolve_precision as resolve
from paratrain.engine.run.control import StepControl
from paratrain.engine.run.precision import Precision
from paratrain.engine.run.preempt import PreemptionGuard
from paratrain.engine.run.recipe import Recipe
from paratrain.engine.run.state import Progress
from paratrain.engine.run.step import Stepper
from paratrain.engine.trainer import train_step
from paratrain.errors import UserError
from paratrain.parallel.parts import ModelParts
from paratrain.report.loggers import Loggers

AMX = "processor : 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
OLD = "processor : 0\nflags\t\t: fpu sse2 avx2\n"


def test_auto_precision_follows_the_cpu_flags():
    cpu = torch.device("cpu")
    assert resolve("auto", cpu, cpuinfo=AMX) == "bf16-mixed"
    assert resolve("auto", cpu, cpuinfo=OLD) == "32"
    assert resolve("bf16-mixed", cpu, cpuinfo=OLD) == "bf16-mixed"  # asked for: given
    with pytest.raises(UserError, match="16-mixed needs CUDA"):
        resolve("16-mixed", cpu)


@pytest.mark.parametrize(
    "options",
    [
        {"precision": "32"},
        {"precision": "bf16-mixed", "clip_grad": 1.0},
        {"precision": "auto", "grad_accum": 3},
    ],
    ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()),
)
def test_precision_modes_train_and_evaluate(image_folder, tmp_path, options):
    summary = train(
        TrainConfig(
            data=str(image_folder),
            image_size=16,
            epochs=1,
            batch_size=4,
            workers=0,
            output_dir=str(tmp_path),
            name="p",
            **options,
        )
    )
    final = summary["final"]
    # (one epoch of 6 steps leaves BatchNorm's running statistics far from the data, so the
    # validation loss itself can overflow; the counts and accuracy are what is checked)
    assert math.isfinite(final["train_loss"]) and 0.0 <= final["val_top1"] <= 1.0
    assert final["val_count"] == 6  # 3 classes x 12 images, 20% held out


def _one_step(model, batches, accum, clip=None):
    """Run train_step over ``batches`` (one optimizer step) and return its update."""
    parts = ModelParts([model])
    optimizer = torch.optim.SGD(parts.parameters(), lr=1.0)  # w' = w - grad
    before = [p.detach().clone() for p in parts.parameters()]
    runtime = Runtime(env=DistEnv(), device=torch.device("cpu"), backend=None)
    cfg = TrainConfig(grad_accum=accum, clip_grad=clip)
    recipe = Recipe(
        criterion=nn.CrossEntropyLoss(),
        precision=Precision("32", runtime.device),
        grad_accum=accum,
        clip_grad=clip,
    )
    control = StepControl(cfg, runtime, save=None, guard=PreemptionGuard())
    run = SimpleNamespace(
        parts=parts,
        recipe=recipe,
        optimizer=optimizer,
        progress=Progress(),
        control=control,
        loggers=Loggers(Path("unused"), (), {}, 1),
        stepper=Stepper(parts, optimizer, recipe, control),
    )
    train_step(run, iter(batches), len(batches))
    assert run.progress.global_step == 1
    return [b - p.detach() for b, p in zip(before, parts.parameters(), strict=True)]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def test_accumulating_k_micro_batches_equals_one_k_times_larger_batch():
    torch.manual_seed(1)
    images, labels = torch.randn(12, 3, 8, 8), torch.randint(0, 3, (12,))
    micro = [(images[i : i + 4], labels[i : i + 4]) for i in range(0, 12, 4)]
    accumulated = _one_step(_model(), micro, accum=3)
    whole = _one_step(_model(), [(images, labels)], accum=1)
    for a, b in zip(accumulated, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_clipping_bounds_the_gradient_norm():
    torch.manual_seed(1)
    batch = [(torch.randn(8, 3, 8, 8) * 50, torch.randint(0, 3, (8,)))]
    free = _one_step(_model(), batch, accum=1)
    clipped = _one_step(_model(), batch, accum=1, clip=0.5)
    norm = lambda grads: float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))  # noqa: E731
    assert norm(free) > 0.5
    assert norm(clipped) == pytest.approx(0.5, rel=1e-4)


def test_bench_json_has_every_field(capsys):
    import dataclasses
    import json

    from paratrain.bench.speed import BenchResult
    from paratrain.cli import main

    argv = ["bench", "--image-size", "16", "--batch-size", "4", "--steps", "3", "--warmup", "1"]
    assert main([*argv, "--precision", "32", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {f.name for f in dataclasses.fields(BenchResult)}
    assert (result["world_size"], result["precision"], result["steps"]) == (1, "32", 3)
    for phase in ("data_ms", "forward_ms", "backward_ms", "optimizer_ms"):
        assert 0 <= result[phase] < result["step_ms"]  # each step's part below its whole
    assert result["communication_ms"] == 0.0  # one process: nothing to communicate
    assert result["images_per_s"] == pytest.approx(4 / (result["step_ms"] / 1000))
    assert result["peak_memory_mb"] > 0
    assert main([*argv]) == 0
    assert "images/s:" in capsys.readouterr().out


def test_memory_format_auto_is_channels_last_for_conv_models():
    from torchvision.models import resnet18, vit_b_16

    from paratrain.parallel.parts import memory_format_for

    conv, cuda, cpu = resnet18(num_classes=3), torch.device("cuda"), torch.device("cpu")
    assert memory_format_for(conv, "auto", cuda) == torch.channels_last
    assert memory_format_for(conv, "auto", cpu) == torch.channels_last
    assert memory_format_for(conv, "channels_last", cpu) == torch.channels_last
    assert memory_format_for(conv, "contiguous", cuda) == torch.contiguous_format
    vit = vit_b_16(num_classes=3, image_size=32)
    assert memory_format_for(vit, "auto", cuda) == torch.contiguous_format
    assert memory_format_for(vit, "auto", cpu) == torch.contiguous_format


def test_channels_last_trains_and_keeps_the_format(image_folder, tmp_path):
    from paratrain.engine.checkpointing import checkpoint

    summary = train(
        TrainConfig(
            data=str(image_folder),
            image_size=16,
            epochs=1,
            batch_size=4,
            workers=0,
            output_dir=str(tmp_path),
            name="cl",
            memory_format="channels_last",
        )
    )
    assert math.isfinite(summary["final"]["train_loss"])
    state = checkpoint.load(tmp_path / "cl/checkpoints/last.pt")
    assert state.model["conv1.weight"].is_contiguous(memory_format=torch.channels_last)


def test_bf16_on_cpu_runs_strided_convolutions_over_one_pixel_in_fp32():
    from torch import nn

    from paratrain.engine.run.precision import Precision

    torch.manual_seed(0)
    precision = Precision("bf16-mixed", torch.device("cpu"))
    taps = torch.ones(3, 3, dtype=torch.bool)
    taps[1, 1] = False  # on a 1x1 input every other tap sees only padding
    for _ in range(10):  # unguarded, about half of these gave garbage there (inf at worst)
        conv = nn.Conv2d(256, 512, 3, stride=2, padding=1, bias=False)
        precision.prepare([conv])
        with precision.autocast():
            tiny = conv(torch.randn(4, 256, 1, 1, requires_grad=True))
            assert torch.is_autocast_enabled("cpu")  # given back after the module
            small = conv(torch.randn(4, 256, 2, 2))  # no garbage measured: stays bf16
        (tiny * torch.randn_like(tiny)).sum().backward()
        assert tiny.dtype == torch.float32 and small.dtype == torch.bfloat16
        assert torch.equal(conv.weight.grad[:, :, taps], torch.zeros(512, 256, 8))
    plain = nn.Conv2d(3, 4, 3)
    Precision("32", torch.device("cpu")).prepare([plain])  # fp32 training: nothing added
    assert not plain._forward_pre_hooks
