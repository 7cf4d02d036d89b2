"""Bad images on 2 processes: error lists them all once; skip trains on exactly the rest."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from imagefolders import make_damaged_folder
from trainruns import run_cli

pytestmark = pytest.mark.slow

FAST = [
    "--model",
    "resnet18",
    "--image-size",
    "16",
    "--batch-size",
    "8",
    "--workers",
    "1",
    "--epochs",
    "1",
    "--nproc",
    "2",
]


def _run(root, *args):
    return run_cli("train", *args, cwd=root, timeout=240)


def test_bad_images_error_then_skip_on_two_processes(tmp_path):
    data, bad = make_damaged_folder(tmp_path / "d")
    error = _run(tmp_path, "--data", str(data), "--name", "err", *FAST)
    assert error.returncode == 2, error.stderr
    lines = [line for line in error.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "4 unreadable image(s)" in lines[0]
    assert all(path in lines[0] for path in bad)
    assert "Traceback" not in error.stderr and "epoch 1/1" not in error.stdout

    skip = _run(tmp_path, "--data", str(data), "--name", "skip", "--bad-images", "skip", *FAST)
    assert skip.returncode == 0, skip.stderr
    assert "ignored 3 file(s) without an image extension" in skip.stdout
    assert "skipping 4 unreadable image(s)" in skip.stdout
    listed = (tmp_path / "runs/skip/bad_images.txt").read_text().splitlines()
    assert [line.split("\t")[0] for line in listed] == bad
    # 102 images, 20% per class to val (7 each): 81 train / 21 val, less the 4 bad ones
    import re

    counts = re.search(r"(\d+) train / (\d+) val images", skip.stdout).groups()
    assert int(counts[0]) + int(counts[1]) == 102 - 4
    assert "decoded-image cache" in skip.stdout
    # eval of that run leaves out unreadable validation images, as the run did
    from paratrain.data.folder import build_split

    damaged = next(path for path, _ in build_split(data).val if path not in bad)
    Path(damaged).write_bytes(b"")  # one more, in the validation part this time
    evaluated = run_cli(
        *("eval", "--json", "--checkpoint", "runs/skip/checkpoints/last.pt", "--data", str(data)),
        cwd=tmp_path,
        timeout=240,
    )
    assert evaluated.returncode == 0, evaluated.stderr
    assert evaluated.stdout.startswith("skipping 1 unreadable validation image(s), as the run")
    report = json.loads(evaluated.stdout.splitlines()[-1])
    assert report["count"] == int(counts[1]) - 1


@pytest.mark.parametrize("kind", ["dataset folder", "shards", "csv"])
def test_training_on_sources_that_are_not_folders(tmp_path, kind):
    """Two processes train on a Hugging Face dataset folder, on WebDataset shards and on
    a CSV listing (the cache built, then read), evaluating every validation image once."""
    pytest.importorskip("datasets")
    pytest.importorskip("webdataset")
    from imagefolders import make_csv_listing, make_hf_dataset, make_shards

    extra: list[str] = []
    if kind == "csv":
        data = f"csv:{make_csv_listing(tmp_path / 'listed', classes=3, per_class=16)}"
    elif kind == "dataset folder":
        data = str(make_hf_dataset(tmp_path / "hf"))
    else:
        shards = make_shards(tmp_path / "wds", shards=3, label="name", names_file=True)
        make_shards(tmp_path / "wds", shards=1, prefix="val", label="name")
        data = f"wds:{shards}/shard-{{000..002}}.tar"
        extra = ["--val-split", f"wds:{shards}/val-000.tar"]
    done = _run(tmp_path, "--data", data, "--name", "run", *extra, *FAST, "--cache", "on")
    assert done.returncode == 0, done.stderr
    rows = [
        json.loads(line) for line in (tmp_path / "runs/run/metrics.jsonl").read_text().splitlines()
    ]
    assert rows[-1]["val_count"] == 12
    assert "36 train / 12 val images (given)" in done.stdout
    classes = json.loads((tmp_path / "runs/run/class_indices.json").read_text())
    assert classes == {"0": "class_0", "1": "class_1", "2": "class_2"}


def _fit_as_node(rank, world, values, opened):
    """fit on this rank, noting which shards its node indexed."""
    from paratrain.data.sources import wds as sources
    from spawn import fit_on_rank

    real = sources.WebDatasetSource._index

    def index(self, path):
        with open(opened, "a") as out:
            out.write(f"{os.environ['GROUP_RANK']} {Path(path).name}\n")
        return real(self, path)

    sources.WebDatasetSource._index = index
    return fit_on_rank(rank, world, values)


def test_shards_over_two_nodes_each_node_reads_its_own(tmp_path):
    """Two nodes of one process: node 0 reads shards 0 and 2 (24 images), node 1 shard 1
    (12): they still take the same steps (node 1's order padded), and evaluation counts
    every validation image once across the nodes."""
    pytest.importorskip("webdataset")
    from imagefolders import make_shards
    from spawn import run_distributed

    shards = make_shards(tmp_path / "wds", shards=3)
    opened = tmp_path / "opened.txt"
    values = dict(
        data=f"wds:{shards}/shard-{{000..002}}.tar",
        output_dir=str(tmp_path / "runs"),
        name="nodes",
        model="resnet18",
        image_size=16,
        batch_size=4,
        epochs=1,
        workers=0,
        cache="off",
        cache_dir=str(tmp_path / "cache"),
        val_fraction=0.25,
    )
    summaries = run_distributed(_fit_as_node, 2, values, str(opened), per_node=1)
    read = sorted(line.split() for line in opened.read_text().splitlines())
    assert sorted(set(map(tuple, read))) == [
        ("0", "shard-000.tar"),
        ("0", "shard-002.tar"),
        ("1", "shard-001.tar"),
    ]
    from paratrain.data.folder import build_split
    from paratrain.data.sources.base import open_source

    whole = build_split(open_source(values["data"], tmp_path / "c2"), 0.25)
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs/nodes/metrics.jsonl").read_text().splitlines()
    ]
    assert rows[-1]["val_count"] == len(whole.val)
    assert summaries[0]["epochs"] == summaries[1]["epochs"] == 1
