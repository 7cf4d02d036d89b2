"""best.pt and epoch files are links to the checkpoint just written, never a torn copy."""

from __future__ import annotations

import os

import torch

from paratrain.parallel import checkpoint_io


def test_best_is_a_link_that_keeps_its_content_when_last_moves_on(tmp_path):
    last, best = tmp_path / "last.pt", tmp_path / "best.pt"
    checkpoint_io.save_atomic({"epoch": 1, "w": torch.ones(3)}, last)
    checkpoint_io.copy_atomic({"epoch": 1, "w": torch.ones(3)}, last, best)
    assert os.stat(best).st_ino == os.stat(last).st_ino  # no second write
    checkpoint_io.save_atomic({"epoch": 2, "w": torch.zeros(3)}, last)
    assert torch.load(best)["epoch"] == 1 and torch.equal(torch.load(best)["w"], torch.ones(3))
    assert torch.load(last)["epoch"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]  # no leftovers


def test_without_hard_links_it_writes_the_state(tmp_path, monkeypatch):
    last, best = tmp_path / "last.pt", tmp_path / "best.pt"
    checkpoint_io.save_atomic({"epoch": 3}, last)

    def no_links(*args):
        raise OSError("operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    checkpoint_io.copy_atomic({"epoch": 3}, last, best)
    assert torch.load(best) == {"epoch": 3}
    assert os.stat(best).st_ino != os.stat(last).st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt"]
