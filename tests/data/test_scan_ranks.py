"""Scan and cache build split across ranks agree with one process (gloo, CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from imagefolders import make_image_folder
from paratrain.data.cache.build import prepare
from paratrain.data.folder import build_split
from paratrain.data.scan import find_bad_images
from spawn import run_distributed

pytestmark = pytest.mark.slow


def _scan_and_cache(rank, world, data, cache_root):
    split = build_split(data)
    paths = [p for p, _ in split.train + split.val]
    bad = find_bad_images(paths, rank, world, workers=0, show=False)
    good = [s for s in split.train + split.val if s[0] not in {p for p, _ in bad}]
    cache = prepare(good, 24, "on", 1.0, cache_root, workers=0)
    return bad, str(cache.directory), [cache.image(i).numpy() for i in range(len(good))]


def test_ranks_agree_on_bad_files_and_build_one_cache_together(tmp_path):
    data = make_image_folder(tmp_path / "d", classes=2, per_class=9, size=(50, 40))
    victim = sorted(data.rglob("*.jpg"))[5]
    victim.write_bytes(victim.read_bytes()[:100])
    results = run_distributed(_scan_and_cache, 2, str(data), str(tmp_path / "cache2"))
    alone = _scan_and_cache(0, 1, str(data), str(tmp_path / "cache1"))
    for bad, directory, images in results:
        assert bad == alone[0] and [p for p, _ in bad] == [str(victim)]
        assert directory == results[0][1]
        assert all(np.array_equal(a, b) for a, b in zip(images, alone[2], strict=True))
