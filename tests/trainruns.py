"""What the end-to-end training tests share: a small job's flags, running it as a user
would (a subprocess of `paratrain train`), and reading what it saved."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import torch

from imagefolders import make_image_folder
from zygote import command

# 3 classes x 20 images: 48 train / 12 val; batch 4 x 2 processes = 6 steps per epoch
FAST = ["--model", "resnet18", "--image-size", "16", "--batch-size", "4", "--workers", "0"]


def env_for(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PARATRAIN_CACHE=str(root / "cache"), PYTHONUNBUFFERED="1", **extra)
    return env


EVERY_2 = ["--deterministic", "--save-every-steps", "2"]


def job(folder: Path, name: str, *extra: str, nproc: int = 2, epochs: int = 1) -> list[str]:
    """The arguments of one small training job."""
    return [
        "--data",
        str(folder),
        "--nproc",
        str(nproc),
        "--epochs",
        str(epochs),
        "--name",
        name,
        *FAST,
        *extra,
    ]


def run(root: Path, *args: str, timeout: float = 240, **env: str):
    """`paratrain train *args` in ``root``: (the finished process, its seconds). One still
    running after ``timeout`` is killed with every process below it, and fails the
    test with what it printed (killing the launcher alone would leave its workers
    holding the pipes, and the test waiting on them for ever). Forked from an
    interpreter that has imported torch already (zygote.py)."""
    start = time.monotonic()
    out, timed_out = command(["train", *args], root, env_for(root, **env), timeout)
    if timed_out:
        raise still_ran(["train", *args], timeout, out)
    return out, time.monotonic() - start


def still_ran(args: list[str], timeout: float, out: subprocess.CompletedProcess) -> AssertionError:
    """The failure of a command killed at its timeout: what it printed last, and the
    stacks its processes printed before the kill (zygote.ask_stacks)."""
    return AssertionError(
        f"paratrain {' '.join(args)} still ran after {timeout:.0f} s:\n"
        f"{out.stdout[-3000:]}\n{out.stderr[-20000:]}"
    )


def leftover(tag: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", "--", tag], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


def weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(root / "runs" / name / "checkpoints" / "last.pt", weights_only=False)["model"]


def small_data(root: Path) -> tuple[Path, Path]:
    """The jobs' root folder and their image folder: 3 classes x 20 images."""
    return root, make_image_folder(root / "data", classes=3, per_class=20)


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def last_weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    """The run's last weights, from one file or consolidated from its shards."""
    from paratrain.engine.checkpointing import checkpoint

    folder = root / "runs" / name / "checkpoints"
    path = folder / "last.pt" if (folder / "last.pt").exists() else folder / "last"
    return checkpoint.load(path).model


def run_cli(
    *args: str, cwd: Path, timeout: float = 300, **extra: str | None
) -> subprocess.CompletedProcess:
    """`paratrain *args` in ``cwd``, forked as ``run`` is, and failing as it does past
    ``timeout``. ``extra``: variables set, or (None) left out."""
    env = env_for(cwd)
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    out, timed_out = command(list(args), cwd, env, timeout)
    if timed_out:
        raise still_ran(list(args), timeout, out)
    return out
