import json
import os
from collections import Counter

import pytest

from imagefolders import make_image_folder
from paratrain.data.folder import build_split
from paratrain.errors import UserError


def test_split_is_deterministic_and_per_class(tmp_path):
    root = make_image_folder(tmp_path / "d", classes=4, per_class=20)
    a = build_split(root, 0.2, seed=0)
    b = build_split(root, 0.2, seed=0)
    assert a == b
    assert a.layout == "split" and a.classes == [f"class_{i}" for i in range(4)]
    assert Counter(label for _, label in a.val) == {i: 4 for i in range(4)}
    assert Counter(label for _, label in a.train) == {i: 16 for i in range(4)}
    assert not {p for p, _ in a.train} & {p for p, _ in a.val}
    assert build_split(root, 0.2, seed=1).val != a.val


@pytest.mark.parametrize(
    "fraction, per_class, n_val", [(0.2, 10, 2), (0.5, 7, 4), (0.1, 3, 1), (0.9, 2, 1)]
)
def test_val_fraction_rounds_and_keeps_both_sides(tmp_path, fraction, per_class, n_val):
    root = make_image_folder(tmp_path / "d", classes=2, per_class=per_class)
    split = build_split(root, fraction)
    assert Counter(label for _, label in split.val) == {0: n_val, 1: n_val}
    assert len(split.train) == 2 * (per_class - n_val)


def test_given_train_val_layout_is_used_as_is(tmp_path):
    root = make_image_folder(tmp_path / "d", classes=3, per_class=9, layout="given")
    split = build_split(root)
    assert split.layout == "given"
    assert len(split.train) == 27 and len(split.val) == 9
    assert all("/train/" in p for p, _ in split.train) and all("/val/" in p for p, _ in split.val)
    assert json.loads(json.dumps(split.class_index())) == {
        "0": "class_0",
        "1": "class_1",
        "2": "class_2",
    }


def test_missing_and_empty_directories(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        build_split(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty"):
        build_split(tmp_path / "empty")
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.jpg").write_bytes(b"x")
    with pytest.raises(UserError, match="no class folders"):
        build_split(tmp_path / "flat")


def test_empty_class_and_too_small_class(tmp_path):
    root = make_image_folder(tmp_path / "d", classes=2, per_class=4)
    (root / "zz_empty").mkdir()
    with pytest.raises(UserError, match="zz_empty"):
        build_split(root)
    (root / "zz_empty").rmdir()
    lonely = root / "zz_one"
    lonely.mkdir()
    (root / "class_0" / "000.jpg").rename(lonely / "000.jpg")
    with pytest.raises(UserError, match="zz_one.*1 image"):
        build_split(root)


def test_train_val_class_sets_must_match(tmp_path):
    root = make_image_folder(tmp_path / "d", classes=3, per_class=6, layout="given")
    (root / "val" / "class_2").rename(root / "val" / "class_9")
    with pytest.raises(
        UserError, match=r"only in train: \['class_2'\].*only in val: \['class_9'\]"
    ):
        build_split(root)


def test_a_single_class_is_refused_in_either_layout(tmp_path):
    root = make_image_folder(tmp_path / "d", classes=1, per_class=6)
    with pytest.raises(UserError, match="one class folder \\(class_0\\); a classifier needs"):
        build_split(root)
    given = make_image_folder(tmp_path / "g", classes=1, per_class=6, layout="given")
    with pytest.raises(UserError, match="one class folder"):
        build_split(given)


def _sides(run_dir):
    import numpy as np

    from paratrain.data.samples import PackedStrings

    saved = np.load(run_dir / "split.npz")
    return {
        side: set(PackedStrings(saved[f"{side}_keys"], saved[f"{side}_offsets"]))
        for side in ("train", "val")
    }


def test_a_resumed_run_keeps_its_split_when_files_come_and_go(tmp_path, capsys, monkeypatch):
    """Six images added and two removed between a run and its resume: every earlier file
    stays on its side (none of the run's training images is validated on), the new ones
    are placed, the gone ones left out, and the run says so in one line."""
    from imagefolders import make_image_folder
    from paratrain import TrainConfig, train
    from paratrain.log import setup_logging

    monkeypatch.setenv("PARATRAIN_CACHE", str(tmp_path / "cache"))
    data = make_image_folder(tmp_path / "d", classes=3, per_class=20)
    common = dict(
        data=str(data), image_size=16, batch_size=8, workers=0, name="r",
        output_dir=str(tmp_path / "runs"),
    )  # fmt: skip
    train(TrainConfig(epochs=1, **common))
    before = _sides(tmp_path / "runs" / "r")
    gone = [sorted(before["train"])[0], sorted(before["val"])[0]]
    for path in gone:
        os.remove(path)
    extra = make_image_folder(tmp_path / "more", classes=3, per_class=2)
    for path in sorted(extra.rglob("*.jpg")):
        path.rename(data / path.parent.name / f"new-{path.name}")
    setup_logging()
    train(TrainConfig(epochs=2, resume="auto", **common))
    said = capsys.readouterr().out
    assert (
        "the data changed since the run began: 6 file(s) added (placed by the split), "
        "2 gone (left out), 0 changed" in said
    )
    after = _sides(tmp_path / "runs" / "r")
    assert before["train"] - set(gone) <= after["train"]  # no training image validated on
    assert before["val"] - set(gone) <= after["val"]
    new = {str(p) for p in data.rglob("new-*.jpg")}
    assert new <= after["train"] | after["val"] and not set(gone) & (after["train"] | after["val"])
