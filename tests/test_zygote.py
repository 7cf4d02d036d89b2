"""The tests' forked runs of the command (zygote.py) are the command as a new interpreter
runs it: the same words and exit code, found by their flags, killed whole at a timeout
(their stacks printed first)."""

from __future__ import annotations

import threading
import time

import pytest

import zygote
from trainruns import FAST, env_for, leftover, small_data


def test_a_forked_command_says_and_ends_as_a_new_interpreter_does(tmp_path, monkeypatch):
    """A relative path read from the caller's folder, the caller's environment, the
    same lines and exit code (a bad flag, a missing folder, the version)."""
    (tmp_path / "here").mkdir()
    told = {}
    for fresh in ("0", "1"):
        monkeypatch.setenv(zygote.FRESH, fresh)
        told[fresh] = [
            zygote.command(args, tmp_path / "here", env_for(tmp_path), 120)
            for args in (["train", "--data", "nope"], ["train", "--epochs", "x"], ["--version"])
        ]
    for forked, new in zip(told["0"], told["1"], strict=True):
        assert forked[1] is new[1] is False
        got, want = forked[0], new[0]
        assert (got.returncode, got.stdout, got.stderr) == (
            want.returncode,
            want.stdout,
            want.stderr,
        )
    missing = told["0"][0][0]
    assert missing.returncode == 2 and "--data directory does not exist: nope" in missing.stderr


@pytest.mark.slow
def test_a_forked_run_is_found_by_its_flags_and_killed_with_its_workers_at_its_timeout(tmp_path):
    """Killed whole at its timeout, having printed every process's stacks first."""
    root, folder = small_data(tmp_path)
    args = ["train", "--data", str(folder), "--nproc", "2", "--epochs", "500", "--name", "long",
            *FAST]  # fmt: skip
    seen: list[list[str]] = []

    def watch() -> None:
        for _ in range(200):
            time.sleep(0.1)
            if len(found := leftover("--name long")) >= 3:  # the launcher and its 2 workers
                seen.append(found)
                return

    watcher = threading.Thread(target=watch)
    watcher.start()
    out, timed_out = zygote.command(args, root, env_for(root), timeout=15)
    watcher.join()
    assert timed_out and out.returncode != 0
    assert seen and all("-m paratrain train --data" in line for line in seen[0]), seen
    assert "global batch" in out.stdout  # what it said before it was killed, kept
    assert leftover("--name long") == []
    # before the kill, each of the three told where its threads stood (faulthandler)
    assert out.stderr.count("Current thread 0x") >= 3, out.stderr[-3000:]
    assert "paratrain/engine/" in out.stderr, out.stderr[-3000:]
