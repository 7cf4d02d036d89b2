"""--loader dali (data/dali.py): what paratrain's loader hands DALI is tested here on
every machine; DALI's own graph, in its CPU-only mode, where the nvidia.dali package is
installed (pip install paratrain[dali] --extra-index-url https://pypi.nvidia.com), and
on CUDA in tests/gpu."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms.v2.functional as F

from imagefolders import make_image_folder
from paratrain.data import dali
from paratrain.data.device_batches import DeviceAugmented, DeviceBatch
from paratrain.data.folder import build_split, load_rgb
from paratrain.data.transforms import TrainAugment, to_chw


@pytest.fixture
def jpegs(tmp_path):
    return build_split(make_image_folder(tmp_path / "data", classes=2, per_class=8, size=(53, 37)))


def test_the_loader_hands_dali_each_jpeg_with_its_crop_in_pixels_and_its_flip(jpegs):
    reader = DeviceAugmented(jpegs.train, TrainAugment(24, 0.3), dali=True)
    keys = [(i, 500 + i) for i in range(len(jpegs.train))]
    batch, _ = reader.__getitems__(keys)
    assert isinstance(batch, DeviceBatch) and batch.dali and all(batch.encoded)
    given = dali.external_inputs(batch.images, batch.boxes, batch.flips)
    assert set(given) == {"jpegs", "anchors", "shapes", "flips"}
    for i, (top, left, height, width) in enumerate(batch.boxes.tolist()):
        assert bytes(given["jpegs"][i][:3]) == b"\xff\xd8\xff"  # the file's bytes, undecoded
        assert given["anchors"][i].tolist() == [left, top]  # x, y: DALI's "WH" axes
        assert given["shapes"][i].tolist() == [width, height]
        assert int(given["flips"][i]) == int(batch.flips[i])
        assert 0 <= left and left + width <= 53 and 0 <= top and top + height <= 37


def test_dalis_crops_are_torchvisions_on_the_same_boxes(jpegs):
    """DALI's CPU-only graph against torchvision's resized_crop (antialiased bilinear)
    and flip, box for box: within a few grey levels (the decoders and resize filters
    differ slightly), while the unflipped crop is far."""
    pytest.importorskip(
        "nvidia.dali",
        reason="NVIDIA DALI is not installed here (pip install paratrain[dali] "
        "--extra-index-url https://pypi.nvidia.com)",
    )
    reader = DeviceAugmented(jpegs.train, TrainAugment(24, 0.3), dali=True)
    keys = [(i, 700 + i) for i in range(len(jpegs.train))]
    batch, _ = reader.__getitems__(keys)
    got = dali.crops(batch.images, batch.boxes, batch.flips, 24, torch.device("cpu")).float()
    want = []
    for i, (top, left, height, width) in enumerate(batch.boxes.tolist()):
        image = to_chw(load_rgb(jpegs.train.keys[i], None, None))
        crop = F.resized_crop(image, top, left, height, width, [24, 24], antialias=True)
        want.append(crop.flip(-1) if batch.flips[i] else crop)
    reference = torch.stack(want).float()
    assert got.shape == reference.shape == (len(keys), 3, 24, 24)
    assert (got - reference).abs().mean() < 4
    assert (got.flip(-1) - reference).abs().mean() > 8
