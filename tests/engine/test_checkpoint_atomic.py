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

from paratrain.engine.checkpointing.checkpoint import prune_epochs
from paratrain.parallel.checkpoint_io import save_atomic

pytestmark = pytest.mark.slow


def _state(version: int) -> dict:
    # large enough (about 8 MB) that a save takes a while and a kill lands inside it
    return {"version": version, "model": {"w": torch.full((2_000_000,), float(version))}}


def _writer(path: str, first: int, ready) -> None:
    """Saves versions first, first + 1, ... until killed."""
    torch.set_num_threads(1)  # a forked child must not reuse the parent's thread pool
    ready.set()
    version = first
    while True:
        save_atomic(_state(version), Path(path))
        version += 1


def test_sigkill_during_saves_never_tears_last_pt(tmp_path):
    """20 writers, each saving in a loop and killed at a random moment within about three
    save times of its start: last.pt always loads and holds the previous state or one of
    the killed writer's, never a torn mixture."""
    path = tmp_path / "checkpoints" / "last.pt"
    save_atomic(_state(0), path)  # the first save pays for imports and the directory
    start = time.perf_counter()
    save_atomic(_state(0), path)
    save_seconds = time.perf_counter() - start
    rng = random.Random(0)
    context = multiprocessing.get_context("fork")
    version, completed = 0, 0
    for attempt in range(1, 21):
        first = attempt * 1000
        ready = context.Event()
        writer = context.Process(target=_writer, args=(str(path), first, ready))
        writer.start()
        assert ready.wait(timeout=60)
        time.sleep(rng.uniform(0.0, 3.0 * save_seconds))
        os.kill(writer.pid, signal.SIGKILL)  # the writer never stops by itself
        writer.join()
        state = torch.load(path, weights_only=False)  # always loads
        assert state["version"] == version or first <= state["version"] < first + 1000
        assert torch.all(state["model"]["w"] == float(state["version"]))  # never torn
        completed += state["version"] != version
        version = state["version"]
    leftovers = [p.name for p in path.parent.iterdir() if p.name != "last.pt"]
    assert all(name.endswith(".tmp") for name in leftovers)  # only abandoned temporaries
    assert leftovers  # some kills landed inside a write
    assert completed > 0  # and some writers finished a save before theirs


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
