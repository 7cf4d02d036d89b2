"""--order global as a user runs it: the same weights at 1, 2 and 4 processes, and a
run resumed mid-epoch on another world size that ends as the uninterrupted one does.

The model has no BatchNorm (timm's test_convnext: LayerNorm), so that nothing but the
order and the weighing of the losses could tell the world sizes apart; fp32 and
--deterministic. 18 training images at a global batch of 16 make every epoch's second
step short: 2 images, one each at 2 processes, and at 4 processes two ranks with none
(each a stand-in, weighted zero). Tolerance: 1e-5, relative, for every tensor (measured
9e-7 after 2 epochs on a 2-core EPYC; padded order differs by 0.28 at 4 processes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imagefolders import make_image_folder
from trainruns import run, weights

pytestmark = pytest.mark.slow
GLOBAL_BATCH = 16
TOLERANCE = 1e-5


def _job(folder: Path, name: str, nproc: int, *extra: str) -> list[str]:
    return [
        "--data", str(folder), "--nproc", str(nproc), "--epochs", "2", "--name", name,
        "--model", "timm/test_convnext", "--image-size", "32",
        "--batch-size", str(GLOBAL_BATCH // nproc), "--workers", "0",
        "--order", "global", "--deterministic", "--precision", "32", *extra,
    ]  # fmt: skip


def _worst(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys()
    return max(
        (float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-12)), k)
        for k in a
        if a[k].is_floating_point()
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("order")
    return root, make_image_folder(root / "data", classes=3, per_class=6, layout="given")


@pytest.fixture(scope="module")
def one_process(data) -> dict[str, torch.Tensor]:
    root, folder = data
    out, _ = run(root, *_job(folder, "one", 1))
    assert out.returncode == 0, out.stderr
    return weights(root, "one")


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_same_weights_at_any_world_size(data, one_process, nproc):
    root, folder = data
    out, _ = run(root, *_job(folder, f"world{nproc}", nproc))
    assert out.returncode == 0, out.stderr
    assert f"global batch: {GLOBAL_BATCH} ({GLOBAL_BATCH // nproc} x {nproc}" in out.stdout
    assert "order global: the same steps at any world size" in out.stdout
    worst, key = _worst(weights(root, f"world{nproc}"), one_process)
    assert worst <= TOLERANCE, key


def test_resumed_from_4_processes_on_2_it_ends_as_one_process_does(data, one_process):
    """Stopped at 4 processes after epoch 2's first step (checkpointed every step),
    resumed at 2 with the same global batch: the epoch's last step (2 images) is trained
    once, and the weights are one process's."""
    root, folder = data
    every = ["--save-every-steps", "1"]
    crashed, _ = run(
        root, *_job(folder, "moved", 4, *every), PARATRAIN_INJECT="rank=1,step=4,kind=raise"
    )
    assert crashed.returncode != 0
    state = torch.load(root / "runs/moved/checkpoints/last.pt", weights_only=False)
    progress = state["parts"]["progress"]
    assert (progress["epoch"], progress["step_in_epoch"], progress["consumed"]) == (1, 1, 16)
    resumed, _ = run(root, *_job(folder, "moved", 2, *every), "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from runs/moved/checkpoints/last.pt at epoch 2, step 1" in resumed.stdout
    worst, key = _worst(weights(root, "moved"), one_process)
    assert worst <= TOLERANCE, key


def test_padded_order_at_4_processes_ends_elsewhere(data, one_process):
    """The flag is what makes the difference: at 4 processes the padded order repeats
    2 images to fill the ranks and trains them twice, and its weights are not one
    process's."""
    root, folder = data
    job = _job(folder, "padded4", 4)
    job[job.index("global")] = "padded"
    out, _ = run(root, *job)
    assert out.returncode == 0, out.stderr
    assert _worst(weights(root, "padded4"), one_process)[0] > 100 * TOLERANCE
