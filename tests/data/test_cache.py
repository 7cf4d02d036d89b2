"""The decoded-image cache gives the eval transform's exact tensors, and rebuilds on change."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from imagefolders import make_image_folder
from paratrain.data.cache.build import prepare
from paratrain.data.cache.read import CachedImages, cached_eval_transform
from paratrain.data.folder import ImageSamples, build_split, load_rgb, open_image
from paratrain.data.transforms import TrainAugment, eval_resize, eval_transform


def _varied_folder(root):
    data = make_image_folder(root, classes=2, per_class=6, size=(64, 48))
    Image.fromarray(np.full((30, 90, 3), 77, np.uint8)).save(data / "class_0" / "wide.png")
    exif = Image.Exif()
    exif[0x0112] = 8
    Image.fromarray(np.arange(50 * 20 * 3, dtype=np.uint8).reshape(50, 20, 3)).save(
        data / "class_1" / "turned.jpg", exif=exif
    )
    rng = np.random.default_rng(0)  # large enough to decode at reduced scale
    Image.fromarray(rng.integers(0, 255, (150, 200, 3), dtype=np.uint8)).save(
        data / "class_0" / "large.jpg"
    )
    Image.fromarray(rng.integers(0, 255, (90, 310, 3), dtype=np.uint8)).save(
        data / "class_1" / "large_turned.jpg", exif=exif
    )
    return data


def test_eval_tensors_are_identical_to_the_decode_path(tmp_path):
    split = build_split(_varied_folder(tmp_path / "d"), val_fraction=0.5)
    everything = split.train + split.val
    cache = prepare(everything, 32, "on", 1.0, str(tmp_path / "cache"), workers=0)
    assert cache is not None and (cache.directory / "manifest.json").exists()
    cached = CachedImages(everything, cache, cached_eval_transform(32))
    decoded = ImageSamples(everything, eval_transform(32), at_least=eval_resize(32))
    for i in range(len(everything)):
        assert torch.equal(cached[i][0], decoded[i][0]), everything[i][0]
        assert cached[i][1] == decoded[i][1]


def test_large_jpegs_decode_at_reduced_scale_and_stay_large_enough(tmp_path):
    data = _varied_folder(tmp_path / "d")
    large, turned = data / "class_0" / "large.jpg", data / "class_1" / "large_turned.jpg"
    assert open_image(str(large), 37).size == (50, 38)  # 1/4 scale: both sides >= 37
    assert open_image(str(large), 70).size == (100, 75)  # 1/2: 1/4 would be too small
    assert open_image(str(large), 80).size == (200, 150)  # 1/2 would be too small
    assert open_image(str(large)).size == (200, 150)
    assert open_image(str(turned), 37).size == (155, 45)  # 1/2 scale; turned upright later
    upright = load_rgb(str(turned), 37)
    assert upright.size == (45, 155)
    png = data / "class_0" / "wide.png"
    assert open_image(str(png), 10).size == (90, 30)  # other formats decode whole
    full = ImageSamples([(str(large), 0)], eval_transform(32))[0][0]
    reduced = ImageSamples([(str(large), 0)], eval_transform(32), at_least=eval_resize(32))[0][0]
    assert full.shape == reduced.shape == (3, 32, 32)
    assert (full - reduced).abs().mean() < 0.5  # the same picture, not the same pixels


def test_train_transform_on_cached_uint8(tmp_path):
    split = build_split(_varied_folder(tmp_path / "d"))
    cache = prepare(split.train, 24, "on", 1.0, str(tmp_path / "cache"), workers=0)
    dataset = CachedImages(split.train, cache, TrainAugment(24, 0.3, 0.5))
    image, _ = dataset[(0, 123)]
    again, _ = dataset[(0, 123)]
    other, _ = dataset[(0, 124)]
    assert image.shape == (3, 24, 24) and image.dtype == torch.float32
    assert torch.equal(image, again) and not torch.equal(image, other)  # seeded per sample
    assert cache.image(0).dtype == torch.uint8 and min(cache.image(0).shape[1:]) == 27


def test_a_cache_side_keeps_large_originals_larger_and_validation_keeps_its_resize(tmp_path):
    """--cache-side: the cache keeps the short side asked for (never below validation's
    resize), so that a small training crop of a large original is cut from more pixels;
    validation, whose resize the cache then does not hold, decodes as it would uncached."""
    from paratrain.config import TrainConfig
    from paratrain.data.loaders import validation_loader

    assert TrainConfig(image_size=64, cache_side=40).stored_size == 73  # validation's resize
    cfg = TrainConfig(image_size=24, cache_side=90, workers=0)
    split = build_split(_varied_folder(tmp_path / "d"))
    kept = {}
    for side in (cfg.stored_size, TrainConfig(image_size=24).stored_size):
        cache = prepare(split.train + split.val, 24, "raw", 1.0, str(tmp_path / "c"), workers=0,
                        short=side)  # fmt: skip
        large = [i for i, key in enumerate(split.train.keys) if key.endswith("large.jpg")]
        kept[side] = min(cache.image(cache.slots(split.train)[large[0]]).shape[1:])
    assert kept == {90: 90, 27: 27}
    loader = validation_loader(split.val, cfg, 4, 0, 0, 1, cache=None)
    cached = validation_loader(split.val, cfg, 4, 0, 0, 1, prepare(
        split.val, 24, "raw", 1.0, str(tmp_path / "c"), workers=0, short=cfg.stored_size))  # fmt: skip
    assert not isinstance(cached.dataset, CachedImages)  # a second resize would change them
    for (a, _), (b, _) in zip(loader, cached, strict=True):
        assert a.shape[1:] == (3, 24, 24) and torch.equal(a, b)


def test_changed_data_rebuilds_and_auto_respects_the_budget(tmp_path, monkeypatch):
    data = _varied_folder(tmp_path / "d")
    split = build_split(data)
    first = prepare(split.train, 32, "auto", 1.0, str(tmp_path / "cache"), workers=0)
    same = prepare(build_split(data).train, 32, "auto", 1.0, str(tmp_path / "cache"), workers=0)
    assert same.directory == first.directory and first.kind == "raw"
    path = split.train[0][0]
    Image.fromarray(np.zeros((48, 64, 3), np.uint8)).save(path)
    os.utime(path, ns=(1, 1))
    split = build_split(data)  # the next start lists the changed file
    changed = prepare(split.train, 32, "auto", 1.0, str(tmp_path / "cache"), workers=0)
    assert changed.directory != first.directory
    assert changed.image(0).sum() == 0
    # over the budget for raw pixels: packed JPEG, where the disk has room; else none
    packed = prepare(split.train, 32, "auto", 1e-9, str(tmp_path / "other"), workers=0)
    assert packed is not None and packed.kind == "packed"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=100))
    assert prepare(split.train, 32, "auto", 1e-9, str(tmp_path / "third"), workers=0) is None
    assert prepare(split.train, 32, "off", 1.0, str(tmp_path / "cache"), workers=0) is None


def test_crop_boxes_stay_inside_and_follow_scale_and_ratio():
    import math

    transform = TrainAugment(32, crop_scale_min=0.25)
    generator = torch.Generator().manual_seed(0)
    for height, width in [(40, 60), (60, 40), (27, 300), (300, 27)]:
        for _ in range(200):
            draws = torch.rand(41, generator=generator).tolist()
            top, left, h, w = transform.crop_box(height, width, draws)
            assert 0 <= top and top + h <= height and 0 <= left and left + w <= width
            assert h > 0 and w > 0
            if (height, width) in [(40, 60), (60, 40)]:  # the loop succeeds on such shapes
                assert 0.25 * 0.8 <= h * w / (height * width) <= 1.0
                assert math.log(3 / 4) - 0.2 <= math.log(w / h) <= math.log(4 / 3) + 0.2


def test_a_shifted_crop_keeps_the_pixels_at_the_scale_validation_sees_them():
    """--crop shifted: from an image stored at validation's short side (73 for 64), the
    training size's own pixels at every place the crop can take, not resampled; from an
    original twice that side, a square twice the size, resized down to the same scale,
    and from a smaller one a smaller square, resized up."""
    from dataclasses import replace

    from paratrain.config import TrainConfig
    from paratrain.data.transforms import Augment

    cfg = TrainConfig(image_size=64, crop="shifted", hflip=0.0)
    aug = Augment.of(cfg)
    assert (aug.crop, aug.scale_side) == ("shifted", 73)
    transform = TrainAugment(aug)
    generator = torch.Generator().manual_seed(0)
    image = torch.randint(0, 256, (3, 73, 90), dtype=torch.uint8, generator=generator)
    places = set()
    for _ in range(300):
        top, left, h, w = transform.crop_box(73, 90, torch.rand(41, generator=generator).tolist())
        assert (h, w) == (64, 64) and 0 <= top <= 9 and 0 <= left <= 26
        places.add((top, left))
    assert {t for t, _ in places} == set(range(10)) and len({x for _, x in places}) == 27
    box = (5, 11, 64, 64)
    out = transform.apply(image, box, flip=False)
    own = image[:, 5:69, 11:75].float()
    assert torch.equal(out, own.sub(transform.mean).mul(transform.inv_std))
    assert transform.crop_box(146, 180, [0.5] * 41)[2:] == (128, 128)
    assert transform.crop_box(40, 50, [0.5] * 41)[2:] == (35, 35)  # 64 * 40 / 73, upsampled
    as_stored = TrainAugment(replace(aug, scale_side=0))
    assert as_stored.crop_box(146, 180, [0.5] * 41)[2:] == (64, 64)
    assert as_stored.crop_box(40, 50, [0.5] * 41)[2:] == (40, 40)  # smaller: its short side
    resized = TrainAugment(replace(aug, crop="resized"))
    assert resized.crop_box(73, 90, [0.0] * 41)[2:] != (64, 64)  # the default resamples


def test_building_the_cache_is_the_screen_and_a_ready_cache_needs_none(tmp_path, monkeypatch):
    from paratrain.data.cache import base as cache_module
    from paratrain.data.scan import screen

    data = make_image_folder(tmp_path / "d", classes=2, per_class=8, size=(40, 30))
    files = sorted(data.rglob("*.jpg"))
    files[3].write_bytes(files[3].read_bytes()[:120])  # truncated
    files[9].write_bytes(b"")  # empty
    split = build_split(data, val_fraction=0.25)
    samples = split.train + split.val
    decoded = []
    real = cache_module.read_rgb
    monkeypatch.setattr(cache_module, "read_rgb", lambda p, *a: decoded.append(p) or real(p, *a))

    built = prepare(samples, 24, "on", 1.0, str(tmp_path / "c"), workers=0)
    assert sorted(p for p, _ in built.bad) == sorted([str(files[3]), str(files[9])])
    assert dict(built.bad)[str(files[9])] == "empty file"
    assert len(decoded) == len(samples)  # each image decoded once, bad ones included

    def no_scan(*args, **kwargs):
        raise AssertionError("a separate decoding pass ran")

    monkeypatch.setattr("paratrain.data.scan.find_bad_images", no_scan)
    kept = screen(split, "skip", 0, 1, 0, tmp_path, found=built.bad)
    assert len(kept.train) + len(kept.val) == len(samples) - 2
    images = CachedImages(kept.train, built, cached_eval_transform(24))
    rows = built.slots(kept.train)
    assert len(set(rows.tolist())) == len(kept.train)
    for i, (path, _) in enumerate(kept.train):  # each read from its own slot
        assert samples.keys[int(rows[i])] == path
        assert torch.equal(images[i][0], cached_eval_transform(24)(built.image(int(rows[i]))))

    decoded.clear()
    again = prepare(samples, 24, "on", 1.0, str(tmp_path / "c"), workers=0)
    assert decoded == [] and again.bad == built.bad  # ready: read, not decoded again


def test_the_packed_cache_holds_small_jpegs_read_as_the_raw_pixels_nearly_are(tmp_path):
    from paratrain.data import jpeg
    from paratrain.data.device_batches import DeviceAugmented

    data = _varied_folder(tmp_path / "d")
    ramp = np.linspace(0, 255, 120)  # a smooth picture, as photos mostly are
    smooth = np.stack(
        [
            ramp[None, :].repeat(90, 0),
            ramp[:90, None].repeat(120, 1),
            255 - ramp[None, :].repeat(90, 0),
        ],
        -1,
    )
    Image.fromarray(smooth.astype(np.uint8)).save(data / "class_0" / "smooth.png")
    split = build_split(data, val_fraction=0.01)
    assert any(key.endswith("smooth.png") for key in split.train.keys)
    raw = prepare(split.train, 32, "raw", 1.0, str(tmp_path / "cache"), workers=0)
    packed = prepare(split.train, 32, "packed", 1.0, str(tmp_path / "cache"), workers=0)
    assert packed.kind == "packed" and packed.directory != raw.directory
    assert [p.startswith("part-") for p in packed.parts] == [True]
    assert packed.nbytes < raw.nbytes  # JPEG at quality 90 is smaller than the pixels
    for row in range(len(split.train)):
        a, b = raw.image(row), packed.image(row)
        assert a.shape == b.shape  # the same resize; only the re-encoding differs
        # most test images are noise, which JPEG's 4:2:0 chroma blurs; colour stays
        assert (a.float().mean((1, 2)) - b.float().mean((1, 2))).abs().max() < 2
        if split.train[row][0].endswith("smooth.png"):
            assert (a.float() - b.float()).abs().mean() < 1.5
        assert torch.equal(b, packed.image(row))  # the same pixels every read
    # the device path gets a packed entry's bytes, and decodes them to the same pixels
    device = DeviceAugmented(split.train, TrainAugment(24), packed)
    batch, _ = device.__getitems__([(0, 5), (1, 6)])
    assert batch.encoded == [True, True]
    on_cpu = batch.on(torch.device("cpu"), torch.contiguous_format)
    cached = CachedImages(split.train, packed, TrainAugment(24)).__getitems__([(0, 5), (1, 6)])[0]
    grey = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255  # the batched resize's
    assert ((on_cpu - cached) * grey).abs().mean() < 1.5  # filter against the per-image one
    # both decoders installed give the same pixels
    stored = packed.stored(0)[0].numpy().tobytes()
    if jpeg.simplejpeg is not None:
        assert np.array_equal(jpeg.decode(stored, "simplejpeg"), jpeg.decode(stored, "PIL"))


def test_validation_reads_a_packed_cache_never(tmp_path):
    from paratrain.config import TrainConfig
    from paratrain.data.loaders import validation_loader

    split = build_split(_varied_folder(tmp_path / "d"))
    cfg = TrainConfig(image_size=32, workers=0)
    for kind, cached in (("raw", True), ("packed", False)):
        cache = prepare(
            split.train + split.val,
            32,
            kind,
            1.0,
            str(tmp_path / "c"),
            workers=0,
            short=cfg.stored_size,
        )
        loader = validation_loader(split.val, cfg, 4, 0, 0, 1, cache)
        assert isinstance(loader.dataset, CachedImages) is cached, kind  # JPEG is lossy


def _builds_left(base) -> list[str]:
    return sorted(p.name for p in base.rglob(".*.tmp-*"))


@pytest.mark.parametrize("kind", ["raw", "packed"])
def test_an_interrupted_build_removes_its_own_temporary_folder(tmp_path, monkeypatch, kind):
    """Ctrl-C during a build left its temporary folder until a later build removed it;
    now the interrupted process removes it and lets the lock go."""
    from paratrain.data.cache import build as cache_module

    split = build_split(make_image_folder(tmp_path / "d", classes=2, per_class=6), 0.2)
    base = tmp_path / "cache"
    real = cache_module._Decode.__getitem__

    def interrupted(self, k):  # Ctrl-C once the build has written its first chunk
        real(self, k)
        raise KeyboardInterrupt

    monkeypatch.setattr(cache_module._Decode, "__getitem__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(split.train, 32, kind, 1.0, str(base), workers=0)
    assert _builds_left(base) == [] and cache_module._held_locks == {}
    monkeypatch.setattr(cache_module._Decode, "__getitem__", real)
    built = prepare(split.train, 32, kind, 1.0, str(base), workers=0)  # not blocked
    assert built is not None and built.kind == kind


def test_a_disk_that_fills_during_the_build_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """Another program fills the disk while the packed cache is written: one line
    naming the build's folder, the space it planned and what is free, and no
    half-built folder left (it was an OSError traceback and a folder left behind)."""
    import errno

    from paratrain.data.cache import build as cache_module
    from paratrain.errors import AgreedUserError

    split = build_split(make_image_folder(tmp_path / "d", classes=2, per_class=6), 0.2)
    base = tmp_path / "cache"

    def full(self, k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_module._Decode, "__getitem__", full)
    with pytest.raises(AgreedUserError) as told:
        prepare(split.train, 32, "packed", 1.0, str(base), workers=0)
    message = str(told.value)
    assert message.startswith(f"no space left on the disk of {base}/decoded/.")
    assert ": writing it needs about 0." in message and " MB," in message
    assert "free there; free some space, or write elsewhere" in message
    assert "\n" not in message
    assert _builds_left(base) == [] and cache_module._held_locks == {}
