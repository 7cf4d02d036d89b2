"""A data source is one module of data/sources/ plus one registry line: each declares its
own prefix or the folders it claims, and nothing outside the package tests ``--data``
for a source's prefix. The CSV-listed source, the smallest, is tested here too."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from imagefolders import make_csv_listing, make_hf_dataset
from paratrain.config import TrainConfig
from paratrain.config.schema import check_paths
from paratrain.data.folder import build_split, load_rgb
from paratrain.data.sources import SOURCES
from paratrain.data.sources.base import SourceKind, kind, names_a_source, open_source, prefixes
from paratrain.errors import UserError

SRC = Path(__file__).resolve().parents[2] / "src" / "paratrain"
PACKAGE = SRC / "data" / "sources"


def test_every_module_is_registered_and_declares_its_kind():
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "base"}
    assert modules == set(SOURCES)
    for name in SOURCES:
        declared = kind(name)
        assert isinstance(declared, SourceKind) and callable(declared.open)
        assert declared.prefix or declared.claims, f"{name} is reached neither way"
    assert len(set(prefixes())) == len(prefixes())
    assert list(SOURCES)[-1] == "folder" and kind("folder").claims(Path("/"))  # the fallback
    with pytest.raises(KeyError, match="no data source 'ftp'"):
        kind("ftp")


def test_nothing_outside_the_package_tests_data_for_a_prefix():
    found = []
    for path in SRC.rglob("*.py"):
        if path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "startswith":
                words = {
                    n.value
                    for n in ast.walk(node)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)
                }
                if words & set(prefixes()):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} tests {sorted(words)}")
    assert not found, "\n".join(found)


def test_the_prefix_decides_before_any_folder(tmp_path):
    pytest.importorskip("datasets")
    data = make_hf_dataset(tmp_path / "hf")
    assert type(open_source(str(data))).__name__ == "HFSource"  # claimed, not a folder
    assert names_a_source("csv:x.csv") and names_a_source("wds:a.tar")
    assert not names_a_source(str(data))
    check_paths(TrainConfig(data="csv:nowhere.csv"))  # the source checks it, not the schema
    with pytest.raises(UserError, match="labels file not found"):
        open_source(f"csv:{tmp_path}/nowhere.csv")


def test_a_csv_listing_gives_its_split_and_reads_every_image(tmp_path):
    listing = make_csv_listing(tmp_path, classes=3, per_class=16)
    split = build_split(f"csv:{listing}")
    assert split.classes == ["class_0", "class_1", "class_2"] and split.layout == "given"
    assert (len(split.train), len(split.val)) == (36, 12)
    for key, label in split.val:
        assert Path(key).name.startswith(f"class_{label}-")
        assert load_rgb(key, None, split.val.source).size == (40, 30)


def test_a_csv_listing_without_a_split_column_is_split_here(tmp_path):
    listing = make_csv_listing(tmp_path, classes=2, per_class=10, split=False)
    split = build_split(f"csv:{listing}", val_fraction=0.2, seed=1)
    assert split.layout == "split" and (len(split.train), len(split.val)) == (16, 4)
    assert np.bincount(split.val.labels).tolist() == [2, 2]


def test_a_csv_listings_classes_sort_numbers_by_value(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")
    rows = [f"a.png,{label}" for label in (10, 2, 2, 10, 1)]
    (tmp_path / "l.csv").write_text("path,class\n" + "\n".join(rows) + "\n\n")
    listed = open_source(f"csv:{tmp_path}/l.csv").listing()
    assert listed.classes == ["1", "2", "10"]
    assert listed.samples.labels.tolist() == [2, 1, 1, 2, 0]


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        ("a.png,cat\nb.png,dog\ngone.png,cat\n", r"l\.csv, row 4: no image file .*gone\.png"),
        ("a.png,cat\nb.png,\n", r"l\.csv, row 3: no label for b\.png"),
        ("a.png,cat\n,dog\n", r"l\.csv, row 3: no image path"),
        ("a.png,cat\nb.png,cat\n", r"l\.csv: one class \(cat\)"),
        ("", r"l\.csv: lists no image"),
    ],
)
def test_a_bad_csv_row_is_one_line_naming_it(tmp_path, rows, says):
    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "b.png").write_bytes(b"")
    (tmp_path / "l.csv").write_text("file,label\n" + rows)
    with pytest.raises(UserError, match=says):
        open_source(f"csv:{tmp_path}/l.csv").listing()


def test_a_csv_split_column_with_another_word_is_refused(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "l.csv").write_text("file,label,split\na.png,cat,train\na.png,dog,holdout\n")
    with pytest.raises(UserError, match=r"row 3: split 'holdout' is not train or val"):
        open_source(f"csv:{tmp_path}/l.csv").listing()


def _listed(tmp_path, name: str, text: str, root=None):
    for image in ("a.png", "b.png", "c.png"):
        (tmp_path / image).write_bytes(b"")
    (tmp_path / name).write_text(text)
    return open_source(str(root or tmp_path), labels=tmp_path / name).listing()


def test_labels_beside_a_folder_in_csv_json_lines_or_one_hot_columns(tmp_path):
    data = make_csv_listing(tmp_path / "set", classes=3, per_class=8)
    moved = tmp_path / "labels.csv"
    data.rename(moved)  # the file elsewhere: paths stay relative to --data
    split = build_split(open_source(str(tmp_path / "set"), labels=moved))
    assert split.layout == "given" and (len(split.train), len(split.val)) == (18, 6)
    assert load_rgb(split.val.keys[0], None, split.val.source).size == (40, 30)
    jsonl = _listed(
        tmp_path, "l.jsonl",
        '{"image": "a.png", "label": "cat", "split": "train"}\n\n'
        '{"path": "b.png", "class": "dog", "split": "train"}\n'
        '{"file": "c.png", "labels": ["dog"], "split": "val"}\n',
    )  # fmt: skip
    assert jsonl.classes == ["cat", "dog"] and jsonl.samples.labels.tolist() == [0, 1, 1]
    assert jsonl.sides.tolist() == [0, 0, 1]
    hot = _listed(tmp_path, "h.csv", "image,cat,dog\na.png,1,0\nb.png,0,1\nc.png,0,1\n")
    assert hot.classes == ["cat", "dog"] and hot.samples.labels.tolist() == [0, 1, 1]
    assert hot.sides is None  # no split column: split here
    assert jsonl.label_sets is None and hot.label_sets is None  # one class a row


def test_several_labels_a_row_make_a_multi_label_listing(tmp_path):
    """Names separated by ; or |, several 1s, or a JSON list: each image's label numbers
    its label set, a row of the 0/1 table."""
    cells = _listed(tmp_path, "s.csv", "image,tags\na.png,cat;dog\nb.png,dog\nc.png,cat|dog\n")
    assert cells.classes == ["cat", "dog"]
    assert cells.label_sets.tolist() == [[1, 1], [0, 1]]
    assert cells.samples.labels.tolist() == [0, 1, 0]
    hot = _listed(tmp_path, "h.csv", "image,cat,dog,cow\na.png,1,0,1\nb.png,0,1,0\nc.png,1,0,1\n")
    assert hot.classes == ["cat", "cow", "dog"]
    assert [hot.label_sets[i].tolist() for i in hot.samples.labels] == [
        [1, 1, 0], [0, 0, 1], [1, 1, 0]
    ]  # fmt: skip
    jsonl = _listed(
        tmp_path, "l.jsonl",
        '{"image": "a.png", "labels": ["cat", "dog"]}\n{"image": "b.png", "labels": ["cat"]}\n',
    )  # fmt: skip
    assert jsonl.label_sets.tolist() == [[1, 1], [1, 0]]
    split = build_split(open_source(str(tmp_path), labels=tmp_path / "s.csv"), 0.34)
    assert split.multilabel and (len(split.train), len(split.val)) == (2, 1)


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("n.csv", "image,cat,dog\na.png,1,0\nb.png,0,0\n", r"row 3: no label for b\.png"),
        ("e.csv", "image,label\na.png,cat;dog\nb.png, ; \n", r"row 3: no label for b\.png"),
        ("f.csv", "image,label\na.png,cat\nb.png,dog\nmissing.png,cat|dog\n",
         r"row 4: no image file .*missing\.png"),
        ("v.csv", "image,label,split\na.png,cat;dog,train\nb.png,dog,train\nc.png,dog;cow,val\n",
         r"row 4: label 'cow' is in no training row"),
        ("o.csv", "image,cat,dog\na.png,1,0\nb.png,2,0\n", r"row 3: the class columns hold"),
        ("u.csv", "image,label,split\na.png,cat,train\nb.png,dog,train\nc.png,cow,val\n",
         r"row 4: label 'cow' is in no training row"),
        ("j.jsonl", '{"image": "a.png", "label": "cat"}\n[1, 2]\n', r"row 2: not a JSON object"),
        ("x.txt", "a.png cat\n", r"--labels .*x\.txt: a labels file is one of \.csv, \.jsonl"),
    ],
)  # fmt: skip
def test_a_bad_labels_file_is_one_line_naming_the_row(tmp_path, name, text, says):
    with pytest.raises(UserError, match=says):
        _listed(tmp_path, name, text)


def test_labels_need_a_folder_of_images(tmp_path):
    (tmp_path / "l.csv").write_text("image,label\na.png,cat\n")
    with pytest.raises(UserError, match="--labels names images in a folder"):
        open_source(f"csv:{tmp_path}/l.csv", labels=tmp_path / "l.csv")


def test_a_run_trains_from_a_labels_file_and_resumes_with_its_split(tmp_path):
    from paratrain import TrainConfig, train

    listing = make_csv_listing(tmp_path / "set", classes=3, per_class=8, split=False)
    common = dict(
        data=str(tmp_path / "set"), labels=str(listing), model="resnet18", image_size=16,
        batch_size=4, workers=0, output_dir=str(tmp_path / "runs"), name="l",
    )  # fmt: skip
    train(TrainConfig(**common, epochs=1))
    summary = train(TrainConfig(**common, epochs=2, resume="auto"))
    assert summary["epochs"] == 2 and summary["final"]["val_count"] == 6  # 2 of 8 a class
    assert (tmp_path / "runs/l/split.npz").is_file()  # split here, recorded, kept on resume
