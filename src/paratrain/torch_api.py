"""The torch paratrain needs: its release floor, checked when a command starts, and the
newer APIs a strategy reaches for, checked when the strategy is chosen; an older torch
is one line naming what is missing and what to install, not an ImportError deep inside
a strategy.

The floor is pyproject's (``torch>=2.7``); a torch installed around pip's resolver (an
image with its own build, ``--no-deps``) is where these checks are the only ones.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from paratrain.errors import UserError

FLOOR = (2, 7)
INSTALL = f"pip install 'torch>={FLOOR[0]}.{FLOOR[1]}' (and the torchvision that matches)"

# name: (module, attribute, the torch release that brought it)
FEATURES = {
    "DTensor": ("torch.distributed.tensor", "DTensor", (2, 5)),
    "fully_shard": ("torch.distributed.fsdp", "fully_shard", (2, 6)),
    "init_device_mesh": ("torch.distributed.device_mesh", "init_device_mesh", (2, 2)),
    "pipeline schedules": ("torch.distributed.pipelining", "ScheduleGPipe", (2, 4)),
}


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string: '2.14.1+cu130' -> (2, 14)."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def installed() -> str:
    """torch's version, read from its metadata (importing torch takes seconds)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:  # a build without metadata: ask torch itself
        import torch

        return str(torch.__version__)


def check_torch(version: str | None = None) -> None:
    """One line when this torch is older than paratrain's floor."""
    found = version or installed()
    if release(found) < FLOOR:
        raise UserError(
            f"paratrain needs torch {FLOOR[0]}.{FLOOR[1]} or newer, found {found}: {INSTALL}"
        )


def need(features: tuple[str, ...], what: str) -> None:
    """One line when this torch lacks an API ``what`` calls."""
    for feature in features:
        module, name, since = FEATURES[feature]
        try:
            present = hasattr(importlib.import_module(module), name)
        except ImportError:
            present = False
        if not present:
            raise UserError(
                f"{what} needs {module}.{name} (torch {since[0]}.{since[1]}+), which torch "
                f"{installed()} lacks: {INSTALL}"
            )
