"""The suite's equal-epoch verdict (benchmarks/suite.py): the gap and spread it judges by,
and `chance`, which counts how often that verdict flags the plain loop against itself."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
suite = pytest.importorskip("suite")


def _curve(top1: list[float]) -> list[list[float]]:
    return [[10.0 * (e + 1), a] for e, a in enumerate(top1)]


def test_the_gap_is_the_means_difference_and_the_spread_the_plain_runs_pooled_deviation():
    plain = [_curve([0.5, 0.6, 0.9]), _curve([0.7, 0.6])]  # the shorter curve ends both
    other = [_curve([0.4, 0.9]), _curve([0.4, 0.9])]
    gap, spread = suite.equal_epoch_gap(plain, other)
    assert gap == pytest.approx([-0.2, 0.3])
    assert spread == pytest.approx(np.sqrt((0.02 + 0.0) / 2))  # variances 0.02 and 0
    assert suite._behind_by(gap, spread)  # 0.2 behind against a spread of 0.1
    assert not suite._behind_by([-0.05, 0.3], spread)


def _write(path: Path, rows: dict[tuple[int, str], list[float]]) -> None:
    path.write_text("".join(
        json.dumps({"set": "few", "seed": seed, "arm": arm, "curve": _curve(top1)}) + "\n"
        for (seed, arm), top1 in rows.items()
    ))  # fmt: skip


def test_chance_counts_every_draw_of_the_loop_against_itself(tmp_path, capsys):
    """One epoch, four seeds at 0.0, 0.1, 0.2 and 0.3, two a side: of the 6 draws only
    {0.2, 0.3} as the loop against {0.0, 0.1} is behind by more than its spread (0.2
    against 0.07); {0.1, 0.3} against {0.0, 0.2} is 0.1 behind, within its 0.14."""
    results = tmp_path / "r.jsonl"
    _write(results, {(seed, "plain"): [seed / 10] for seed in range(4)})
    suite.chance(Namespace(results=results, sets=["few"], group=2))
    assert "flagged in 17% of 6 draws" in capsys.readouterr().out


def test_noise_alone_flags_most_draws_over_many_epochs_and_a_lead_none(tmp_path, capsys):
    """Thirty epochs of the same noise around one level on every seed: the loop against
    itself is flagged in most draws, since the worst of 30 noisy gaps decides; runs
    half a unit ahead at every epoch are flagged in none."""
    rng = np.random.default_rng(0)
    rows: dict[tuple[int, str], list[float]] = {}
    for seed in range(6):
        plain = list(0.2 + 0.03 * rng.standard_normal(30))
        rows[(seed, "plain")] = plain
        rows[(seed, "defaults")] = [a + 0.5 for a in plain]
    results = tmp_path / "r.jsonl"
    _write(results, rows)
    suite.chance(Namespace(results=results, sets=["few"], group=3))
    told = capsys.readouterr().out
    # 20 ways to take 3 of 6 seeds as the loop, the other 3 its rival; 20 draws of 3
    null = float(told.split("flagged in ")[1].split("%")[0])
    assert "of 20 draws" in told and null >= 90, told
    lead = float(told.split("an arm ")[1].split("%")[0])
    assert 0 < lead < 50 and "ahead at every epoch would be in 20%" in told
    assert "the defaults against it (seeds [0, 1, 2, 3, 4, 5]): flagged in 0% of 20 draws" in told
    assert "their gap over every epoch and seed +50.0% (standard error 0.0%)" in told


def test_chance_needs_two_groups_of_seeds(tmp_path, capsys):
    results = tmp_path / "r.jsonl"
    _write(results, {(seed, "plain"): [0.2, 0.3] for seed in range(5)})
    suite.chance(Namespace(results=results, sets=["few"], group=3))
    assert "5 plain run(s); the loop against itself needs 6" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="at least 2 seeds a side"):
        suite.chance(Namespace(results=results, sets=["few"], group=1))
