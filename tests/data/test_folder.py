"""Odd images become upright 3-channel RGB; bad ones are found, all of them."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

from imagefolders import make_damaged_folder, make_image_folder
from paratrain.data import folder as folder_module
from paratrain.data.folder import build_split, image_problem, load_rgb
from paratrain.data.scan import find_bad_images, screen
from paratrain.data.transforms import eval_transform
from paratrain.errors import AgreedUserError


def _odd_images(root):
    root.mkdir(parents=True, exist_ok=True)
    rgb = np.zeros((20, 40, 3), dtype=np.uint8)
    rgb[:4, :4] = (255, 0, 0)  # a red mark in the top-left corner
    made = {}
    made["L"] = Image.fromarray(rgb[..., 0]).convert("L")
    made["LA"] = made["L"].convert("LA")
    made["P"] = Image.fromarray(rgb).convert("P")
    made["P"].info["transparency"] = 0
    made["RGBA"] = Image.fromarray(rgb).convert("RGBA")
    made["CMYK"] = Image.fromarray(rgb).convert("CMYK")
    made["I;16"] = Image.fromarray(rgb[..., 0].astype(np.uint16) * 257)
    paths = {}
    for mode, image in made.items():
        ext = ".jpg" if mode == "CMYK" else ".png"
        paths[mode] = root / f"{mode.replace(';', '_')}{ext}"
        image.save(paths[mode])
    exif = Image.Exif()
    exif[0x0112] = 6  # shown rotated 90 degrees clockwise
    paths["exif"] = root / "rotated.jpg"
    Image.fromarray(rgb).save(paths["exif"], exif=exif, quality=100)
    return paths


def test_every_mode_becomes_rgb_and_exif_orientation_is_applied(tmp_path):
    paths = _odd_images(tmp_path / "odd")
    for mode, path in paths.items():
        image = load_rgb(str(path))
        assert image.mode == "RGB", mode
        tensor = eval_transform(16)(image)
        assert tensor.shape == (3, 16, 16) and torch.isfinite(tensor).all(), mode
        if mode != "exif":
            assert image.size == (40, 20), mode
    upright = np.asarray(load_rgb(str(paths["exif"])))
    assert upright.shape == (40, 20, 3)  # width and height swapped
    assert upright[:4, -4:, 0].mean() > 200 and upright[:4, :4, 0].mean() < 60  # mark moved right
    assert np.asarray(load_rgb(str(paths["I;16"])))[:4, :4, 0].min() == 255


def test_problems_are_named():
    assert image_problem(__file__) is not None


def test_error_mode_lists_exactly_the_bad_files(tmp_path):
    data, bad = make_damaged_folder(tmp_path / "d")
    split = build_split(data)
    assert split.ignored == 3
    found = find_bad_images([p for p, _ in split.train + split.val], 0, 1, workers=0, show=False)
    assert [p for p, _ in found] == bad
    assert dict(found)[bad[0]] != "" and "empty file" in dict(found).values()
    with pytest.raises(AgreedUserError) as caught:
        screen(split, "error", 0, 1, 0, tmp_path)
    message = str(caught.value)
    assert message.startswith("4 unreadable image(s)") and all(p in message for p in bad)


def test_skip_mode_keeps_exactly_the_good_files(tmp_path):
    data, bad = make_damaged_folder(tmp_path / "d")
    split = build_split(data)
    kept = screen(split, "skip", 0, 1, 0, tmp_path)
    kept_paths = {p for p, _ in kept.train + kept.val}
    assert kept_paths == {p for p, _ in split.train + split.val} - set(bad)
    listed = [
        line.split("\t")[0] for line in (tmp_path / "bad_images.txt").read_text().splitlines()
    ]
    assert listed == bad


def test_a_slow_scan_shows_a_progress_bar(tmp_path, monkeypatch, capsys):
    data = make_image_folder(tmp_path / "d", classes=2, per_class=12)
    real = folder_module.image_problem

    def slow(path, source=None):
        time.sleep(0.06)
        return real(path, source)

    monkeypatch.setattr("paratrain.data.scan.image_problem", slow)
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)  # as on a terminal
    paths = [str(p) for p in sorted(data.rglob("*.jpg"))]
    assert find_bad_images(paths, 0, 1, workers=0, show=True) == []
    assert "checking images" in capsys.readouterr().err


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.99])
def test_a_truncated_large_jpeg_is_found_though_checked_at_reduced_scale(tmp_path, keep):
    path = tmp_path / "large.jpg"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (300, 400, 3), dtype=np.uint8)).save(path)
    assert image_problem(str(path)) is None
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    assert "truncated" in image_problem(str(path))


_HANG_UP = """
import os, socket, sys, time
from multiprocessing import resource_sharer
from paratrain.data.folder import leave_stop_signals_to_the_rank
if sys.argv[1] == "worker":
    leave_stop_signals_to_the_rank()
shared = resource_sharer.DupFd(os.open(os.devnull, os.O_RDONLY))  # as a batch's tensor is
taker = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
taker.connect(resource_sharer._resource_sharer._address)
time.sleep(0.3)  # the challenge is sent, unread: the rank is interrupted here
taker.close()
time.sleep(0.5)
sys.excepthook(ValueError, ValueError("a worker's own error"), None)
"""


@pytest.mark.parametrize("role", ["worker", "plain"])
def test_a_rank_breaking_off_a_batch_leaves_its_worker_quiet(role):
    """Ctrl-C reaches a rank while it takes a batch's tensors from a loader worker:
    the worker's resource-sharer thread used to print the broken connection's
    traceback (seen on CI). As a worker is set up, it says nothing of it, and still
    reports its own errors; without that set-up, the same hang-up prints one."""
    done = subprocess.run(
        [sys.executable, "-c", _HANG_UP, role], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    hung_up = "ConnectionResetError" in done.stderr or "EOFError" in done.stderr
    assert hung_up == (role == "plain"), done.stderr
    assert "a worker's own error" in done.stderr
