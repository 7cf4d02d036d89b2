"""Ctrl-C during training: told once, with the checkpoint kept and how to go on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from imagefolders import make_image_folder
from paratrain.engine.checkpointing import checkpoint
from paratrain.engine.run.preempt import interrupts_deferred


@pytest.fixture
def ctrl_c_as_a_terminal_has_it():
    """SIGINT raising KeyboardInterrupt here and in the runs started here, even when the
    suite runs as a shell's background job (which starts with SIGINT ignored, and its
    children inherit that)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_an_interrupt_during_a_checkpoint_write_waits_for_the_write(ctrl_c_as_a_terminal_has_it):
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # delivered by now, and held
            finished = True
    assert finished
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


class Run:
    """A run started in a process group of its own, its output going to files (a pipe
    that nobody reads while the test waits would stop a run that writes more than the
    pipe holds)."""

    def __init__(self, process: subprocess.Popen, out: Path, err: Path) -> None:
        self.process, self.pid, self._out, self._err = process, process.pid, out, err

    def output(self, timeout: float) -> tuple[str, str]:
        """(stdout, stderr) once the run has ended."""
        self.process.wait(timeout=timeout)
        return self._out.read_text(errors="replace"), self._err.read_text(errors="replace")

    @property
    def returncode(self) -> int | None:
        return self.process.returncode


def _ctrl_c_by_default() -> None:
    """In the run's process before it starts: SIGINT as a terminal's job has it, even if
    this suite was started with it ignored (a shell's background job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _train_in_its_own_group(tmp_path: Path, data: Path, name: str, *extra: str):
    """A long run in a process group of its own (as a terminal's job, or a cluster's),
    once its first checkpoint is written: (the run, that checkpoint's path)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PARATRAIN_CACHE"] = str(tmp_path / "cache")
    env["PYTHONFAULTHANDLER"] = "1"  # SIGABRT: every thread's stack, should it hang
    argv = [
        *(sys.executable, "-m", "paratrain", "train", "--data", str(data), "--name", name),
        *("--model", "resnet18", "--image-size", "16", "--batch-size", "4", "--epochs", "500"),
        *extra,
    ]
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = subprocess.Popen(
            argv,
            cwd=tmp_path,
            env=env,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,  # a signal to the group reaches every process of the run
            preexec_fn=_ctrl_c_by_default,
        )
    run = Run(process, out, err)
    saved = tmp_path / "runs" / name / "checkpoints" / "last.pt"
    deadline = time.monotonic() + 120
    while not saved.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    if not saved.exists():  # say why, rather than failing later on a missing file
        waited = time.monotonic() - deadline + 120
        # where each of its processes is (its workers are in sessions of their own)
        subprocess.run(["pkill", "-ABRT", "-f", str(data)], check=False)
        time.sleep(3)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-9", "-f", str(data)], check=False)
        printed, told = run.output(timeout=60)
        pytest.fail(
            f"no checkpoint after {waited:.0f} s, exit code {process.returncode}:\n"
            f"{printed[-2000:]}\n{told[-12000:]}"
        )
    return run, saved


@pytest.mark.parametrize("nproc", [1, 2])
def test_ctrl_c_is_told_once_and_the_run_resumes_from_what_it_kept(tmp_path, nproc):
    data = make_image_folder(tmp_path / "data", classes=3, per_class=8)
    run, saved = _train_in_its_own_group(
        tmp_path, data, "r", "--workers", "0", "--precision", "32", "--nproc", str(nproc)
    )
    time.sleep(1.0)  # well into later epochs, whose saves the signal may hit
    os.killpg(run.pid, signal.SIGINT)
    out, err = run.output(timeout=120)
    assert run.returncode == 130, err
    assert "Traceback" not in err, err
    told = [line for line in err.splitlines() if line.startswith("paratrain:")]
    assert len(told) == 1, err
    assert told[0].startswith(f"paratrain: interrupted; its last checkpoint {Path('runs/r')}")
    assert told[0].endswith("--resume runs/r continues from it")
    reached = checkpoint.load(saved).progress["epoch"]
    assert reached >= 1


@pytest.mark.parametrize(
    ("sig", "code", "nproc"),
    [
        (signal.SIGTERM, 143, 1),
        (signal.SIGTERM, 143, 2),
        (signal.SIGUSR1, 138, 1),
        (signal.SIGUSR1, 138, 2),  # the launcher died of it at once, the step was lost
        (signal.SIGINT, 130, 2),
    ],
    ids=["sigterm-1", "sigterm-2", "sigusr1-1", "sigusr1-2", "sigint-2"],
)
def test_a_signal_to_the_whole_group_reaches_loader_workers_and_still_saves(
    tmp_path, sig, code, nproc
):
    """As SLURM preempts (every process of the job signalled, loader workers too) and
    as a terminal's Ctrl-C does: the workers leave the signal to their rank, which acts
    on it (a preemption saves at the step it reached) and exits with the signal's code,
    without a DataLoader traceback."""
    data = make_image_folder(tmp_path / "data", classes=3, per_class=12)
    run, saved = _train_in_its_own_group(
        tmp_path, data, "g", "--cache", "off", "--workers", "1", "--nproc", str(nproc),
        "--save-every-steps", "1000",
    )  # fmt: skip
    first = checkpoint.load(saved).progress["global_step"]
    time.sleep(1.5)  # inside a later epoch, its loader workers busy
    os.killpg(run.pid, sig)
    out, err = run.output(timeout=120)
    assert run.returncode == code, err
    assert "Traceback" not in err and "DataLoader worker" not in err, err
    after = checkpoint.load(saved).progress
    if sig != signal.SIGINT:  # a preemption: saved at the step it reached
        assert after.global_step > first and after.step_in_epoch > 0, (first, after)
    else:  # Ctrl-C: what was saved is kept, and said (test above)
        assert after.global_step >= first and "interrupted; its last checkpoint" in err


def test_a_rank_told_to_stop_twice_saves_once(tmp_path):
    """SIGUSR1 to the whole group, then the launcher killed outright: each worker is
    told by the signal and again by its parent's death (SIGTERM, PR_SET_PDEATHSIG). It
    used to end at the second without saving; now both wait for the one save."""
    data = make_image_folder(tmp_path / "data", classes=3, per_class=12)
    run, saved = _train_in_its_own_group(
        tmp_path, data, "twice", "--cache", "off", "--workers", "0", "--nproc", "2",
        "--save-every-steps", "1000",
    )  # fmt: skip
    first = checkpoint.load(saved).progress["global_step"]
    time.sleep(1.5)  # inside a later epoch
    os.killpg(run.pid, signal.SIGUSR1)
    time.sleep(0.05)
    os.kill(run.pid, signal.SIGKILL)  # the launcher, not its workers
    run.output(timeout=60)
    deadline = time.monotonic() + 60  # the workers outlive the launcher while they save
    while time.monotonic() < deadline:
        if subprocess.run(["pgrep", "-f", "--", "--name twice"], capture_output=True).returncode:
            break
        time.sleep(0.2)
    after = checkpoint.load(saved).progress
    assert after.global_step > first and after.step_in_epoch > 0, (first, after)
