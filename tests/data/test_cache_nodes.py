"""One decoded cache per node, whether or not the nodes share a folder: 4 processes as 2
nodes of 2, building with their node's ranks; separate folders each get every image,
a shared one is built once."""

from __future__ import annotations

import hashlib

import pytest

from imagefolders import make_image_folder
from paratrain.data.cache.base import MANIFEST
from paratrain.data.cache.build import prepare
from paratrain.data.folder import build_split
from paratrain.distributed.env import DistEnv
from spawn import run_distributed

pytestmark = pytest.mark.slow


def _on_node(rank: int, world: int, data: str, roots: list[str]) -> tuple[str, str]:
    split = build_split(data)
    node = rank // 2
    env = DistEnv(
        rank=rank, world_size=world, local_rank=rank % 2, local_world_size=2, node_rank=node
    )
    cache = prepare(split.train + split.val, 24, "on", 1.0, roots[node], workers=0, env=env)
    digest = hashlib.sha256((cache.directory / "data.u8").read_bytes()).hexdigest()
    return str(cache.directory), digest


@pytest.mark.parametrize("shared", [False, True], ids=["a folder per node", "one shared folder"])
def test_every_node_has_the_whole_cache(tmp_path, shared):
    data = make_image_folder(tmp_path / "data", classes=3, per_class=7)
    roots = (
        [str(tmp_path / "shared")] * 2 if shared else [str(tmp_path / f"node{n}") for n in (0, 1)]
    )
    results = run_distributed(_on_node, 4, str(data), roots)
    assert len({digest for _, digest in results}) == 1  # the same pixels everywhere
    folders = {folder for folder, _ in results}
    assert len(folders) == (1 if shared else 2)
    for folder in folders:
        assert (tmp_path / folder / MANIFEST).is_file()
