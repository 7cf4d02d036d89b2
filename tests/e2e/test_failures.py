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

from trainruns import (
    EVERY_2,
    assert_bitwise_equal,
    env_for,
    job,
    leftover,
    run,
    small_data,
    weights,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    return small_data(tmp_path_factory.mktemp("faults"))


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


def test_resume_mid_epoch_is_bit_exact(data, uninterrupted):
    root, folder = data
    common = job(folder, "broken", *EVERY_2, epochs=2)
    crashed, _ = run(root, *common, PARATRAIN_INJECT="rank=1,step=9,kind=raise")
    assert crashed.returncode != 0
    state = torch.load(root / "runs/broken/checkpoints/last.pt", weights_only=False)
    assert (
        state["parts"]["progress"]["epoch"],
        state["parts"]["progress"]["step_in_epoch"],
        state["parts"]["progress"]["global_step"],
    ) == (1, 2, 8)
    assert len(state["parts"]["rng"]) == 2 and state["parts"]["recipe"]["scaler"] is None
    resumed, _ = run(root, *common, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from runs/broken/checkpoints/last.pt at epoch 2, step 2" in resumed.stdout
    assert_bitwise_equal(weights(root, "broken"), uninterrupted)


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
    assert_bitwise_equal(weights(root, "packed-broken"), weights(root, "packed-straight"))


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
    assert_bitwise_equal(weights(root, "restarted"), uninterrupted)


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
        env=env_for(root, **env),
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
    assert state["parts"]["progress"]["global_step"] > 0 and len(state["parts"]["rng"]) == 2


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
    assert state["parts"]["progress"]["global_step"] == 4  # the save before the failed one


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
    assert_bitwise_equal(weights(root, "chaos"), weights(root, "calm"))
