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
    os.environ["PARATRAIN_CACHE"] = str(root / "paratrain")
    os.environ["HF_HOME"] = str(root / "huggingface")
    os.environ["HF_DATASETS_CACHE"] = str(root / "huggingface" / "datasets")
    os.environ["TORCH_HOME"] = str(root / "torch")  # torch.hub's weights files
    os.environ["HF_HUB_OFFLINE"] = "1"  # the suite runs offline; a fetch test serves its own


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


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


__all__ = ["Image", "make_image_folder"]
