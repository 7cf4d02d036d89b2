"""Bad images on 2 processes: error lists them all once; skip trains on exactly the rest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from imagefolders import make_damaged_folder

pytestmark = pytest.mark.slow

FAST = [
    "--model",
    "resnet18",
    "--image-size",
    "16",
    "--batch-size",
    "8",
    "--workers",
    "1",
    "--epochs",
    "1",
    "--nproc",
    "2",
]


def _run(root, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PARATRAIN_CACHE"] = str(root / "cache")
    return subprocess.run(
        [sys.executable, "-m", "paratrain", "train", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_bad_images_error_then_skip_on_two_processes(tmp_path):
    data, bad = make_damaged_folder(tmp_path / "d")
    error = _run(tmp_path, "--data", str(data), "--name", "err", *FAST)
    assert error.returncode == 2, error.stderr
    lines = [line for line in error.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "4 unreadable image(s)" in lines[0]
    assert all(path in lines[0] for path in bad)
    assert "Traceback" not in error.stderr and "epoch 1/1" not in error.stdout

    skip = _run(tmp_path, "--data", str(data), "--name", "skip", "--bad-images", "skip", *FAST)
    assert skip.returncode == 0, skip.stderr
    assert "ignored 3 file(s) without an image extension" in skip.stdout
    assert "skipping 4 unreadable image(s)" in skip.stdout
    listed = (tmp_path / "runs/skip/bad_images.txt").read_text().splitlines()
    assert [line.split("\t")[0] for line in listed] == bad
    # 102 images, 20% per class to val (7 each): 81 train / 21 val, less the 4 bad ones
    import re

    counts = re.search(r"(\d+) train / (\d+) val images", skip.stdout).groups()
    assert int(counts[0]) + int(counts[1]) == 102 - 4
    assert "decoded-image cache" in skip.stdout
    # eval of that run leaves out unreadable validation images, as the run did
    from paratrain.data.folder import build_split

    damaged = next(path for path, _ in build_split(data).val if path not in bad)
    Path(damaged).write_bytes(b"")  # one more, in the validation part this time
    evaluated = subprocess.run(
        [
            *(sys.executable, "-m", "paratrain", "eval", "--json"),
            *("--checkpoint", "runs/skip/checkpoints/last.pt", "--data", str(data)),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert evaluated.returncode == 0, evaluated.stderr
    assert evaluated.stdout.startswith("skipping 1 unreadable validation image(s), as the run")
    report = json.loads(evaluated.stdout.splitlines()[-1])
    assert report["count"] == int(counts[1]) - 1
