"""Defaults that follow the data: a folder of small images trains near their size, not
upsampled to 224 (3x slower for nothing), and the run says so and how to override it."""

from __future__ import annotations

import time
from pathlib import Path

from imagefolders import make_image_folder
from paratrain.cli import main
from paratrain.config import resolve_train
from paratrain.data import sizes


def _folder(root: Path, size: tuple[int, int]) -> Path:
    return make_image_folder(root, classes=3, per_class=4, size=size)


def test_small_images_set_the_training_size_near_their_median_short_side(tmp_path):
    data = _folder(tmp_path / "d64", (80, 64))  # width x height: 64 on the short side
    assert resolve_train({"data": str(data)}).image_size == 64
    odd = _folder(tmp_path / "d45", (45, 60))  # a multiple of 8 near 45
    assert resolve_train({"data": str(odd)}).image_size == 48
    tiny = _folder(tmp_path / "d12", (12, 12))  # at least 32
    assert resolve_train({"data": str(tiny)}).image_size == 32
    large = _folder(tmp_path / "d300", (400, 300))  # larger than the default: 224
    assert resolve_train({"data": str(large)}).image_size == 224


def test_a_process_that_trains_again_sees_the_images_added_since(tmp_path):
    """The library's train() called twice in one process: the folder is read again
    where it changed, not remembered by its path (it was, for the process's life)."""
    data = _folder(tmp_path / "d", (80, 64))
    assert resolve_train({"data": str(data)}).image_size == 64
    assert sizes._image_count(str(data)) == 12
    time.sleep(0.05)  # a later run: past the kernel's coarse tick for a folder's time
    make_image_folder(data, classes=3, per_class=8, size=(180, 160), seed=1, ext=".png")
    assert sizes._image_count(str(data)) == 36
    assert sizes.median_short_side(str(data)) == (160, 36)  # 24 of the 36 are the larger
    assert resolve_train({"data": str(data)}).image_size == 160


def test_what_the_user_or_the_weights_say_wins(tmp_path):
    data = _folder(tmp_path / "d", (80, 64))
    assert resolve_train({"data": str(data), "image_size": 128}).image_size == 128
    named = resolve_train({"data": str(data), "model": "resnet50", "weights": "IMAGENET1K_V2"})
    assert named.image_size == 224  # the weights' own crop


def test_the_run_says_which_size_it_took_and_how_to_have_the_default(tmp_path, capsys):
    data = _folder(tmp_path / "d", (80, 64))
    assert main(["train", "--data", str(data), "--dry-run"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (
        "--data's images are small (64 px on the short side, the median of 12; "
        "--image-size 224 trains at the default; crops are squares of the training size "
        "shifted at validation's scale, not resized; --crop resized keeps at least 35% of an "
        "image): image_size=64, crop=shifted, crop_scale_min=0.35"
    )
    assert main(["train", "--data", str(data), "--image-size", "96", "--dry-run"]) == 0
    assert "(yours: image_size=96)" in capsys.readouterr().out.splitlines()[0]


def test_small_images_get_shifted_crops_unless_the_user_sets_them(tmp_path):
    """Crops at validation's scale, as small-image recipes cut them; --crop resized
    still keeps them milder than ImageNet's, and a large folder keeps torchvision's."""
    data = _folder(tmp_path / "d", (80, 64))
    assert resolve_train({"data": str(data)}).crop == sizes.SMALL_CROP_KIND == "shifted"
    assert resolve_train({"data": str(data), "crop": "resized"}).crop == "resized"
    assert resolve_train({"data": str(data), "image_size": 48}).crop == "shifted"
    assert resolve_train({"data": str(_folder(tmp_path / "big", (400, 300)))}).crop == "resized"


def test_small_images_get_milder_crops_unless_the_user_sets_them(tmp_path):
    """An 8% crop of a small image leaves a few pixels blown up to the training size."""
    data = _folder(tmp_path / "d", (80, 64))
    assert resolve_train({"data": str(data)}).crop_scale_min == sizes.SMALL_CROP
    given = resolve_train({"data": str(data), "image_size": 48, "crop_scale_min": 0.08})
    assert given.crop_scale_min == 0.08
    assert resolve_train({"data": str(data), "image_size": 48}).crop_scale_min == 0.35
    large = _folder(tmp_path / "d300", (400, 300))  # ImageNet-sized: torchvision's 8%
    assert resolve_train({"data": str(large)}).crop_scale_min == 0.08


def test_sources_that_are_not_folders_keep_the_default():
    assert sizes.suggested_settings({"data": "hf:some/dataset"}) == {}
    assert sizes.suggested_settings({"data": "wds:/x/shard-{000..009}.tar"}) == {}
    assert sizes.suggested_settings({"data": "/no/such/folder"}) == {}


def test_large_images_are_cached_large_enough_for_the_smallest_crop(tmp_path, capsys):
    """A 8% crop of a cache kept at validation's resize is cut from a few pixels of a
    large original: from originals twice that side, the cache keeps the side at which the
    smallest crop still holds the training size, no larger than the originals, where its
    raw pixels fit the budget."""
    data = _folder(tmp_path / "d300", (400, 300))
    cfg = resolve_train({"data": str(data), "image_size": 32})
    assert cfg.cache_side == 114 and cfg.stored_size == 114  # 32 / the root of 0.08
    assert resolve_train({"data": str(data)}).cache_side is None  # 300 px: not twice 256
    milder = resolve_train({"data": str(data), "image_size": 32, "crop_scale_min": 0.5})
    assert milder.cache_side == 46  # 32 / the root of 0.5, above validation's 37
    assert resolve_train({"data": str(data), "image_size": 32, "cache_side": 64}).cache_side == 64
    tight = resolve_train({"data": str(data), "image_size": 32, "cache_max_gb": 1e-6})
    assert tight.cache_side is None and tight.stored_size == 37  # raw pixels would not fit
    assert resolve_train({"data": str(data), "image_size": 128}).cache_side == 300
    assert resolve_train({"data": str(data), "image_size": 160}).cache_side is None  # 183x2 > 300
    resized = resolve_train({"data": str(data), "image_size": 32, "val_resize": 160})
    assert resized.cache_side is None  # validation's own 160 keeps over half of 300
    wide = resolve_train({"data": str(data), "image_size": 64, "crop_scale_min": 0.9})
    assert wide.cache_side is None  # 68: validation's 73 keeps more
    small = _folder(tmp_path / "d64", (80, 64))
    assert resolve_train({"data": str(small)}).cache_side is None  # trains at its own size
    shifted = resolve_train({"data": str(data), "image_size": 32, "crop": "shifted"})
    assert shifted.cache_side is None  # crops at validation's scale: its 37 px hold them
    mid = _folder(tmp_path / "d150", (200, 150))  # small (152 px), twice validation's 73
    assert resolve_train({"data": str(mid), "image_size": 64}).cache_side is None  # shifted
    resized = {"data": str(mid), "image_size": 64, "crop": "resized"}
    assert resolve_train(resized).cache_side == 109  # 64 / the root of 0.35, rounded up
    assert main(["train", "--data", str(data), "--image-size", "32", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "--data's images are large (300 px on the short side, the median of 12): the cache "
        "keeps them at 114 px, not at validation's resize, so that the smallest training crop "
        "is cut from as many pixels as it shows (its raw pixels fit --cache-max-gb): "
        "cache_side=114"
    )
