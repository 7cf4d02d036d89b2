"""Shared fixtures: small generated image folders, environment hygiene."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))

from imagefolders import make_image_folder  # noqa: E402


def pytest_configure(config):
    """Caches of this test session in a folder of its own, not the user's: paratrain's
    (decoded images, the screen's verdicts, the digits set), torch hub's and Hugging
    Face's."""
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="paratrain-tests-"))
    config._paratrain_caches = root  # removed when the session ends
    os.environ["PARATRAIN_CACHE"] = str(root / "paratrain")
    os.environ["HF_HOME"] = str(root / "huggingface")
    os.environ["HF_DATASETS_CACHE"] = str(root / "huggingface" / "datasets")
    os.environ["TORCH_HOME"] = str(root / "torch")  # torch.hub's weights files
    os.environ["HF_HUB_OFFLINE"] = "1"  # the suite runs offline; a fetch test serves its own
    _share_the_cores()


def _share_the_cores() -> None:
    """A test worker of several (pytest-xdist) takes its share of the cores, as torchrun
    gives each of its workers: a run in this process, and the processes a test starts,
    would otherwise each take every core while the other test workers do the same, and
    their thread pools wait on each other (a 19 s test measured at 94 s in the suite)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if "PYTEST_XDIST_WORKER" not in os.environ or workers < 2:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def pytest_unconfigure(config):
    import shutil

    root = getattr(config, "_paratrain_caches", None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


def pytest_collection_modifyitems(session, config, items):
    """The files of slow tests (multi-process and whole-tool runs) first, in their own
    order: the two workers take a file each at a time, and a long file started last
    would leave one of them alone at the end."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    # the whole-tool runs (tests/e2e) are the longest files: first of all
    items.sort(key=lambda item: (item.path not in slow, item.path.parent.name != "e2e"))


@pytest.fixture(autouse=True)
def _clean_dist_env(monkeypatch):
    """No test sees a launcher's variables from the shell that ran pytest."""
    for key in list(os.environ):
        if key in (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GROUP_RANK",
        ) or key.startswith(("SLURM_", "TORCHELASTIC_")):
            monkeypatch.delenv(key, raising=False)
    yield


@pytest.fixture
def image_folder(tmp_path) -> Path:
    """3 classes x 12 images, DIR/<class>/*.jpg."""
    return make_image_folder(tmp_path / "data", classes=3, per_class=12)


TINY_RUN = dict(
    model="resnet18", image_size=16, batch_size=4, workers=0, precision="32", cache="off", epochs=1
)


@pytest.fixture(scope="session")
def tiny_run_once(tmp_path_factory) -> Path:
    """One tiny run, trained once per test session (per worker process): 3 classes x 12
    images, one epoch of resnet18 at 16 px. Read it through ``tiny_run``, which hands
    each module its own copy, so no test sees another's changes."""
    from paratrain import TrainConfig, train

    root = tmp_path_factory.mktemp("trained-once")
    data = make_image_folder(root / "data", classes=3, per_class=12)
    train(TrainConfig(data=str(data), output_dir=str(root / "runs"), name="r", **TINY_RUN))
    return root


@pytest.fixture(scope="module")
def tiny_run(tiny_run_once, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(a folder, its data, the run's last checkpoint): a copy of the session's tiny run,
    its data and ``runs/r`` as trained, for this module alone."""
    import shutil

    root = tmp_path_factory.mktemp("trained")
    shutil.copytree(tiny_run_once / "data", root / "data")
    shutil.copytree(tiny_run_once / "runs", root / "runs")
    return root, root / "data", root / "runs" / "r" / "checkpoints" / "last.pt"


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


__all__ = ["Image", "make_image_folder"]
