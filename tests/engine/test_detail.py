"""--budget-recipe auto keeps the sizes where a lower resolution loses what tells the
classes apart (engine/prerun/detail.py): on a set whose classes differ by where a
1-pixel checkerboard lies, the cells' contrast tells them apart at 64 px and not at the
low-res recipe's 48; on a set whose classes differ by colour and shape, both sizes do
alike, and the recipe goes low."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from paratrain.config.train import TrainConfig
from paratrain.data.folder import build_split
from paratrain.engine.prerun import budget as budget_module
from paratrain.engine.prerun.budget import low_res
from paratrain.engine.prerun.detail import MARGIN, check_detail


def _checks(root: Path, per_class: int = 24) -> Path:
    """4 classes: a 1-pixel checkerboard in the top half, the bottom, both, neither (the
    rest flat at the same mean), 73 px a side, under noise."""
    yy, xx = np.mgrid[0:73, 0:73]
    checker = (yy + xx) % 2 * 2 - 1
    for label in range(4):
        (root / f"c{label}").mkdir(parents=True)
        for i in range(per_class):
            rng = np.random.default_rng([label, i])
            cut = 36 + int(rng.integers(-6, 7))
            where = np.zeros((73, 1))
            where[:cut] = label in (0, 2)
            where[cut:] = label in (1, 2)
            pixels = rng.uniform(80, 170) + 30 * checker * where + rng.normal(0, 10, (73, 73))
            image = np.repeat(np.clip(pixels, 0, 255).astype(np.uint8)[..., None], 3, 2)
            Image.fromarray(image).save(root / f"c{label}" / f"{i}.png")
    return root


def _shapes(root: Path, per_class: int = 24) -> Path:
    """4 classes by colour and shape, at any place, 96x72."""
    colours = [(200, 60, 60), (60, 200, 60), (60, 60, 200), (200, 200, 60)]
    for label in range(4):
        (root / f"s{label}").mkdir(parents=True)
        for i in range(per_class):
            rng = np.random.default_rng([9, label, i])
            image = Image.fromarray(rng.integers(60, 190, (72, 96, 3), dtype=np.uint8))
            x, y, r = int(rng.integers(15, 80)), int(rng.integers(15, 57)), int(rng.integers(8, 15))
            draw = ImageDraw.Draw(image)
            box = (x - r, y - r, x + r, y + r)
            (draw.ellipse if label % 2 else draw.rectangle)(box, fill=colours[label])
            image.save(root / f"s{label}" / f"{i}.png")
    return root


def test_fine_checks_are_told_apart_at_the_size_given_and_not_at_the_low_one(tmp_path):
    split = build_split(_checks(tmp_path / "checks"))
    cfg = TrainConfig(data=str(tmp_path), image_size=64, budget="60s")
    check = check_detail(split.train, cfg, low_res(cfg))
    assert low_res(cfg).eval_crop == 48 and check.images == len(split.train)
    assert check.given > 0.8 and check.low < 0.55 and check.lost
    assert "at 64 px" in check.words(64, 48) and "at 48 px" in check.words(64, 48)


def test_colour_and_shape_are_told_apart_at_both_sizes(tmp_path):
    split = build_split(_shapes(tmp_path / "shapes"))
    cfg = TrainConfig(data=str(tmp_path), image_size=64, budget="60s")
    check = check_detail(split.train, cfg, low_res(cfg))
    assert check.given > 0.6 and abs(check.given - check.low) < MARGIN and not check.lost


@pytest.mark.parametrize(("kind", "recipe"), [("checks", "fixed"), ("shapes", "low-res")])
def test_auto_keeps_the_sizes_where_the_low_ones_lose_the_classes(tmp_path, monkeypatch, kind,
                                                                   recipe):  # fmt: skip
    import paratrain.engine.prerun.probe as probe
    from paratrain.distributed.env import DistEnv
    from paratrain.distributed.runtime import Runtime

    said: list[str] = []
    monkeypatch.setattr(budget_module, "get_logger", lambda: SimpleNamespace(info=said.append))
    # few epochs fit whatever the clock: 10 s a step, and none of the budget gone yet
    # (since_start is this test process's age otherwise)
    timed: list[int] = []
    monkeypatch.setattr(probe, "step_seconds", lambda cfg, runtime: timed.append(1) or (10.0, 1))
    monkeypatch.setattr(budget_module, "since_start", lambda: 0.0)
    root = (_checks if kind == "checks" else _shapes)(tmp_path / kind)
    split = build_split(root)
    cfg = TrainConfig(data=str(root), model="resnet18", image_size=64, budget="60s")
    runtime = Runtime(env=DistEnv(), device=torch.device("cpu"), backend=None)
    chosen = budget_module.choose_recipe(cfg, runtime, split, None)
    assert chosen.budget_recipe == recipe
    # the look comes first; where it keeps the sizes no step is timed (the probe's
    # seconds are the budget's), else the probe's line follows and decides
    assert "nearest class mean" in said[0]
    if recipe == "fixed":
        assert said[0].endswith("the sizes as given") and len(said) == 1 and not timed
    else:
        assert said[0].endswith("the lower size keeps it") and timed == [1]
        assert "timing a few steps" in said[1] and said[-1].endswith("--budget-recipe low-res")
