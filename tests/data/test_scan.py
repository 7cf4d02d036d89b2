"""The screen's verdicts are kept: a start over unchanged data decodes nothing, a changed
or added file is screened alone, and what was bad stays bad until it changes."""

from __future__ import annotations

import os

import numpy as np
import pytest
from PIL import Image

from imagefolders import make_image_folder
from paratrain.data import scan
from paratrain.data.folder import build_split
from paratrain.data.scan import ScreenMemory, screen
from paratrain.errors import UserError


@pytest.fixture
def counted(monkeypatch):
    """The keys the screen decodes."""
    seen: list[str] = []
    real = scan.image_problem
    monkeypatch.setattr(
        scan, "image_problem", lambda key, source=None: seen.append(key) or real(key, source)
    )
    return seen


def _screen(data, memory, policy="skip"):
    return screen(build_split(data), policy, 0, 1, 0, None, memory=memory)


def test_an_unchanged_start_screens_nothing_and_a_change_screens_itself(tmp_path, counted):
    data = make_image_folder(tmp_path / "d", classes=2, per_class=10)
    memory = tmp_path / "memory"
    first = _screen(data, memory)
    assert len(counted) == 20 and len(first.train) + len(first.val) == 20
    counted.clear()
    again = _screen(data, memory)  # a second start, an elastic restart: the same data
    assert counted == [] and again.train == first.train and again.val == first.val

    changed = data / "class_0" / "003.jpg"
    Image.fromarray(np.zeros((30, 40, 3), np.uint8)).save(changed)
    os.utime(changed, ns=(10**18, 10**18))
    added = data / "class_1" / "new.jpg"
    Image.fromarray(np.zeros((30, 40, 3), np.uint8)).save(added)
    _screen(data, memory)
    assert sorted(counted) == sorted([str(changed), str(added)])
    counted.clear()
    _screen(data, memory)
    assert counted == []


def test_bad_files_are_remembered_until_they_change(tmp_path, counted):
    data = make_image_folder(tmp_path / "d", classes=2, per_class=10)
    victim = data / "class_1" / "004.jpg"
    good = victim.read_bytes()
    victim.write_bytes(good[:90])
    memory = tmp_path / "memory"
    with pytest.raises(UserError, match=r"1 unreadable image\(s\).*004.jpg"):
        _screen(data, memory, "error")
    counted.clear()
    with pytest.raises(UserError, match=r"1 unreadable image\(s\).*004.jpg"):
        _screen(data, memory, "error")  # --bad-images behaves as before, from memory
    assert counted == []
    kept = _screen(data, memory, "skip")
    assert str(victim) not in set(kept.train.keys) | set(kept.val.keys) and counted == []
    victim.write_bytes(good)  # mended: screened again, and no longer bad
    os.utime(victim, ns=(10**18, 10**18))
    mended = _screen(data, memory, "error")
    assert counted == [str(victim)] and len(mended.train) + len(mended.val) == 20


def test_unreadable_memory_is_no_memory(tmp_path, counted):
    data = make_image_folder(tmp_path / "d", classes=2, per_class=5)
    memory = tmp_path / "memory"
    _screen(data, memory)
    kept = ScreenMemory(memory, build_split(data).train + build_split(data).val).path
    assert kept is not None and kept.is_file()
    kept.write_bytes(b"garbage")
    counted.clear()
    _screen(data, memory)
    assert len(counted) == 10  # screened again, and remembered again
    counted.clear()
    _screen(data, memory)
    assert counted == []


def test_a_broken_link_is_a_bad_image_named_as_missing(tmp_path):
    data = make_image_folder(tmp_path / "d", classes=2, per_class=5)
    link = data / "class_0" / "gone.jpg"
    link.symlink_to(tmp_path / "nowhere.jpg")
    split = build_split(data)
    assert split.missing and split.missing[0][0] == str(link)
    with pytest.raises(UserError, match=r"gone.jpg \(missing \(No such file or directory\)\)"):
        screen(split, "error", 0, 1, 0, None, memory=tmp_path / "m")
    kept = screen(split, "skip", 0, 1, 0, tmp_path, memory=tmp_path / "m")
    assert len(kept.train) + len(kept.val) == 10
    assert "gone.jpg" in (tmp_path / "bad_images.txt").read_text()


def test_screening_part_of_a_source_keeps_what_was_known_of_the_rest(tmp_path, counted):
    """`paratrain eval` screens validation alone; the next training start still knows
    every training image's verdict."""
    data = make_image_folder(tmp_path / "d", classes=2, per_class=10)
    victim = data / "class_0" / "002.jpg"
    victim.write_bytes(victim.read_bytes()[:80])
    memory = tmp_path / "memory"
    split = build_split(data)
    _screen(data, memory)
    counted.clear()
    from paratrain.data.scan import without_unreadable

    without_unreadable(split.val, memory)
    assert counted == []  # val's verdicts were known
    _screen(data, memory)
    assert counted == []
    with pytest.raises(UserError, match="002.jpg"):
        _screen(data, memory, "error")
