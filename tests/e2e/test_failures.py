"""Failures, restarts, preemption, non-finite losses and ports, as a user meets them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from imagefolders import make_image_folder

pytestmark = pytest.mark.slow

# 3 classes x 20 images: 48 train / 12 val; batch 4 x 2 processes = 6 steps per epoch
FAST = ["--model", "resnet18", "--image-size", "16", "--batch-size", "4", "--workers", "0"]


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PARATRAIN_CACHE=str(root / "cache"), PYTHONUNBUFFERED="1", **extra)
    return env


EVERY_2 = ["--deterministic", "--save-every-steps", "2"]


def job(folder: Path, name: str, *extra: str, nproc: int = 2, epochs: int = 1) -> list[str]:
    """The arguments of one small training job."""
    return [
        "--data",
        str(folder),
        "--nproc",
        str(nproc),
        "--epochs",
        str(epochs),
        "--name",
        name,
        *FAST,
        *extra,
    ]


def run(root: Path, *args: str, timeout: float = 240, **env: str):
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "paratrain", "train", *args],
        cwd=root,
        env=_env(root, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out, time.monotonic() - start


def leftover(tag: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", "--", tag], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


def weights(root: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(root / "runs" / name / "checkpoints" / "last.pt", weights_only=False)["model"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("faults")
    return root, make_image_folder(root / "data", classes=3, per_class=20)


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_failure_on_one_rank_ends_every_rank(data, nproc):
    root, folder = data
    tag = f"failrun{nproc}"
    out, seconds = run(
        root, *job(folder, tag, nproc=nproc, epochs=2), PARATRAIN_INJECT="rank=1,step=2,kind=raise"
    )
    assert out.returncode != 0
    assert seconds < 60
    assert "[rank 1] InjectedFailure: injected failure at step 2" in out.stderr
    assert "rank 1 failed with exit code 1" in out.stderr
    assert leftover(tag) == []


def test_a_stuck_rank_ends_the_run_within_the_timeout(data):
    root, folder = data
    proc = _start(
        root,
        job(folder, "stuck", "--timeout", "5", "--preempt-grace", "2"),
        PARATRAIN_INJECT="rank=1,step=2,kind=hang",
    )
    _wait_for_training(proc)
    hung_at = time.monotonic()  # rank 1 hangs at its second step, right after this
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    # the healthy rank's collective times out (5 s); the launcher then stops the stuck
    # one, which gets --preempt-grace (2 s) to reach a step it never reaches
    assert time.monotonic() - hung_at < 5 + 2 + 15
    assert leftover("--name stuck") == []


@pytest.fixture(scope="module")
def uninterrupted(data):
    root, folder = data
    out, _ = run(root, *job(folder, "straight", "--deterministic", epochs=2))
    assert out.returncode == 0, out.stderr
    return weights(root, "straight")


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_resume_mid_epoch_is_bit_exact(data, uninterrupted):
    root, folder = data
    common = job(folder, "broken", *EVERY_2, epochs=2)
    crashed, _ = run(root, *common, PARATRAIN_INJECT="rank=1,step=9,kind=raise")
    assert crashed.returncode != 0
    state = torch.load(root / "runs/broken/checkpoints/last.pt", weights_only=False)
    assert (
        state["progress"]["epoch"],
        state["progress"]["step_in_epoch"],
        state["progress"]["global_step"],
    ) == (1, 2, 8)
    assert len(state["rng"]) == 2 and state["scaler"] is None
    resumed, _ = run(root, *common, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from runs/broken/checkpoints/last.pt at epoch 2, step 2" in resumed.stdout
    _assert_bitwise_equal(weights(root, "broken"), uninterrupted)


def test_resume_mid_epoch_from_a_packed_cache_is_bit_exact(data):
    """The packed cache's JPEGs decode to the same pixels every epoch and on resume."""
    root, folder = data
    packed = ["--cache", "packed", *EVERY_2]
    straight, _ = run(root, *job(folder, "packed-straight", *packed, epochs=2))
    assert straight.returncode == 0, straight.stderr
    assert "packed" in straight.stdout
    common = job(folder, "packed-broken", *packed, epochs=2)
    crashed, _ = run(root, *common, PARATRAIN_INJECT="rank=1,step=9,kind=raise")
    assert crashed.returncode != 0
    resumed, _ = run(root, *common, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    _assert_bitwise_equal(weights(root, "packed-broken"), weights(root, "packed-straight"))


def test_resume_with_another_world_size_says_what_changed(data, uninterrupted):
    root, folder = data
    out, _ = run(root, *job(folder, "straight", "--resume", "auto", nproc=1, epochs=3))
    assert out.returncode == 0, out.stderr
    assert "world size 2 -> 1: global batch 8 -> 4, lr 0.005 -> 0.0025" in out.stdout
    rows = (root / "runs/straight/metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["epoch"] for r in rows] == [1, 2, 3]


def test_killed_worker_restarts_and_ends_like_an_uninterrupted_run(data, uninterrupted):
    root, folder = data
    out, _ = run(
        root,
        *job(folder, "restarted", *EVERY_2, "--max-restarts", "1", epochs=2),
        PARATRAIN_INJECT="rank=1,step=9,kind=kill,attempt=0",
    )
    assert out.returncode == 0, out.stderr
    assert "resumed from runs/restarted/checkpoints/last.pt at epoch 2, step 2" in out.stdout
    _assert_bitwise_equal(weights(root, "restarted"), uninterrupted)


def test_restart_budget_exhausted_names_the_rank(data):
    root, folder = data
    out, _ = run(
        root,
        *job(folder, "doomed", "--max-restarts", "1"),
        PARATRAIN_INJECT="rank=1,step=2,kind=kill",
    )
    assert out.returncode != 0
    assert "rank 1 was killed by signal SIGKILL (after 1 restart(s))" in out.stderr


def _start(
    root: Path, args: list[str], quiet: bool = False, new_session: bool = False, **env: str
) -> subprocess.Popen:
    """A training command started and left running; ``quiet``: its output dropped (it
    is never read); ``new_session``: in a process group of its own."""
    out = subprocess.DEVNULL if quiet else subprocess.PIPE
    return subprocess.Popen(
        [sys.executable, "-m", "paratrain", "train", *args],
        cwd=root,
        env=_env(root, **env),
        stdout=out,
        stderr=out,
        text=True,
        start_new_session=new_session,
    )


def _wait_for_training(proc: subprocess.Popen) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.lstrip().startswith("global batch"):  # printed just before the first step
            break
    return lines


def _start_and_signal(root: Path, args: list[str], sig: int, **env: str):
    proc = _start(root, args, **env)
    lines = _wait_for_training(proc)
    time.sleep(3)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=90)
    return proc.returncode, "".join(lines) + stdout, stderr


def test_sigterm_saves_at_a_step_boundary_and_exits_143(data):
    root, folder = data
    code, _, stderr = _start_and_signal(
        root,
        job(folder, "preempted", epochs=50),
        signal.SIGTERM,
    )
    assert code == 143, stderr
    assert "stopped by SIGTERM; checkpoint saved" in stderr
    state = torch.load(root / "runs/preempted/checkpoints/last.pt", weights_only=False)
    assert state["progress"]["global_step"] > 0 and len(state["rng"]) == 2


def test_sigusr1_under_slurm_requeues_the_array_task(data, tmp_path):
    root, folder = data
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "scontrol").write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/scontrol.args\n')
    (stub / "scontrol").chmod(0o755)
    slurm = dict(
        SLURM_PROCID="0",
        SLURM_NTASKS="1",
        SLURM_LOCALID="0",
        SLURM_JOB_ID="77",
        SLURM_ARRAY_JOB_ID="70",
        SLURM_ARRAY_TASK_ID="3",
        SLURM_JOB_NODELIST="localhost",
        PATH=f"{stub}:{os.environ['PATH']}",
    )
    code, stdout, stderr = _start_and_signal(
        root,
        job(folder, "slurmjob", "--requeue", nproc=1, epochs=50),
        signal.SIGUSR1,
        **slurm,
    )
    assert code == 128 + signal.SIGUSR1, stderr
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "70_3"]
    assert "requeued: scontrol requeue 70_3" in stdout
    assert (root / "runs/slurmjob/checkpoints/last.pt").is_file()


