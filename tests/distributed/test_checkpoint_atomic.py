"""Checkpoints are atomic: a writer killed (SIGKILL) at random moments never leaves a torn
last.pt behind; it always loads and holds either the previous or the new state."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from paratrain.engine.checkpoint import prune_epochs, save_atomic

pytestmark = pytest.mark.slow


def _state(version: int) -> dict:
    # large enough (about 8 MB) that a save takes a while and a kill lands inside it
    return {"version": version, "model": {"w": torch.full((2_000_000,), float(version))}}


def _writer(path: str, first: int, saves: int) -> None:
    torch.set_num_threads(1)  # a forked child must not reuse the parent's thread pool
    for version in range(first, first + saves):
        save_atomic(_state(version), Path(path))


def test_sigkill_during_saves_never_tears_last_pt(tmp_path):
    """20 saves, each in a writer killed at a random moment within about twice the time a
    save takes: last.pt always loads and holds the previous state or the new one."""
    path = tmp_path / "checkpoints" / "last.pt"
    start = time.perf_counter()
    save_atomic(_state(0), path)
    save_seconds = time.perf_counter() - start
    rng = random.Random(0)
    context = multiprocessing.get_context("fork")
    version, kills = 0, 0
    for attempt in range(1, 21):
        writer = context.Process(target=_writer, args=(str(path), attempt, 1))
        writer.start()
        writer.join(timeout=rng.uniform(0.0, 2.5 * save_seconds + 0.02))
        if writer.is_alive():
            os.kill(writer.pid, signal.SIGKILL)
            kills += 1
        writer.join()
        state = torch.load(path, weights_only=False)  # always loads
        assert state["version"] in (version, attempt)  # the previous state or the new one
        assert torch.all(state["model"]["w"] == float(state["version"]))  # never torn
        version = state["version"]
    assert kills >= 3 and version > 0  # some saves were cut short, some completed
    leftovers = [p.name for p in path.parent.iterdir() if p.name != "last.pt"]
    assert all(name.endswith(".tmp") for name in leftovers)  # only abandoned temporaries


def test_keep_prunes_to_the_newest_epoch_files(tmp_path):
    for epoch in range(1, 6):
        (tmp_path / f"epoch-{epoch:04d}.pt").write_bytes(b"x")
    (tmp_path / "last.pt").write_bytes(b"x")
    prune_epochs(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "epoch-0004.pt",
        "epoch-0005.pt",
        "last.pt",
    ]
