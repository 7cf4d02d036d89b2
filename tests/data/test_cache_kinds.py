"""A cache kind is one module of data/cache/ plus one registry line: it declares how it is
keyed, sized, laid out, written and read, and nothing outside the package names a kind
to dispatch on it. The smallest, zlib, is tested here: lossless, so it is read exactly
as raw is, and validation may read it."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from imagefolders import make_image_folder
from paratrain.config import TrainConfig
from paratrain.config.schema import check
from paratrain.data.cache import KINDS, MODES
from paratrain.data.cache.base import CacheKind, kind, kinds_for
from paratrain.data.cache.build import prepare
from paratrain.data.folder import build_split
from paratrain.errors import UserError

SRC = Path(__file__).resolve().parents[2] / "src" / "paratrain"
PACKAGE = SRC / "data" / "cache"
MACHINERY = {"__init__", "base", "choose", "build", "verify", "read"}


def test_every_kind_module_is_registered_and_declares_its_kind():
    assert {p.stem for p in PACKAGE.glob("*.py")} - MACHINERY == set(KINDS)
    for name in KINDS:
        declared = kind(name)
        assert isinstance(declared, CacheKind) and declared.name == name
        assert type(declared).pixels is not CacheKind.pixels
    assert set(KINDS) < set(MODES) and {"auto", "on", "off"} < set(MODES)
    assert kinds_for("auto") == ["raw", "packed"] and kinds_for("on") == ["raw"]
    assert kinds_for("zlib") == ["zlib"]
    with pytest.raises(KeyError, match="no cache kind 'tiff'"):
        kind("tiff")


def test_cache_takes_every_kind_by_name_and_nothing_else():
    for name in MODES:
        check(TrainConfig(cache=name))
    with pytest.raises(UserError, match="--cache must be one of auto, on, raw, packed, zlib"):
        check(TrainConfig(cache="tiff"))


def test_nothing_outside_the_package_names_a_kind_to_dispatch_on_it():
    found = []
    for path in SRC.rglob("*.py"):
        if path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                words = {
                    n.value
                    for n in ast.walk(node)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)
                }
                if words & set(KINDS):
                    found.append(f"{path.relative_to(SRC)}:{node.lineno} compares {words}")
    assert not found, "\n".join(found)


def test_the_zlib_kind_is_lossless_smaller_on_flat_images_and_read_as_raw(tmp_path):
    data = make_image_folder(tmp_path / "d", classes=2, per_class=6, size=(64, 48))
    flat = np.zeros((48, 64, 3), np.uint8)
    flat[:, 32:] = (200, 30, 90)
    for i in range(6):
        Image.fromarray(flat).save(data / "class_1" / f"flat-{i}.png")
    split = build_split(data, val_fraction=0.2)
    raw = prepare(split.train, 32, "raw", 1.0, str(tmp_path / "c"), workers=0)
    deflated = prepare(split.train, 32, "zlib", 1.0, str(tmp_path / "c"), workers=0)
    assert deflated.kind == "zlib" and deflated.directory != raw.directory
    assert deflated.lossless and [p.endswith(".z") for p in deflated.parts] == [True]
    assert deflated.nbytes < raw.nbytes
    for row in range(len(split.train)):
        assert torch.equal(raw.image(row), deflated.image(row))
    again = prepare(split.train, 32, "zlib", 1.0, str(tmp_path / "c"), workers=0)
    assert again.directory == deflated.directory  # ready: read, not built again
    # --cache auto never takes it: raw, else packed
    assert prepare(split.train, 32, "auto", 1e-9, str(tmp_path / "a"), workers=0).kind == "packed"
