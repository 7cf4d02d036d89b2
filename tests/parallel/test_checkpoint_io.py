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


def _parts() -> tuple:
    from paratrain.parallel.parts import ModelParts

    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return ModelParts([model]), model, optimizer


def test_a_background_save_writes_the_weights_as_they_were_when_it_returned(tmp_path):
    """--async-save: save returns before the file is written (the writer is held here
    until the weights have changed), and the file holds the weights of the save."""
    import threading

    parts, model, optimizer = _parts()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    release, io = threading.Event(), checkpoint_io.WholeIO()
    path = tmp_path / "last.pt"
    io.save(path, parts, optimizer, {"step": 1}, lambda _: release.wait(10), background=True)
    assert not path.exists()  # still being written
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on meanwhile
    release.set()
    io.wait()
    saved = torch.load(path, weights_only=False)
    assert saved["step"] == 1 and torch.equal(saved["model"]["weight"], before["weight"])
    assert saved["optimizer"]["state"][0]["momentum_buffer"].shape == (3, 4)
    io.save(path, parts, optimizer, {"step": 2})  # a plain save after it: in order
    assert torch.equal(torch.load(path, weights_only=False)["model"]["weight"], model.weight)


def test_a_failed_background_write_is_raised_by_the_next_wait_and_keeps_the_old_file(tmp_path):
    import errno

    import pytest

    from paratrain.errors import UserError

    parts, _, optimizer = _parts()
    io, path = checkpoint_io.WholeIO(), tmp_path / "last.pt"
    io.save(path, parts, optimizer, {"step": 1})

    def full(at):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(at))

    io.save(path, parts, optimizer, {"step": 2}, full, background=True)
    with pytest.raises(OSError, match="No space left"):
        io.wait()
    io.wait()  # said once
    assert torch.load(path, weights_only=False)["step"] == 1
    with pytest.raises(UserError, match="cannot write checkpoint"):  # a bad folder, in order
        io.save(tmp_path / "last.pt" / "x.pt", parts, optimizer, {"step": 3}, background=True)
        io.wait()


def test_host_copy_clones_every_tensor_and_keeps_the_rest():
    state = {"a": torch.ones(2), "n": [torch.zeros(1), 3], "t": (torch.ones(1), "x"), "s": 1}
    copied = checkpoint_io.host_copy(state)
    state["a"].add_(1)
    state["n"][0].add_(1)
    assert torch.equal(copied["a"], torch.ones(2)) and torch.equal(copied["n"][0], torch.zeros(1))
    assert copied["n"][1] == 3 and copied["t"][1] == "x" and copied["s"] == 1
    assert isinstance(copied["t"], tuple)
