"""Pretrained weights are worth having: a model trained on digits 0-5 and fine-tuned on
12 images each of digits 6-9 beats the same run from random weights, in the mean over
three seeds."""

from __future__ import annotations

from pathlib import Path

import pytest

from paratrain import TrainConfig, train
from paratrain.data.builtin import ensure_digits
from paratrain.engine.checkpointing import checkpoint

pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)  # the fine-tuning runs' (each pair alike but for the weights)


def _sets(root: Path) -> tuple[Path, Path]:
    """Digits 0-5 whole (to pretrain on); digits 6-9 as 12 training images each and
    the rest (about 165 each) for validation."""
    digits = ensure_digits(root / "cache")
    source, target = root / "source", root / "target"
    source.mkdir()
    for label in range(6):
        (source / str(label)).symlink_to(digits / str(label))
    for label in range(6, 10):
        files = sorted((digits / str(label)).iterdir())
        for side, part in (("train", files[:12]), ("val", files[12:])):
            folder = target / side / str(label)
            folder.mkdir(parents=True)
            for file in part:
                (folder / file.name).symlink_to(file)
    return source, target


def test_fine_tuning_beats_the_same_run_from_scratch(tmp_path):
    source, target = _sets(tmp_path)
    common = dict(
        image_size=16,
        workers=0,
        hflip=0.0,
        crop_scale_min=0.7,
        cache_dir=str(tmp_path / "cache"),
        output_dir=str(tmp_path / "runs"),
    )
    train(
        TrainConfig(
            data=str(source), name="pre", epochs=4, batch_size=32, lr=0.02, warmup_epochs=1,
            **common,
        )
    )  # fmt: skip
    start = tmp_path / "runs" / "pre" / "checkpoints" / "last.pt"
    assert checkpoint.load(start).classes == [str(c) for c in range(6)]
    runs: dict[str, list[float]] = {"scratch": [], "tuned": []}
    for seed in SEEDS:
        for name, weights in (("scratch", None), ("tuned", str(start))):
            summary = train(
                TrainConfig(
                    data=str(target), name=f"{name}-{seed}", epochs=6, batch_size=16, lr=0.01,
                    weights=weights, seed=seed, **common,
                )
            )  # fmt: skip
            runs[name].append(summary["best_val_top1"])
    tuned, scratch = (sum(runs[name]) / len(SEEDS) for name in ("tuned", "scratch"))
    print(f"fine-tuned best val top-1 {tuned:.3f}, from scratch {scratch:.3f}: {runs}")
    # 4 classes, so chance is 0.25. A single pair moves by more than the margin with the
    # arithmetic: 0.76 against 0.59 (2-core EPYC, bf16); on a Xeon with AMX 0.66 against 0.59
    # at one thread (the suite's workers, OMP_NUM_THREADS=1) and 0.72 against 0.41 at two.
    # Over seeds 0-2 there: 0.67 against 0.51 at one thread, 0.68 against 0.46 at two
    assert tuned > scratch + 0.1, runs
