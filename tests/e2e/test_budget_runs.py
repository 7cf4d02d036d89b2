"""--budget runs end to end: on time across a crash and a resume, the epoch counter
following the plan, and the low-resolution recipe kept by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from trainruns import job, run, small_data

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    return small_data(tmp_path_factory.mktemp("budget"))


def test_a_budget_ends_on_time_and_a_resumed_run_keeps_what_is_left(data):
    """--budget 90s, stopped about a third of the way and resumed: the saved checkpoint says
    what was spent, the resumed run plans the rest, and the two together end within 5%
    of the budget; the size grows over the run (--progressive) and evaluation averages
    each image with its mirror (--tta flip)."""
    root, folder = data
    budget = 90.0
    common = job(
        folder, "budget", "--budget", "90s", "--progressive", "16:32", "--tta", "flip",
        "--save-every-steps", "20", epochs=3,
    )  # fmt: skip
    crashed, first_wall = run(root, *common, PARATRAIN_INJECT="rank=1,step=110,kind=raise")
    assert crashed.returncode != 0
    assert "budget 1m30s: " in crashed.stdout and "epochs fit in the" in crashed.stdout
    assert "training at 16px" in crashed.stdout
    spent = torch.load(root / "runs/budget/checkpoints/last.pt", weights_only=False)["parts"][
        "progress"
    ]["seconds"]
    assert 5 < spent < first_wall
    resumed, wall = run(root, *common, "--resume", "auto", timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "training at 32px" in resumed.stdout  # the ramp's end, in the run's last part
    assert abs(spent + wall - budget) < 0.05 * budget, (spent, wall)
    assert _counter_follows_the_plan(crashed.stdout) and _counter_follows_the_plan(resumed.stdout)
    rows = [json.loads(r) for r in (root / "runs/budget/metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["epoch"] > 3  # --epochs gave way to the budget
    assert rows[-1]["lr"] < rows[0]["lr"]  # the schedule ran its course


def _counter_follows_the_plan(stdout: str) -> int:
    """Every epoch line's total ("epoch 3/9") is the plan's last whole end, said before
    it: the first plan's epochs rounded up, or the end a re-plan named. Returns the
    number of epoch lines checked (each one fails the assertion if it disagrees)."""
    import math
    import re

    total, checked = None, 0
    for line in stdout.splitlines():
        if first := re.search(r"budget \S+: ([0-9.]+) epochs fit in the", line):
            total = max(math.ceil(float(first.group(1)) - 1e-9), 1)
        elif re.search(r"budget \S+: not one epoch fits", line):
            total = 1
        elif moved := re.search(r"the run now ends after epoch (\d+)", line):
            total = int(moved.group(1))
        elif shown := re.match(r"epoch \d+/(\d+) ", line):
            assert total is not None and int(shown.group(1)) == total, (line, total)
            checked += 1
    return checked


def test_a_budgets_low_res_recipe_is_recorded_by_name_and_kept_by_a_resumed_run(data):
    """--budget-recipe low-res at 32 px: training at 16 and evaluating at 24, batch 8 a
    process; config.yaml names the recipe over the sizes as given (so --config reruns
    it), the checkpoint holds the sizes trained at, and a run stopped and resumed with
    the default (auto) goes on with the recorded recipe instead of timing anew."""
    root, folder = data
    sizes = ["--image-size", "32", "--batch-size", "4", "--save-every-steps", "2"]
    common = job(folder, "lowres", "--budget", "30s", *sizes, epochs=2)
    crashed, _ = run(
        root, *common, "--budget-recipe", "low-res", PARATRAIN_INJECT="rank=1,step=4,kind=raise"
    )
    assert crashed.returncode != 0
    told = "--budget-recipe low-res: training at 16 px, evaluating at 24, batch 8 a process"
    assert told in crashed.stdout, crashed.stdout
    recorded = yaml.safe_load((root / "runs/lowres/config.yaml").read_text())
    assert (recorded["budget_recipe"], recorded["image_size"], recorded["batch_size"]) == (
        "low-res",
        32,
        4,
    )
    saved = torch.load(root / "runs/lowres/checkpoints/last.pt", weights_only=False)
    trained = {k: saved["config"][k] for k in ("train_crop", "val_crop", "batch_size")}
    assert trained == {"train_crop": 16, "val_crop": 24, "batch_size": 8}
    resumed, _ = run(root, *common, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert told in resumed.stdout and "epochs fit at" not in resumed.stdout  # not timed again
    final = torch.load(root / "runs/lowres/checkpoints/last.pt", weights_only=False)
    assert {k: final["config"][k] for k in trained} == trained
