"""Sources that are not folders: Hugging Face datasets (save_to_disk, parquet, hf:) and
WebDataset shards (local, fetched by URL, read per node), through the same split, screen
and cache as a folder."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
import torch

from imagefolders import make_hf_dataset, make_image_folder, make_shards
from paratrain.data.cache.build import prepare
from paratrain.data.cache.read import CachedImages, cached_eval_transform
from paratrain.data.folder import build_split, load_rgb
from paratrain.data.samples import PackedStrings, Samples, concat
from paratrain.data.scan import screen
from paratrain.data.sources.base import open_source
from paratrain.data.sources.hf import HFSource
from paratrain.data.sources.wds import WebDatasetSource
from paratrain.data.transforms import eval_resize, eval_samples
from paratrain.errors import UserError

pytest.importorskip("datasets")


def _every_image_reads(split) -> None:
    for samples in (split.train, split.val):
        for key, _ in samples:
            assert load_rgb(key, None, samples.source).size == (40, 30)


# ---------------------------------------------------------------------------- samples


def test_packed_samples_take_concat_and_compare():
    pairs = [(f"dir/ü-{i}.jpg", i % 3) for i in range(10)]
    samples = Samples.of(pairs)
    assert list(samples) == pairs and samples == pairs
    picked = samples.take(np.array([7, 2, 2]))
    assert list(picked) == [pairs[7], pairs[2], pairs[2]] and picked.ids.tolist() == [7, 2, 2]
    joined = concat([samples.take(np.arange(5, 10)), samples.take(np.arange(5))])
    assert joined.paths()[:2] == ["dir/ü-5.jpg", "dir/ü-6.jpg"] and len(joined) == 10
    assert samples.rows_in(np.array([3, 0])).tolist() == [3, 0]
    assert joined.rows_in(np.array([0, 9])).tolist() == [5, 4]
    assert samples != samples.take(np.arange(9))
    strings = PackedStrings.of(["a", "", "ccc"])
    assert list(strings) == ["a", "", "ccc"] and strings[-1] == "ccc" and strings[1] == ""


def test_samples_are_arrays_not_python_objects():
    """What loader workers share without copying: a handful of arrays, whatever the size."""
    samples = Samples.of((f"/data/{i:07d}.jpg", i % 1000) for i in range(20000))
    arrays = [value for value in vars(samples).values() if isinstance(value, np.ndarray)]
    arrays += [samples.keys.data, samples.keys.offsets]
    assert len(arrays) == 6 and samples.keys.data.dtype == np.uint8
    assert samples.labels.dtype == np.int32
    assert samples[12345] == ("/data/0012345.jpg", 345)


# ---------------------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("form", ["save_to_disk", "parquet"])
def test_a_dataset_folder_gives_its_splits_classes_and_images(tmp_path, form):
    data = make_hf_dataset(tmp_path / "hf", form=form)
    source = open_source(str(data))
    assert isinstance(source, HFSource)
    split = build_split(data)
    assert split.classes == ["class_0", "class_1", "class_2"]  # the ClassLabel's names
    assert split.train[0] == ("train/0", 0) and split.val[0] == ("validation/0", 0)
    assert split.layout == "given" and len(split.train) == 36 and len(split.val) == 12
    assert Counter(label for _, label in split.val) == {0: 4, 1: 4, 2: 4}
    _every_image_reads(split)


def test_a_sequence_of_class_labels_gives_several_labels_an_image(tmp_path):
    data = make_hf_dataset(tmp_path / "hf", several=True)
    split = build_split(data)
    assert split.multilabel and split.classes == ["class_0", "class_1", "class_2"]
    rows = [split.label_sets[n].tolist() for n in split.train.labels[:4]]
    assert rows == [[1, 0, 0], [1, 1, 0], [1, 0, 0], [1, 1, 0]]
    _every_image_reads(split)


def test_hf_name_loads_through_load_dataset(tmp_path):
    """hf:NAME goes through datasets.load_dataset (here a local folder of parquet files,
    as load_dataset accepts; a hub name is fetched into the hub's cache the same way)."""
    data = make_hf_dataset(tmp_path / "hub-like", form="parquet")
    split = build_split(f"hf:{data}")
    assert len(split.train) == 36 and len(split.val) == 12 and split.layout == "given"
    _every_image_reads(split)


def test_named_columns_splits_and_a_split_by_fraction(tmp_path):
    data = make_hf_dataset(
        tmp_path / "hf",
        splits=("fit", "holdout", "extra"),
        image_column="img",
        label_column="y",
        class_label=False,
    )
    with pytest.raises(
        UserError, match=r"no image column found \(columns: img, y\); name it with --image-column"
    ):
        build_split(open_source(str(data), data_split="fit", image_column="picture"))
    with pytest.raises(UserError, match="no split 'train' .*splits: fit, holdout, extra"):
        build_split(open_source(str(data), image_column="img", label_column="y"))
    given = open_source(str(data), None, "fit", "holdout", "img", "y")
    split = build_split(given)
    assert split.classes == ["0", "1", "2"] and len(split.val) == 12 and split.layout == "given"
    alone = build_split(open_source(str(data), None, "fit", None, "img", "y"), 0.25, seed=3)
    assert split.layout == "given" and alone.layout == "split"  # no val split: a fraction
    assert len(alone.val) == 9 and Counter(label for _, label in alone.val) == {0: 3, 1: 3, 2: 3}
    assert alone == build_split(open_source(str(data), None, "fit", None, "img", "y"), 0.25, seed=3)


def test_a_dataset_goes_through_the_cache_and_the_screen(tmp_path):
    split = build_split(make_hf_dataset(tmp_path / "hf"))
    everything = split.train + split.val
    cache = prepare(everything, 24, "on", 1.0, str(tmp_path / "cache"), workers=0)
    assert cache is not None and cache.bad == []
    cached = CachedImages(split.val, cache, cached_eval_transform(24))
    decoded = eval_samples(split.val, 24)
    for i in range(len(split.val)):
        assert torch.equal(cached[i][0], decoded[i][0])  # exact evaluation, from a dataset
    kept = screen(split, "error", 0, 1, 0, None, memory=tmp_path / "memory")
    assert kept is split


# ---------------------------------------------------------------------------- WebDataset


def test_shards_list_their_samples_with_classes_from_cls_members(tmp_path):
    pytest.importorskip("braceexpand")
    shards = make_shards(tmp_path / "wds", label="name", names_file=True)
    source = open_source(f"wds:{shards}/shard-{{000..003}}.tar", tmp_path / "cache")
    assert isinstance(source, WebDatasetSource) and source.sharded
    split = build_split(source, 0.25, seed=1)
    assert split.classes == ["class_0", "class_1", "class_2"] and split.layout == "split"
    assert len(split.train) + len(split.val) == 48
    assert 6 <= len(split.val) <= 18  # each key's side drawn by its hash: about a quarter
    again = build_split(
        open_source(f"wds:{shards}/shard-{{000..003}}.tar", tmp_path / "cache"), 0.25, seed=1
    )
    assert again.val == split.val and again.train == split.train
    _every_image_reads(split)
    assert list((tmp_path / "cache" / "shard-index").glob("*.json"))  # indexed once, kept
    cache = prepare(split.train + split.val, 24, "on", 1.0, str(tmp_path / "c"), workers=0)
    assert cache is not None and cache.bad == []


def test_validation_shards_and_numbered_classes(tmp_path):
    pytest.importorskip("braceexpand")
    train = make_shards(tmp_path / "wds", shards=3)
    make_shards(tmp_path / "wds", shards=1, prefix="val")
    source = open_source(
        f"wds:{train}/shard-{{000..002}}.tar", tmp_path / "c", val_split=f"{train}/val-000.tar"
    )
    split = build_split(source)
    assert split.layout == "given" and len(split.train) == 36 and len(split.val) == 12
    assert split.classes == ["0", "1", "2"]


def test_each_node_lists_and_fetches_only_its_own_shards(tmp_path):
    """Shards named by URL are copied once into the cache folder; a node of two copies
    and lists every other shard only."""
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("braceexpand")
    local = make_shards(tmp_path / "wds", shards=4)
    memory = fsspec.filesystem("memory")
    for path in sorted(local.glob("*.tar")):
        memory.pipe(f"/remote/{path.name}", path.read_bytes())
    pattern = "wds:memory://remote/shard-{000..003}.tar"
    node1 = open_source(pattern, tmp_path / "node1")
    split = build_split(node1, node=1, nodes=2)
    shards = {key.split(":")[0] for key in (split.train + split.val).keys}
    assert shards == {"1", "3"} and len(split.train) + len(split.val) == 24
    copied = sorted(p.name for p in (tmp_path / "node1" / "shards").rglob("*.tar"))
    assert copied == ["shard-001.tar", "shard-003.tar"]
    _every_image_reads(split)
    node0 = build_split(open_source(pattern, tmp_path / "node0"), node=0, nodes=2)
    assert not set((node0.train + node0.val).keys) & set((split.train + split.val).keys)


def test_shard_mistakes_are_one_line(tmp_path):
    pytest.importorskip("braceexpand")
    shards = make_shards(tmp_path / "wds", shards=1)
    with pytest.raises(UserError, match="shard not found: .*shard-009.tar"):
        build_split(open_source(f"wds:{shards}/shard-009.tar", tmp_path / "c"))
    (tmp_path / "wds" / "junk.tar").write_bytes(b"not a tar file at all" * 40)
    with pytest.raises(UserError, match="junk.tar is not a readable tar shard"):
        build_split(open_source(f"wds:{shards}/junk.tar", tmp_path / "c"))
    import io
    import tarfile

    with tarfile.open(tmp_path / "wds" / "nolabel.tar", "w") as tar:
        info = tarfile.TarInfo("a.jpg")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(UserError, match=r"1 sample\(s\) have no class member"):
        build_split(open_source(f"wds:{shards}/nolabel.tar", tmp_path / "c"))


def test_a_folder_is_still_a_folder(tmp_path):
    data = make_image_folder(tmp_path / "d", classes=2, per_class=5)
    split = build_split(data, 0.2)
    assert split.source is not None and split.source.name == str(data)
    assert len(split.train) == 8 and split.train.sizes.min() > 0
    assert split.train.versions.min() > 0  # every file's modification time, listed once
    resized = eval_resize(24)
    assert load_rgb(split.val[0][0], resized).size[0] >= resized


def test_the_launchers_listing_is_read_by_the_runs_processes(tmp_path, monkeypatch):
    """A start lists and stats the files once: the checks before the run offer their
    listing, and the run's processes (here, or launched with this environment) read it."""
    from paratrain.data.sources import base as sources
    from paratrain.data.sources.folder import FolderSource

    data = make_image_folder(tmp_path / "d", classes=2, per_class=6)
    other = make_image_folder(tmp_path / "e", classes=2, per_class=4)
    source = open_source(str(data))
    listed = source.listing()
    sources.offer(source, listed)
    calls = []
    real = FolderSource.list_entries
    monkeypatch.setattr(
        FolderSource,
        "list_entries",
        lambda self, *a: calls.append(self.name) or real(self, *a),
    )
    with sources.handed_over():
        assert os.environ[sources.LISTING]
        split = build_split(str(data))
        assert calls == [] and split == build_split(open_source(str(data)))
        assert split.train.sizes.tolist() == build_split(str(data)).train.sizes.tolist()
        build_split(str(other))  # another folder is listed, not handed over
        assert calls == [str(other)]
    assert sources.LISTING not in os.environ
    build_split(str(data))  # after the run: listed again
    assert calls[-1] == str(data)


def _cut_after(shard, samples: int) -> None:
    """``shard`` cut where a writer killed mid-shard leaves it: whole members up to the
    ``samples``-th sample's, and no end-of-archive blocks."""
    import tarfile

    with tarfile.open(shard) as tar:
        members = tar.getmembers()
    cut = members[2 * samples].offset  # two members a sample: .jpg and .cls
    with open(shard, "r+b") as handle:
        handle.truncate(cut)


@pytest.mark.parametrize("policy", ["error", "skip"])
def test_a_shard_cut_between_two_samples_is_a_bad_shard(tmp_path, policy):
    """Python's tarfile reads end-of-file at a header as a normal end: without the end
    blocks check the cut shard read as 7 samples instead of 30, without a word."""
    pytest.importorskip("braceexpand")
    shards = make_shards(tmp_path / "wds", shards=3, per_shard=30)
    _cut_after(shards / "shard-001.tar", 7)
    split = build_split(open_source(f"wds:{shards}/shard-{{000..002}}.tar", tmp_path / "c"))
    assert len(split.train) + len(split.val) == 60  # the cut shard is not read as shorter
    [(where, why)] = split.missing
    assert where == f"shard {shards}/shard-001.tar"
    assert why.startswith("unfinished: no end-of-archive blocks after its 7 samples")
    if policy == "error":
        with pytest.raises(UserError, match=r"shard .*shard-001.tar \(unfinished"):
            screen(split, policy, 0, 1, 0, None, found=[])
    else:
        kept = screen(split, policy, 0, 1, 0, tmp_path, found=[])
        assert len(kept.train) + len(kept.val) == 60
        assert "shard-001.tar\tunfinished" in (tmp_path / "bad_images.txt").read_text()
    # the verdict is kept with the shard's index: a second listing says the same
    again = build_split(open_source(f"wds:{shards}/shard-{{000..002}}.tar", tmp_path / "c"))
    assert again.missing == split.missing


def test_a_shard_whose_count_differs_from_its_index_is_a_bad_shard(tmp_path):
    """webdataset's shard index (wids: a shardlist of url and nsamples) says how many
    samples each shard holds; a shard that holds another number is bad."""
    import json

    pytest.importorskip("braceexpand")
    shards = make_shards(tmp_path / "wds", shards=2, per_shard=10)
    index = {
        "__kind__": "wids-shard-index-v1",
        "shardlist": [
            {"url": "shard-000.tar", "nsamples": 10},
            {"url": "shard-001.tar", "nsamples": 12},
        ],
    }
    (shards / "index.json").write_text(json.dumps(index))
    split = build_split(open_source(f"wds:{shards}/index.json", tmp_path / "c"))
    assert len(split.train) + len(split.val) == 10
    assert split.missing == [
        (f"shard {shards}/shard-001.tar", "10 samples where its index says 12")
    ]
    (shards / "broken.json").write_text("{not json")
    with pytest.raises(UserError, match="broken.json is not a readable shard index"):
        open_source(f"wds:{shards}/broken.json", tmp_path / "c")


def test_archive_debris_is_ignored_like_hidden_files(tmp_path):
    """A folder unzipped on a Mac holds __MACOSX/ (resource forks named ._x.jpg): it is
    no empty class and none of its files is an image, in training and in predict."""
    from paratrain.engine.inference.predict import collect_images

    data = make_image_folder(tmp_path / "d", classes=2, per_class=5)
    for junk in ("__MACOSX/class_0", "__MACOSX", "class_0/__MACOSX", ".Trash"):
        (data / junk).mkdir(parents=True, exist_ok=True)
        (data / junk / "._img_000.jpg").write_bytes(b"\x00\x05\x16\x07 not an image")
    split = build_split(data, 0.2)
    assert split.classes == ["class_0", "class_1"]
    assert len(split.train) + len(split.val) == 10 and split.missing == []
    assert len(collect_images([str(data)])) == 10
