"""Every CUDA path, asserting values: skipped where CUDA is absent (CI), run on a GPU
machine with `python -m pytest tests/gpu` (benchmarks/gpu_check.sh runs them).

Paths that need two ranks on two GPUs (NCCL refuses two ranks on one GPU) are skipped
with fewer than two; on one GPU, two processes share it through gloo instead.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from imagefolders import make_image_folder
from paratrain import TrainConfig, train
from paratrain.distributed.env import DistEnv
from paratrain.distributed.runtime import Runtime, choose_backend, choose_device
from paratrain.engine.checkpointing import checkpoint
from paratrain.parallel import sync_batchnorm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 GPUs: NCCL refuses two ranks on one GPU"
)
CUDA = torch.device("cuda", 0)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("gpu") / "data", classes=3, per_class=12)


def _run(**values):
    return dict(image_size=32, epochs=1, batch_size=8, workers=0, **values)


def test_cuda_ranks_use_nccl_and_their_local_device():
    env = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, source="torchrun")
    device = choose_device(env)
    assert device.type == "cuda" and device.index == 1 % torch.cuda.device_count()
    assert choose_backend(device) == "nccl"


def test_sync_bn_on_cuda_is_torchs_own():
    runtime = Runtime(env=DistEnv(), device=CUDA, backend="nccl")
    model = sync_batchnorm.apply(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)), runtime)
    assert isinstance(model[1], nn.SyncBatchNorm)


def test_auto_precision_on_cuda_is_bf16_where_the_gpu_has_it():
    from paratrain.distributed.runtime import resolve_precision as resolve

    expected = "bf16-mixed" if torch.cuda.is_bf16_supported() else "32"
    assert resolve("auto", CUDA) == expected


def test_strategy_dp_trains_over_the_visible_gpus(tmp_path, data):
    summary = train(
        TrainConfig(
            data=str(data), strategy="dp", output_dir=str(tmp_path / "runs"), name="dp", **_run()
        )
    )
    assert summary["world_size"] == 1 and summary["final"]["val_count"] == 6  # 20% of 3 x 12
    state = checkpoint.load(tmp_path / "runs/dp/checkpoints/last.pt")
    assert not any(k.startswith("module.") for k in state.model)  # saved unwrapped


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_run_on_cuda_saves_and_resumes_everything(tmp_path, data, precision):
    """Cache on, augmentation on the GPU, channels_last; the checkpoint keeps the CUDA RNG
    states and (16-mixed) the GradScaler, and the resumed run picks them up."""
    settings = dict(
        data=str(data),
        precision=precision,
        output_dir=str(tmp_path / "runs"),
        name="r",
        cache="on",
        augment_on="device",
    )
    first = train(TrainConfig(**settings, **_run()))
    assert first["final"]["val_count"] == 6 and math.isfinite(first["final"]["train_loss"])
    state = checkpoint.load(tmp_path / "runs/r/checkpoints/last.pt")
    cuda_rng = state.parts["rng"][0]["cuda"]
    assert len(cuda_rng) == torch.cuda.device_count() and cuda_rng[0].dtype == torch.uint8
    if precision == "16-mixed":
        assert state.scaler["scale"] > 0
    second = train(TrainConfig(**settings, resume="auto", **{**_run(), "epochs": 2}))
    assert second["epochs"] == 2 and second["final"]["val_count"] == 6
    resumed = checkpoint.load(tmp_path / "runs/r/checkpoints/last.pt")
    if precision == "16-mixed":
        assert resumed.scaler["_growth_tracker"] >= 0 and resumed.scaler["scale"] > 0


def _step_run(on_nonfinite: str = "abort", precision: str = "bf16-mixed"):
    from paratrain.engine.run.control import StepControl
    from paratrain.engine.run.precision import Precision
    from paratrain.engine.run.preempt import PreemptionGuard
    from paratrain.engine.run.recipe import Recipe, build_optimizer
    from paratrain.engine.run.state import Progress
    from paratrain.engine.run.step import Stepper
    from paratrain.models.registry import create_model
    from paratrain.parallel.parts import ModelParts
    from paratrain.report.loggers import Loggers

    torch.manual_seed(0)
    model = create_model("resnet18", 10).to(CUDA, memory_format=torch.channels_last)
    parts = ModelParts([model], devices=[CUDA], memory_format=torch.channels_last)
    cfg = TrainConfig(on_nonfinite=on_nonfinite, precision=precision)
    runtime = Runtime(env=DistEnv(), device=CUDA, backend=None)
    optimizer = build_optimizer(parts, cfg, 1)
    assert optimizer.param_groups[0]["fused"]
    recipe = Recipe(criterion=nn.CrossEntropyLoss(), precision=Precision(precision, CUDA))
    control = StepControl(cfg, runtime, save=None, guard=PreemptionGuard(), sync_free=True)
    return SimpleNamespace(
        parts=parts,
        recipe=recipe,
        optimizer=optimizer,
        progress=Progress(totals=torch.zeros(3, dtype=torch.float64, device=CUDA)),
        control=control,
        loggers=Loggers(Path("unused"), (), {}, 1),
        stepper=Stepper(parts, optimizer, recipe, control),
    )


@pytest.mark.parametrize(
    "on_nonfinite, precision",
    [("abort", "bf16-mixed"), ("skip", "bf16-mixed"), ("abort", "16-mixed")],
)
def test_a_step_never_waits_on_the_device(on_nonfinite, precision):
    """Under torch.cuda.set_sync_debug_mode('error') any host read inside a step fails.
    16-mixed: the GradScaler hands its scale and inf flag to the fused optimizer."""
    from paratrain.engine.trainer import train_step

    run = _step_run(on_nonfinite, precision)
    batches = [
        (
            torch.randn(16, 3, 64, 64, device=CUDA).contiguous(memory_format=torch.channels_last),
            torch.randint(0, 10, (16,), device=CUDA),
        )
        for _ in range(6)
    ]
    train_step(run, iter(batches[:1]), 1)  # first step: kernels chosen, state created
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batch in batches[1:]:
            train_step(run, iter([batch]), 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    totals = run.progress.totals.tolist()
    assert run.progress.global_step == 6 and totals[2] == 6 * 16 and math.isfinite(totals[0])


def test_loader_batches_arrive_pinned_and_augment_on_the_gpu(tmp_path, data):
    from paratrain.data.cache.build import prepare
    from paratrain.data.device_batches import DeviceBatch
    from paratrain.data.folder import build_split
    from paratrain.data.loaders import make_loaders

    cfg = TrainConfig(data=str(data), image_size=32, batch_size=8, workers=1, augment_on="device")
    split = build_split(data)
    runtime = Runtime(env=DistEnv(), device=CUDA, backend=None)
    cache = prepare(split.train + split.val, 32, "on", 1.0, str(tmp_path / "c"), 0)
    loaders = make_loaders(cfg, split, runtime, cache, 0, 1)
    batch, labels = next(iter(loaders.train))
    assert isinstance(batch, DeviceBatch) and all(image.is_pinned() for image in batch.images)
    on_gpu = batch.on(CUDA, torch.channels_last)
    on_cpu = batch.on(torch.device("cpu"), torch.contiguous_format)
    assert on_gpu.is_cuda and on_gpu.shape == (8, 3, 32, 32)
    assert (on_gpu.cpu() - on_cpu).abs().max() < 0.05  # the resize kernels differ by a level


def test_jpegs_decode_on_the_gpu(tmp_path, data):
    from paratrain.data.device_batches import DeviceAugmented
    from paratrain.data.folder import build_split
    from paratrain.data.transforms import TrainAugment

    split = build_split(data)
    batch, _ = DeviceAugmented(split.train[:6], TrainAugment(32)).__getitems__(
        [(i, i) for i in range(6)]
    )
    assert all(batch.encoded)
    _decoders_agree(
        batch.on(CUDA, torch.contiguous_format).cpu(),
        batch.on(torch.device("cpu"), torch.contiguous_format),
    )


def _decoders_agree(on_gpu: torch.Tensor, on_cpu: torch.Tensor) -> None:
    """nvJPEG and libjpeg-turbo (IDCT, chroma upsampling) differ by a level or two on
    average; on these noise images (every pixel an edge) by up to 15 levels at a few
    pixels, measured on an H200 (0.26 normalised)."""
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    levels = ((on_gpu - on_cpu) * std * 255).abs()
    mean, top = levels.mean().item(), levels.max().item()
    assert mean < 2.0 and top < 32, f"mean {mean:.2f} levels, max {top:.1f}"


def test_a_packed_cache_batch_decodes_on_the_gpu_in_one_call(tmp_path, data, monkeypatch):
    """The packed cache hands its JPEG bytes to the device: nvJPEG decodes the batch in
    one call (not one image at a time), to what the CPU path reads within the decoders'
    difference."""
    import torchvision.io

    from paratrain.data.cache.build import prepare
    from paratrain.data.device_batches import DeviceAugmented
    from paratrain.data.folder import build_split
    from paratrain.data.transforms import TrainAugment

    split = build_split(data)
    packed = prepare(split.train, 32, "packed", 1.0, str(tmp_path / "c"), 0)
    calls = []
    real = torchvision.io.decode_jpeg
    monkeypatch.setattr(
        torchvision.io,
        "decode_jpeg",
        lambda images, **kw: calls.append(len(images)) or real(images, **kw),
    )
    batch, _ = DeviceAugmented(split.train, TrainAugment(32), packed).__getitems__(
        [(i, i) for i in range(8)]
    )
    assert all(batch.encoded)
    on_gpu = batch.on(CUDA, torch.contiguous_format).cpu()
    assert calls == [8]
    on_cpu = batch.on(torch.device("cpu"), torch.contiguous_format)
    _decoders_agree(on_gpu, on_cpu)


def test_bench_on_cuda_reports_speed_and_peak_memory():
    from paratrain.bench.speed import run_bench

    runtime = Runtime(env=DistEnv(), device=CUDA, backend=None)
    cfg = TrainConfig(model="resnet18", image_size=64, batch_size=32)
    result = run_bench(cfg, runtime, steps=5, warmup=2)
    assert result.device == "cuda" and result.images_per_s > 0
    assert 0 < result.peak_memory_mb < torch.cuda.get_device_properties(0).total_memory / 2**20


def test_split_over_one_gpu_balances_within_its_memory(tmp_path, data):
    from paratrain.parallel import partition

    assert partition.device_memory(CUDA) == torch.cuda.get_device_properties(0).total_memory
    summary = train(
        TrainConfig(
            data=str(data),
            strategy="split",
            devices="cuda:0,cuda:0",
            output_dir=str(tmp_path / "runs"),
            name="s",
            **_run(),
        )
    )
    assert summary["final"]["val_count"] == 6


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PARATRAIN_CACHE": str(cwd / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "paratrain", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_more_processes_than_gpus_are_refused_in_one_line(tmp_path, data):
    n = torch.cuda.device_count() + 1
    done = _cli("train", "--data", str(data), "--nproc", str(n), cwd=tmp_path)
    assert done.returncode == 2
    assert f"--nproc {n} needs {n} GPUs" in done.stderr and "Traceback" not in done.stderr


def test_two_processes_share_one_gpu_through_gloo(tmp_path, data):
    done = _cli(
        "train",
        "--data",
        str(data),
        "--nproc",
        "2",
        "--device",
        "cuda:0",
        "--backend",
        "gloo",
        "--image-size",
        "32",
        "--batch-size",
        "8",
        "--epochs",
        "1",
        "--name",
        "shared",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "runs/shared/summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final"]["val_count"] == 6


@two_gpus
@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "pipeline"])
def test_two_ranks_over_nccl(tmp_path, data, strategy):
    extra = ["--sync-bn"] if strategy != "pipeline" else ["--microbatches", "2"]
    done = _cli(
        "train",
        "--data",
        str(data),
        "--nproc",
        "2",
        "--strategy",
        strategy,
        "--image-size",
        "32",
        "--batch-size",
        "8",
        "--epochs",
        "1",
        "--name",
        strategy,
        *extra,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / f"runs/{strategy}/summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final"]["val_count"] == 6


@pytest.mark.parametrize("cache", ["off", "packed"])
def test_dali_feeds_a_run_from_the_files_and_from_the_packed_cache(tmp_path, data, cache):
    """--loader dali on CUDA: nvJPEG decodes each crop's region of the files' (or the
    packed cache's) JPEGs; the run trains and evaluates every validation image once, and
    its crops are the roi_align path's within a few grey levels."""
    pytest.importorskip(
        "nvidia.dali",
        reason="NVIDIA DALI is not installed here (pip install paratrain[dali] "
        "--extra-index-url https://pypi.nvidia.com)",
    )
    from dataclasses import replace as swapped

    from paratrain.data import dali
    from paratrain.data.device_batches import DeviceAugmented
    from paratrain.data.folder import build_split
    from paratrain.data.transforms import TrainAugment

    summary = train(TrainConfig(data=str(data), loader="dali", cache=cache, name=cache,
                                output_dir=str(tmp_path / "runs"), **_run()))  # fmt: skip
    assert summary["final"]["val_count"] == 6 and math.isfinite(summary["final"]["train_loss"])
    split = build_split(data)
    batch, _ = DeviceAugmented(split.train, TrainAugment(32, 0.3), dali=True).__getitems__(
        [(i, 900 + i) for i in range(8)]
    )
    by_dali = dali.crops(batch.images, batch.boxes, batch.flips, 32, CUDA).float()
    by_roi = swapped(batch, dali=False)._crops(CUDA)
    assert by_dali.shape == by_roi.shape == (8, 3, 32, 32)
    assert (by_dali - by_roi).abs().mean() < 6
