"""A disk that is full when paratrain writes to it: one line naming the file, the space
it needed and what is free there, exit 2, never a traceback.

The full disk is real: a 1 MB tmpfs mounted in a mount namespace of the command's own
(``unshare -m``), so nothing outside the command sees it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from imagefolders import make_image_folder
from paratrain import TrainConfig, train

pytestmark = pytest.mark.slow


def _on_a_small_disk(mount: str, *command: str) -> subprocess.CompletedProcess:
    """``command`` with a 1 MB tmpfs at ``mount``, in a mount namespace of its own."""
    script = f'mount -t tmpfs -o size=1m tmpfs "{mount}" && exec "$@"'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *command],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
    )


def test_an_export_to_a_full_disk_is_one_line(tmp_path):
    data = make_image_folder(tmp_path / "data", classes=3, per_class=6)
    cfg = TrainConfig(
        data=str(data), image_size=16, batch_size=4, workers=0, epochs=1, cache="off",
        output_dir=str(tmp_path / "runs"), name="r",
    )  # fmt: skip
    train(cfg.validate())
    small = tmp_path / "small"
    small.mkdir()
    target = small / "model.safetensors"
    done = _on_a_small_disk(
        str(small), sys.executable, "-m", "paratrain", "export", "--checkpoint",
        str(tmp_path / "runs/r/checkpoints/last.pt"), "--format", "safetensors",
        "--out", str(target),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"paratrain: error: no space left on the disk of {target}")
    assert "needs about 42.7 MB" in lines[0] and "MB free there" in lines[0]
