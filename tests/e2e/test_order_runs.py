"""--order global as a run trains: the same weights at 1, 2 and 4 processes, and a run
resumed mid-epoch on another world size that ends as the uninterrupted one does.

The model has no BatchNorm (timm's test_convnext: LayerNorm), so that nothing but the
order and the weighing of the losses could tell the world sizes apart; fp32 and
--deterministic. 18 training images at a global batch of 16 make every epoch's second
step short: 2 images, one each at 2 processes, and at 4 processes two ranks with none
(each a stand-in, weighted zero). Tolerance: 1e-5, relative, for every tensor (measured
7e-7 after 2 epochs on a 2-core EPYC; the padded order at 4 processes is 0.28 away).
The processes are forked with the loop (tests/spawn.py), as torchrun's would run it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from imagefolders import make_image_folder
from spawn import RanksFailed, fit_on_rank, run_distributed

pytestmark = pytest.mark.slow
GLOBAL_BATCH = 16
TOLERANCE = 1e-5


def _values(root: Path, name: str, nproc: int, **extra) -> dict:
    return dict(
        data=str(root / "data"), output_dir=str(root / "runs"), name=name, epochs=2,
        model="timm/test_convnext", image_size=32, batch_size=GLOBAL_BATCH // nproc,
        workers=0, order="global", deterministic=True, precision="32",
        cache_dir=str(root / "cache"), **extra,
    )  # fmt: skip


def _weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(root / "runs" / name / "checkpoints/last.pt", weights_only=False)["model"]


def _worst(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys()
    return max(
        (float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp(min=1e-12)), k)
        for k in a
        if a[k].is_floating_point()
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("order")
    make_image_folder(root / "data", classes=3, per_class=6, layout="given")
    return root


@pytest.fixture(scope="module")
def one_process(root) -> dict[str, torch.Tensor]:
    run_distributed(fit_on_rank, 1, _values(root, "one", 1))
    return _weights(root, "one")


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_same_weights_at_any_world_size(root, one_process, nproc):
    run_distributed(fit_on_rank, nproc, _values(root, f"world{nproc}", nproc))
    worst, key = _worst(_weights(root, f"world{nproc}"), one_process)
    assert worst <= TOLERANCE, key


def test_resumed_from_4_processes_on_2_it_ends_as_one_process_does(root, one_process, monkeypatch):
    """Stopped at 4 processes after epoch 2's first step (checkpointed every step),
    resumed at 2 with the same global batch: the epoch's last step (2 images) is trained
    once, and the weights are one process's."""
    every = {"save_every_steps": 1}
    monkeypatch.setenv("PARATRAIN_INJECT", "rank=1,step=4,kind=raise")
    with pytest.raises(RanksFailed, match=r"(?s)rank 1: .*injected failure at step 4"):
        run_distributed(fit_on_rank, 4, _values(root, "moved", 4, **every))
    monkeypatch.delenv("PARATRAIN_INJECT")
    state = torch.load(root / "runs/moved/checkpoints/last.pt", weights_only=False)
    progress = state["parts"]["progress"]
    assert (progress["epoch"], progress["step_in_epoch"], progress["consumed"]) == (1, 1, 16)
    summary = run_distributed(fit_on_rank, 2, _values(root, "moved", 2, resume="auto", **every))
    assert summary[0]["epochs"] == 2 and summary[0]["world_size"] == 2
    worst, key = _worst(_weights(root, "moved"), one_process)
    assert worst <= TOLERANCE, key


def test_padded_order_at_4_processes_ends_elsewhere(root, one_process):
    """The flag is what makes the difference: at 4 processes the padded order repeats
    2 images to fill the ranks and trains them twice, and its weights are not one
    process's."""
    run_distributed(fit_on_rank, 4, {**_values(root, "padded4", 4), "order": "padded"})
    assert _worst(_weights(root, "padded4"), one_process)[0] > 100 * TOLERANCE


def test_the_start_line_says_the_order_is_global(root, capsys):
    from paratrain.cli import main

    argv = ["train", "--data", str(root / "data"), "--order", "global", "--nproc", "4"]
    assert main([*argv, "--batch-size", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (
        "global batch: 16 (4 x 4 replica(s)); order global: the same steps at any world size" in out
    )