def test_nan_on_one_rank_aborts_every_rank_with_the_step(data):
    root, folder = data
    out, _ = run(root, *job(folder, "nan"), PARATRAIN_INJECT="rank=1,step=2,kind=nan")
    assert out.returncode == 3, out.stderr
    assert "non-finite loss at step 2 (epoch 1) on 1 rank(s)" in out.stderr
    assert "Traceback" not in out.stderr


def test_nan_on_one_rank_is_skipped_everywhere(data):
    root, folder = data
    out, _ = run(
        root,
        *job(folder, "nanskip", "--on-nonfinite", "skip"),
        PARATRAIN_INJECT="rank=1,step=2,kind=nan",
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads((root / "runs/nanskip/summary.json").read_text())
    assert summary["skipped_steps"] == 1
    assert "1 non-finite step(s) skipped" in out.stdout


def test_a_port_in_use_fails_fast_and_names_it(data):
    root, folder = data
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out, seconds = run(root, *job(folder, "port", "--master-port", str(port)), timeout=60)
    assert out.returncode == 2
    assert f"--master-port {port} is not available" in out.stderr
    assert seconds < 30


@pytest.fixture(scope="module")
def start_weights(data) -> Path:
    """ImageNet-shaped ResNet-18 weights (1,000 outputs) to fine-tune from."""
    import torchvision

    root, _ = data
    torch.manual_seed(3)
    path = root / "resnet18-start.pth"
    torch.save(torchvision.models.resnet18(num_classes=1000).state_dict(), path)
    return path


def _last(root: Path, name: str) -> dict[str, torch.Tensor]:
    """The run's last weights, from one file or consolidated from its shards."""
    from paratrain.engine import checkpoint

    folder = root / "runs" / name / "checkpoints"
    path = folder / "last.pt" if (folder / "last.pt").exists() else folder / "last"
    return checkpoint.load(path).model


FINE_TUNE = ["--freeze-epochs", "1", "--head-lr-mult", "10", "--layer-decay", "0.8"]


@pytest.mark.parametrize(
    "strategy",
    # the pipeline's cut given: chosen by timing, two runs on a busy machine may cut apart;
    # its BatchNorm sees a micro-batch, of 4 images as ddp's does (at 2 of 1x1 maps the
    # thawed backbone's loss ran to infinity in bf16 on an AMX Xeon: told as non-finite)
    [
        ["ddp"],
        ["fsdp"],
        ["pipeline", "--microbatches", "2", "--split-points", "layer3.0", "--batch-size", "8"],
    ],
    ids=lambda s: s[0],
)
def test_fine_tuning_freezes_thaws_and_resumes_bit_exactly(data, start_weights, strategy):
    """A frozen backbone (its BatchNorm statistics too) is still the weights file's at
    a checkpoint inside the frozen epoch; it thaws at epoch 2 with the head's and the
    layers' own rates; a run resumed inside the frozen epoch ends bit for bit as the
    uninterrupted one, under every strategy that spans processes."""
    root, folder = data
    name = strategy[0]
    tuned = [*FINE_TUNE, "--weights", str(start_weights), "--strategy", *strategy, *EVERY_2]
    straight, _ = run(root, *job(folder, f"ft-{name}", *tuned, epochs=2))
    assert straight.returncode == 0, straight.stderr
    assert "epoch 2: the backbone thaws; every layer trains" in straight.stdout
    assert "backbone frozen for 1 epoch(s), head lr x10, layer-wise lr decay 0.8" in (
        straight.stdout
    )
    common = job(folder, f"ft-{name}-broken", *tuned, epochs=2)
    crashed, _ = run(root, *common, PARATRAIN_INJECT="rank=1,step=5,kind=raise")
    assert crashed.returncode != 0
    frozen = _last(root, f"ft-{name}-broken")  # saved at step 4, inside the frozen epoch
    start = torch.load(start_weights, weights_only=True)
    backbone = [k for k in frozen if not k.startswith("fc.")]
    assert len(backbone) == len(start) - 2
    for key in backbone:
        assert torch.equal(frozen[key].to(start[key].dtype), start[key]), key
    resumed, _ = run(root, *common, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "epoch 2: the backbone thaws" in resumed.stdout
    final = _last(root, f"ft-{name}-broken")
    _assert_bitwise_equal(final, _last(root, f"ft-{name}"))
    assert not torch.equal(final["conv1.weight"], start["conv1.weight"])  # it thawed


def test_a_budget_ends_on_time_and_a_resumed_run_keeps_what_is_left(data):
    """--budget 2m, stopped a third of the way and resumed: the saved checkpoint says
    what was spent, the resumed run plans the rest, and the two together end within 5%
    of the budget; the size grows over the run (--progressive) and evaluation averages
    each image with its mirror (--tta flip)."""
    root, folder = data
    budget = 120.0
    common = job(
        folder, "budget", "--budget", "2m", "--progressive", "16:32", "--tta", "flip",
        "--save-every-steps", "20", epochs=3,
    )  # fmt: skip
    crashed, first_wall = run(root, *common, PARATRAIN_INJECT="rank=1,step=150,kind=raise")
    assert crashed.returncode != 0
    assert "budget 2m: " in crashed.stdout and "epochs fit in the" in crashed.stdout
    assert "training at 16px" in crashed.stdout
    spent = torch.load(root / "runs/budget/checkpoints/last.pt", weights_only=False)["progress"][
        "seconds"
    ]
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


def test_a_run_folder_in_use_is_refused_and_free_again_once_its_run_is_killed(data):
    root, folder = data
    args = job(folder, "held", "--save-every-steps", "2", epochs=500)
    first = _start(root, args, quiet=True, new_session=True)
    saved = root / "runs/held/checkpoints/last.pt"
    deadline = time.monotonic() + 120
    while not saved.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    second, _ = run(root, *job(folder, "held", "--resume", "auto", epochs=1))
    told = [line for line in second.stderr.splitlines() if line.strip()]
    assert second.returncode == 2 and len(told) == 1, second.stderr
    assert "is in use by a run still going (host " in told[0]
    assert ", pid " in told[0]
    os.killpg(first.pid, signal.SIGKILL)  # the launcher dies without a word
    first.wait(timeout=30)
    deadline = time.monotonic() + 15  # its workers, in sessions of their own, follow it
    while leftover("--name held") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftover("--name held") == []
    third, _ = run(root, *job(folder, "held", "--resume", "auto", epochs=1))
    assert third.returncode == 0, third.stderr  # nothing left to do, and not refused


def test_a_run_that_trained_nothing_leaves_no_folder_to_block_its_name(data):
    root, folder = data
    failed, _ = run(root, *job(folder, "nothing"), PARATRAIN_INJECT="rank=0,step=1,kind=raise")
    assert failed.returncode != 0
    assert not (root / "runs" / "nothing").exists()
    again, _ = run(root, *job(folder, "nothing"))
    assert again.returncode == 0, again.stderr


def test_a_full_disk_at_a_save_keeps_the_checkpoint_before_and_says_why(data):
    root, folder = data
    out, _ = run(
        root,
        *job(folder, "full", *EVERY_2, epochs=2),
        PARATRAIN_INJECT="rank=0,step=6,kind=disk_full",
    )
    told = [line for line in out.stderr.splitlines() if line.startswith("paratrain:")]
    assert out.returncode == 2 and len(told) == 1, out.stderr
    assert "could not write a checkpoint in" in told[0] and "No space left on device" in told[0]
    assert "Traceback" not in out.stderr
    state = torch.load(root / "runs/full/checkpoints/last.pt", weights_only=False)
    assert state["progress"]["global_step"] == 4  # the save before the failed one


def test_chaos_four_kills_at_random_moments_end_bit_identical(data):
    """Workers killed with SIGKILL four times at random moments: torch's elastic agent
    restarts them (--max-restarts), each restart resumes from the newest step
    checkpoint, and the final weights are those of the run never disturbed."""
    import random

    root, folder = data
    straight, _ = run(root, *job(folder, "calm", "--deterministic", epochs=6))
    assert straight.returncode == 0, straight.stderr
    args = job(folder, "chaos", *EVERY_2, "--max-restarts", "4", epochs=6)
    proc = _start(root, args)
    chance = random.Random(7)
    saved = root / "runs/chaos/checkpoints/last.pt"
    kills = 0
    deadline = time.monotonic() + 240
    while kills < 4 and proc.poll() is None and time.monotonic() < deadline:
        if not saved.exists():
            time.sleep(0.2)
            continue
        time.sleep(chance.uniform(0.5, 2.0))
        workers = [
            int(line.split()[0])
            for line in leftover("--name chaos")
            if int(line.split()[0]) != proc.pid
        ]
        if workers:
            os.kill(chance.choice(workers), signal.SIGKILL)
            kills += 1
    out, err = proc.communicate(timeout=300)
    assert kills == 4 and proc.returncode == 0, (kills, err)
    _assert_bitwise_equal(weights(root, "chaos"), weights(root, "calm"))
