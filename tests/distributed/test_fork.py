"""Workers forked from the launcher (distributed/launch.may_fork): only from a process
where that is safe, and they train as workers started afresh do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainruns import assert_bitwise_equal, env_for, job, last_weights, run, small_data


def _in_a_fresh_process(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "PARATRAIN_FORK"}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**environ, **env},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1]


def test_a_process_that_only_imported_torch_may_fork_and_one_with_a_thread_pool_may_not():
    """After importing torch (and numpy's BLAS server with it) a fork is safe, unless a
    CUDA device is there; after a parallel torch operation (OpenMP's pool made: a
    forked child would hang in its first parallel loop) it is not; PARATRAIN_FORK=0
    turns it off."""
    probe = """
        import numpy, torch
        from paratrain.distributed.launch import may_fork
        before = may_fork()
        torch.set_num_threads(2)
        x = torch.randn(1000, 1000)
        (x @ x).sum()
        print(f"{before},{may_fork()},{torch.cuda.is_available()}")
    """
    before, after, cuda = _in_a_fresh_process(probe).split(",")
    assert (before, after) == (str(cuda == "False"), "False")
    assert _in_a_fresh_process(probe, PARATRAIN_FORK="0").startswith("False,False,")


def test_a_process_forked_from_one_that_may_fork_may_fork_too():
    """A forked process (a program's multiprocessing worker launching a run) has its
    own thread id, which Python's threading keeps as the forking thread's: asked only
    of threading, that thread passed for one made outside Python, and forking was
    refused."""
    probe = """
        import os, torch
        from paratrain.distributed.launch import may_fork
        read, write = os.pipe()
        if os.fork() == 0:
            os.write(write, str(may_fork()).encode())
            os._exit(0)
        os.wait()
        print(f"{may_fork()},{os.read(read, 16).decode()},{torch.cuda.is_available()}")
    """
    here, child, cuda = _in_a_fresh_process(probe).split(",")
    assert here == child == str(cuda == "False")


@pytest.mark.slow
def test_forked_workers_train_bit_for_bit_as_workers_started_afresh(tmp_path):
    """The same two-process job, its workers forked (the launcher's fork path taken, as a
    spy on it records) and started as new interpreters (PARATRAIN_FORK=0): the same
    weights to the bit."""
    root, folder = small_data(tmp_path)
    fresh, _ = run(root, *job(folder, "fresh", "--deterministic"), PARATRAIN_FORK="0")
    assert fresh.returncode == 0, fresh.stderr
    spy = f"""
        import sys
        import paratrain.distributed.launch as launch
        from paratrain.cli import run
        forked = launch._run_forked

        def taken(*args):
            print("forked", flush=True)
            return forked(*args)

        launch._run_forked = taken
        sys.argv = ["paratrain", "train", *{job(folder, "forked", "--deterministic")!r}]
        run()
    """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(spy)],
        capture_output=True,
        text=True,
        cwd=root,
        env=_env(root),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert "forked" in done.stdout.splitlines(), done.stdout[-2000:]
    assert_bitwise_equal(last_weights(root, "forked"), last_weights(root, "fresh"))


def _env(root: Path) -> dict[str, str]:
    return {k: v for k, v in env_for(root).items() if k != "PARATRAIN_FORK"}


def test_a_forked_worker_that_returns_ends_the_loader_workers_it_still_has():
    """A forked worker's command returns with a daemonic child still running that
    ignores SIGTERM, as a loader worker does whose loader a reference cycle keeps:
    multiprocessing's exit would terminate it with SIGTERM and then wait on it for ever
    (a two-process run on a CSV listing hung so after its last line). The worker ends,
    with its command's code, and so does the child."""
    probe = """
        import multiprocessing, os, signal, time
        from paratrain import cli

        def loader_worker(ready):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            ready.set()
            time.sleep(300)

        left, pid = [], multiprocessing.get_context("fork").Value("i", 0)

        def command(argv=None):
            fork = multiprocessing.get_context("fork")
            ready = fork.Event()
            child = fork.Process(target=loader_worker, args=(ready,), daemon=True)
            child.start()
            ready.wait(30)  # ignoring SIGTERM before the command returns
            left.append(child)
            pid.value = child.pid
            return 0

        cli.main = command
        worker = multiprocessing.get_context("fork").Process(target=cli.forked_worker, args=([],))
        worker.start()
        worker.join(timeout=30)
        hung = worker.is_alive()
        os.killpg(worker.pid, signal.SIGKILL) if hung else None  # its session: it and the child
        worker.join()
        child = pid.value
        time.sleep(0.2)
        try:
            os.kill(child, 0)
            child_alive = open(f"/proc/{child}/stat").read().split()[2] != "Z"
        except ProcessLookupError:
            child_alive = False
        print(f"hung={hung},code={worker.exitcode},child_alive={child_alive}")
    """
    assert _in_a_fresh_process(probe) == "hung=False,code=0,child_alive=False"
