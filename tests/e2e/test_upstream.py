"""Upstream limitations paratrain documents, pinned by plain-torch reproductions: the day
torch fixes one, its test passes, strict xfail turns the suite red, and the README's
limitation can be lifted."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.slow

WORKER = textwrap.dedent(
    """
    import os, time
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    with open(os.path.join(os.environ["MARKS"], f"{attempt}-{dist.get_rank()}"), "w") as f:
        f.write(str(world))
    for _ in range(60 if world == 1 else 3):  # alone: long enough for a second node to join
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(0.25)
    dist.destroy_process_group()
    """
)


def _agent(script, port: int, marks, host: bool) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=join",
        f"--rdzv-conf=is_host={int(host)},join_timeout=30,last_call_timeout=2,read_timeout=15",
        "--max-restarts=3", "--monitor-interval=0.5", str(script),
    ]  # fmt: skip
    env = {**os.environ, "MARKS": str(marks), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip


@pytest.mark.xfail(
    strict=True,
    reason="torch 2.14.1: a node joining a running elastic job (--nnodes 1:2, c10d "
    "rendezvous) makes the agents restart, then both wait on the rendezvous store "
    "(role_info, MASTER_ADDR) until they time out; upstream: pytorch/pytorch#123678 (scale-up "
    "with the c10d backend), pytorch/pytorch#147064 (open). paratrain's README says to start "
    "the job again instead",
)
def test_a_node_joining_a_running_elastic_job_trains_with_it(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    marks = tmp_path / "marks"
    marks.mkdir()
    port = 29700 + os.getpid() % 200
    first = _agent(script, port, marks, host=True)
    deadline = time.monotonic() + 60
    while not (marks / "0-0").exists():  # the first node trains alone
        assert first.poll() is None and time.monotonic() < deadline, "the first agent stopped"
        time.sleep(0.2)
    second = _agent(script, port, marks, host=False)
    try:
        outputs = [p.communicate(timeout=120)[0] for p in (first, second)]
    except subprocess.TimeoutExpired:
        for p in (first, second):
            p.kill()
        outputs = [p.communicate()[0] for p in (first, second)]
    worlds = {f.name: f.read_text() for f in marks.iterdir()}
    assert [first.returncode, second.returncode] == [0, 0], "\n".join(outputs)[-3000:]
    assert "2" in worlds.values(), worlds  # the workers ran again, together
