"""The GPU path, as far as a CPU can run it: augmentation where the model is gives the
CPU path's tensors, a step that reads nothing back still agrees on non-finite losses,
and --nproc beyond the GPUs is refused before anything starts."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn
from torchvision import transforms as T

from imagefolders import make_image_folder
from paratrain import TrainConfig, train
from paratrain.data.cache.build import prepare
from paratrain.data.cache.read import CachedImages
from paratrain.data.device_batches import DeviceAugmented, DeviceBatch
from paratrain.data.folder import build_split, load_rgb
from paratrain.data.transforms import TrainAugment, to_chw
from paratrain.distributed.env import DistEnv
from paratrain.distributed.runtime import Runtime
from paratrain.engine.run.control import CUDA_CHECK_EVERY, NonFiniteLoss, StepControl
from paratrain.engine.run.precision import Precision
from paratrain.engine.run.preempt import PreemptionGuard
from paratrain.engine.run.recipe import Recipe
from paratrain.engine.run.state import Progress
from paratrain.engine.run.step import Stepper
from paratrain.engine.trainer import train_step
from paratrain.errors import UserError
from paratrain.parallel.parts import ModelParts
from paratrain.report.loggers import Loggers


@pytest.fixture
def split(tmp_path):
    return build_split(make_image_folder(tmp_path / "data", classes=2, per_class=8, size=(53, 37)))


def test_augmenting_on_the_device_is_the_cpu_paths_crop_within_the_filters_difference(
    split, tmp_path
):
    """Same boxes for the same draws, same flips, same normalisation; the batched
    resize (roi_align's area average) against the per-image antialiased bilinear one:
    within 1.5 grey levels on average (0.4 measured), while the image flipped the other
    way is far."""
    cache = prepare(split.train, 24, "on", 1.0, str(tmp_path / "cache"), workers=0)
    keys = [(i, 1000 + i) for i in range(len(split.train))]
    on_cpu, labels = CachedImages(split.train, cache, TrainAugment(24, 0.3)).__getitems__(keys)
    batch, same = DeviceAugmented(split.train, TrainAugment(24, 0.3), cache).__getitems__(keys)
    assert isinstance(batch, DeviceBatch) and torch.equal(labels, same)
    assert batch.pixels is not None and batch.pixels.shape[0] == len(keys)  # one tensor
    grey = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
    on_device = batch.on(torch.device("cpu"), torch.contiguous_format)
    assert ((on_device - on_cpu) * grey).abs().mean() < 1.5
    assert ((on_device.flip(-1) - on_cpu) * grey).abs().mean() > 5
    assert batch.flips.any() and not batch.flips.all()  # both kinds were drawn


def _augment_ops(batch: DeviceBatch) -> list[str]:
    """The operations ``batch.on`` dispatches itself (not those inside them)."""
    from torch.profiler import ProfilerActivity, profile

    batch.on(torch.device("cpu"), torch.contiguous_format)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        batch.on(torch.device("cpu"), torch.contiguous_format)
    ours = ("aten::", "torchvision::")
    return sorted(
        e.name
        for e in prof.events()
        if e.name.startswith(ours)
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith(ours))
    )


def test_the_batch_is_augmented_in_as_many_operations_at_batch_8_as_at_64(tmp_path):
    """Crop and resize, flip, normalise and erase: the same operations whatever the
    batch (each a kernel or a few on a GPU), one roi_align for every crop."""
    from paratrain.data.transforms import Augment

    data = make_image_folder(tmp_path / "data", classes=2, per_class=36, size=(60, 45))
    split = build_split(data)
    cache = prepare(split.train, 32, "on", 1.0, str(tmp_path / "cache"), workers=0)
    samples = DeviceAugmented(split.train, TrainAugment(Augment(24, 0.3, random_erase=0.5)), cache)
    counted = {}
    for size in (8, 64):
        batch, _ = samples.__getitems__([(i % len(split.train), 7 + i) for i in range(size)])
        assert batch.erases is not None and (batch.erases[:, 2] > 0).any()  # some erased
        counted[size] = _augment_ops(batch)
    assert counted[8] == counted[64]
    assert counted[8].count("torchvision::roi_align") == 1


def test_the_erased_rectangles_are_distributed_as_torchvisions_random_erasing():
    from paratrain.data.transforms import Augment

    augment = TrainAugment(Augment(32, random_erase=0.6))
    torch.manual_seed(0)
    ours = [augment.erase_box(torch.rand(41).tolist()) for _ in range(3000)]
    image = torch.zeros(3, 32, 32)
    theirs = []
    for _ in range(3000):
        if torch.rand(1) < 0.6:
            top, left, h, w, _ = T.RandomErasing.get_params(image, (0.02, 0.33), (0.3, 3.3), [0])
            theirs.append((top, left, h, w) if h < 32 else (0, 0, 0, 0))
        else:
            theirs.append((0, 0, 0, 0))
    for column in range(4):
        a = sorted(box[column] for box in ours)
        b = sorted(box[column] for box in theirs)
        for q in (0.25, 0.5, 0.75, 0.9):
            assert abs(a[int(q * len(a))] - b[int(q * len(b))]) <= 2, (column, q)
    assert abs(sum(b[2] > 0 for b in ours) / 3000 - 0.6) < 0.03


def test_the_crop_boxes_are_distributed_as_torchvisions_random_resized_crop():
    """The boxes drawn for the device (and cached) path against torchvision's own
    RandomResizedCrop.get_params on the same image size: area share and aspect ratio."""
    transform, image = TrainAugment(32, 0.08), torch.zeros(3, 300, 400)
    ours, theirs = [], []
    torch.manual_seed(0)
    for _ in range(4000):
        (_, _, h, w), _ = transform.draw(300, 400)
        ours.append((h * w / (300 * 400), math.log(w / h)))
        _, _, h, w = T.RandomResizedCrop.get_params(image, (0.08, 1.0), (3 / 4, 4 / 3))
        theirs.append((h * w / (300 * 400), math.log(w / h)))
    for column in (0, 1):
        a = sorted(x[column] for x in ours)
        b = sorted(x[column] for x in theirs)
        for q in (0.1, 0.25, 0.5, 0.75, 0.9):  # the quantiles agree to sampling noise
            assert abs(a[int(q * len(a))] - b[int(q * len(b))]) < 0.03, (column, q)


def test_jpegs_decoded_where_the_model_is_train(tmp_path):
    """No cache: the loader hands over each JPEG's bytes; here the CPU decodes them with
    the same code a GPU runs (torchvision's decode_jpeg)."""
    data = make_image_folder(tmp_path / "data", classes=2, per_class=8)
    summary = train(
        TrainConfig(
            data=str(data),
            image_size=16,
            batch_size=4,
            workers=0,
            epochs=1,
            cache="off",
            augment_on="device",
            precision="32",
            output_dir=str(tmp_path / "runs"),
            name="jpeg",
        )
    )
    assert summary["final"]["val_count"] == 4 and math.isfinite(summary["final"]["train_loss"])


def test_a_jpeg_turned_by_its_exif_orientation_is_decoded_in_the_loader(tmp_path):
    """nvJPEG ignores an EXIF orientation: such a file is handed over as upright pixels
    (decoded here as the CPU path decodes it), every other JPEG as its bytes."""
    data = make_image_folder(tmp_path / "data", classes=2, per_class=2, size=(40, 24))
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned 90 degrees clockwise
    pixels = np.arange(24 * 40 * 3, dtype=np.uint8).reshape(24, 40, 3)
    Image.fromarray(pixels).save(data / "class_0" / "turned.jpg", exif=exif, quality=100)
    split = build_split(data)
    samples = split.train + split.val
    turned = [i for i in range(len(samples)) if samples.keys[i].endswith("turned.jpg")]
    assert len(turned) == 1 and len(samples) == 5
    batch, _ = DeviceAugmented(samples, TrainAugment(16)).__getitems__(
        [(i, i) for i in range(len(samples))]
    )
    assert batch.encoded == [i not in turned for i in range(len(samples))]
    upright = to_chw(load_rgb(samples.keys[turned[0]], None, None))
    assert upright.shape == (3, 40, 24)  # turned: the stored 24x40 stands up as 40x24
    assert torch.equal(batch.images[turned[0]], upright)
    height, width = batch.boxes[turned[0], 2:].tolist()
    assert height <= 40 and width <= 24  # its crop box is drawn in the upright image
    assert batch.on(torch.device("cpu"), torch.contiguous_format).shape == (5, 3, 16, 16)


def test_auto_feeds_the_way_measured_fastest_on_a_gpu_and_the_loader_on_a_cpu(split, monkeypatch):
    """--augment-on auto on a GPU: each way timed on a few images, the fastest taken and
    its figures said; on a CPU, the loader, unmeasured. Given ways are taken as given."""
    from paratrain.data import feed

    measured: list[str] = []
    costs = {"loader": 4e-4, "device": 1e-4, "dali": 5e-5}

    def per_image(way, *args):
        measured.append(way)
        return costs[way]

    monkeypatch.setattr(feed, "_per_image", per_image)
    monkeypatch.setattr(feed.dali, "available", lambda: "not installed")
    gpu = SimpleNamespace(device=torch.device("cuda", 0))
    cpu = SimpleNamespace(device=torch.device("cpu"))

    def chosen(runtime, **given):
        return feed.choose_feed(TrainConfig(**given), split, runtime, None, 4, list, None)

    auto = chosen(gpu)
    assert (auto.where, measured) == ("device", ["loader", "device"])  # DALI not installed
    assert auto.words() == (
        "augmented on the device, batch-wide (measured per image: loader 0.4 ms, device 0.1 ms; "
        "4 loader process(es))"
    )
    monkeypatch.setattr(feed.dali, "available", lambda: None)
    assert chosen(gpu).where == "dali" and measured[-3:] == ["loader", "device", "dali"]
    assert chosen(gpu, loader="torch").where == "device"  # --loader torch: DALI not measured
    costs["loader"] = 1e-5
    assert chosen(gpu).where == "loader"
    measured.clear()
    assert chosen(cpu).where == "loader" and not measured
    assert chosen(cpu, augment_on="device").where == "device"
    assert chosen(gpu, augment_on="cpu").words() == "augmented in the loader (--augment-on cpu)"
    assert chosen(cpu, loader="dali").where == "dali" and not measured
    raw = SimpleNamespace(lossless=True)  # the raw cache: pixels, nothing for DALI to decode
    assert feed.choose_feed(TrainConfig(loader="dali"), split, gpu, raw, 4, list, None).where == (
        "device"
    )
    feed.choose_feed(TrainConfig(), split, gpu, raw, 4, list, None)
    assert measured[-2:] == ["loader", "device"] and "dali" not in measured


def test_loader_dali_without_the_package_is_one_line_naming_the_extra(monkeypatch):
    from paratrain.data import feed
    from paratrain.engine.prerun.preflight import check_extras
    from paratrain.errors import UserError

    monkeypatch.setattr(feed.dali, "available", lambda: "the nvidia.dali package is not installed")
    with pytest.raises(UserError, match=r"^--loader dali needs the nvidia.dali package: pip "
                       r"install .*\[dali\]'? --extra-index-url https://pypi.nvidia.com$"):  # fmt: skip
        check_extras(TrainConfig(loader="dali"))
    with pytest.raises(UserError, match="--loader dali: the nvidia.dali package is not installed"):
        feed.choose_feed(TrainConfig(loader="dali"), None, None, None, 0, list, None)


def test_a_measurement_times_each_way_on_the_training_images(split):
    """The real timing on a CPU device (what a GPU run measures, there on CUDA)."""
    from paratrain.data import feed
    from paratrain.data.transforms import Augment, DecodedSamples, TrainAugment

    augment = TrainAugment(Augment.of(TrainConfig(image_size=16)))
    device = torch.device("cpu")
    for way in ("loader", "device"):
        seconds = feed._per_image(
            way, split, device, None, 2, lambda: DecodedSamples(split.train, augment), augment
        )
        assert 0 < seconds < 1.0, way


def _run(on_nonfinite: str, sync_free: bool):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
    )
    parts = ModelParts([model])
    optimizer = torch.optim.SGD(parts.parameters(), lr=0.1, momentum=0.9, fused=True)
    runtime = Runtime(env=DistEnv(), device=torch.device("cpu"), backend=None)
    cfg = TrainConfig(on_nonfinite=on_nonfinite)
    recipe = Recipe(criterion=nn.CrossEntropyLoss(), precision=Precision("32", runtime.device))
    control = StepControl(cfg, runtime, save=None, guard=PreemptionGuard(), sync_free=sync_free)
    return SimpleNamespace(
        parts=parts,
        recipe=recipe,
        optimizer=optimizer,
        progress=Progress(),
        control=control,
        loggers=Loggers(Path("unused"), (), {}, 1),
        stepper=Stepper(parts, optimizer, recipe, control),
        model=model,
    )


def _batch(poisoned: bool = False):
    images = torch.randn(4, 3, 8, 8)
    if poisoned:
        images[0, 0, 0, 0] = float("inf")
    return [(images, torch.randint(0, 3, (4,)))]


def test_without_reading_back_a_skipped_step_still_leaves_everything_as_it_was():
    """The CUDA behaviour, run on a CPU: the flag goes to the fused kernel as found_inf,
    BatchNorm's buffers come back through a where; the skip is counted at the check."""
    run = _run("skip", sync_free=True)
    train_step(run, iter(_batch()), 1)
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    momentum = [run.optimizer.state[p]["momentum_buffer"].clone() for p in run.model.parameters()]
    train_step(run, iter(_batch(poisoned=True)), 1)
    for key, value in run.model.state_dict().items():
        assert torch.equal(value, before[key]), key
    for p, buffer in zip(run.model.parameters(), momentum, strict=True):
        assert torch.equal(run.optimizer.state[p]["momentum_buffer"], buffer)
    assert run.progress.skipped_steps == 0  # not read back yet
    run.control.check(run.progress)
    assert run.progress.skipped_steps == 1


def test_without_reading_back_a_nan_aborts_at_the_next_check_naming_its_step():
    run = _run("abort", sync_free=True)
    train_step(run, iter(_batch()), 1)
    train_step(run, iter(_batch(poisoned=True)), 1)  # step 2: noted on the device only
    with pytest.raises(NonFiniteLoss, match="non-finite loss at step 2"):
        for _ in range(CUDA_CHECK_EVERY):
            train_step(run, iter(_batch()), 1)
    assert run.progress.global_step < 2 + CUDA_CHECK_EVERY  # acted on within one interval


def test_nproc_beyond_the_gpus_is_refused_in_one_line(monkeypatch, tmp_path):
    from paratrain.engine.prerun.preflight import check_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(UserError, match="--nproc 2 needs 2 GPUs and this machine has 1"):
        check_devices(TrainConfig(nproc=2), 2)
    check_devices(TrainConfig(nproc=2, device="cuda:0", backend="gloo"), 2)  # shared, as asked
    with pytest.raises(UserError, match="--device cuda:1: this machine has 1 GPU"):
        check_devices(TrainConfig(device="cuda:1"), 1)
