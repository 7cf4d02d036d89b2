"""Several hosts on one machine: the sbatch script of `paratrain slurm` run through stub
SLURM commands (two torchrun agents, c10d on loopback), against a 4-process run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from imagefolders import make_image_folder
from paratrain.cli import main
from slurmstub import _env, sbatch
from zygote import kill_tree

pytestmark = pytest.mark.slow

TRAIN = ["--image-size", "16", "--batch-size", "4", "--workers", "0", "--epochs", "1"]
TRAIN += ["--deterministic", "--cache", "off"]


def test_slurm_script_runs_two_agents_that_equal_a_four_process_run(tmp_path, capsys):
    data = make_image_folder(tmp_path / "data", classes=3, per_class=20)
    port = 29000 + os.getpid() % 1000
    args = ["slurm", "--nodes", "2", "--procs-per-node", "2", "--port", str(port)]
    args += ["--python", sys.executable]
    assert main([*args, "--data", str(data), *TRAIN]) == 0
    script = tmp_path / "job.sh"
    script.write_text(capsys.readouterr().out)
    text = script.read_text()
    assert "#SBATCH --signal=B:USR1@120" in text and "--rdzv-backend=c10d" in text
    assert "--nnodes=2 --nproc-per-node=2" in text

    job, task_logs = sbatch(tmp_path, script)
    assert job.returncode == 0, job.stderr + task_logs
    run_dir = tmp_path / "runs/stub-4242"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4

    # the reference: the same job on 4 ranks of one machine (forked here: no start-up)
    from spawn import as_the_cli_resolves, fit_on_rank, run_distributed

    config = {"data": str(data), "output_dir": str(tmp_path / "runs"), "name": "single"}
    config.update(image_size=16, batch_size=4, workers=0, epochs=1, deterministic=True)
    run_distributed(fit_on_rank, 4, as_the_cli_resolves({**config, "cache": "off"}))
    two_nodes = torch.load(run_dir / "checkpoints/last.pt", weights_only=False)
    one_node = torch.load(tmp_path / "runs/single/checkpoints/last.pt", weights_only=False)
    for key, value in one_node["model"].items():
        torch.testing.assert_close(two_nodes["model"][key], value, rtol=0, atol=1e-6, msg=key)
    metrics = [
        json.loads((d / "metrics.jsonl").read_text()) for d in (run_dir, tmp_path / "runs/single")
    ]
    assert metrics[0]["val_count"] == metrics[1]["val_count"] == 12
    assert metrics[0]["val_top1"] == metrics[1]["val_top1"]
    assert metrics[0]["val_loss"] == pytest.approx(metrics[1]["val_loss"], abs=1e-6)


def test_slurm_refuses_nproc_and_bad_train_flags(capsys):
    assert main(["slurm", "--nodes", "2", "--nproc", "4"]) == 2
    assert "leave out --nproc" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["slurm", "--nodes", "2", "--epochz", "3"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --epochz 3" in capsys.readouterr().err


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Network namespaces pt_a (10.77.0.1) and pt_b (10.77.0.2) joined by a veth pair."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = f"{os.getpid() % 10000}"
    hosts = [(f"pta{tag}", f"vpa{tag}", "10.77.0.1"), (f"ptb{tag}", f"vpb{tag}", "10.77.0.2")]
    made = _ip("netns", "add", hosts[0][0])
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace: {made.stderr.strip()}")
    try:
        steps = [
            ("netns", "add", hosts[1][0]),
            ("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1]),
        ]
        for ns, dev, addr in hosts:
            steps += [
                ("link", "set", dev, "netns", ns),
                ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                ("-n", ns, "link", "set", dev, "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, f"ip {' '.join(step)}: {done.stderr}"
        yield hosts
    finally:
        for ns, _, _ in hosts:
            _ip("netns", "del", ns)


def _netns_train(tmp_path: Path, hosts, data: Path, name: str, caches=None, extra=()) -> list:
    """One torchrun agent in each network namespace, training together; ``caches``: the
    cache folder of each host (default: the shared one of _env)."""
    head = hosts[0][2]
    port = 29400 + (os.getpid() + len(name)) % 500
    procs = []
    for node, (ns, dev, addr) in enumerate(hosts):
        agent = [
            "ip",
            "netns",
            "exec",
            ns,
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            # both "hosts" have one hostname, which resolves to neither address: say
            # which agent hosts the rendezvous, and the address peers reach this one at
            f"--rdzv-conf=is_host={int(node == 0)}",
            f"--local-addr={addr}",
            f"--rdzv-endpoint={head}:{port}",
            f"--rdzv-id={name}",
            "-m",
            "paratrain",
            "train",
            "--data",
            str(data),
            "--name",
            name,
            *TRAIN,
            *extra,
        ]
        env = _env(tmp_path, GLOO_SOCKET_IFNAME=dev)  # gloo's interface in this host
        if caches is not None:
            env["PARATRAIN_CACHE"] = str(caches[node])
        procs.append(
            subprocess.Popen(
                agent,
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    return outputs


def test_one_epoch_across_two_network_namespaces(tmp_path, two_hosts):
    data = make_image_folder(tmp_path / "data", classes=3, per_class=10)
    _netns_train(tmp_path, two_hosts, data, "netns")
    summary = json.loads((tmp_path / "runs/netns/summary.json").read_text())
    assert summary["world_size"] == 2 and summary["final"]["val_count"] == 6
    # the gradients went over the veth pair: ResNet-18's are 45 MB per step
    stats = _ip("-n", two_hosts[1][0], "-s", "-j", "link", "show", two_hosts[1][1])
    received = json.loads(stats.stdout)[0]["stats64"]["rx"]["bytes"]
    assert received > 45e6, received


def test_hosts_with_a_cache_folder_each_train_like_hosts_sharing_one(tmp_path, two_hosts):
    """No shared file system for the decoded cache: each host builds its own whole cache,
    and training ends with the weights of two hosts sharing one cache folder."""
    data = make_image_folder(tmp_path / "data", classes=3, per_class=10)
    own = [tmp_path / "cache-a", tmp_path / "cache-b"]
    _netns_train(tmp_path, two_hosts, data, "own", caches=own, extra=["--cache", "on"])
    shared = [tmp_path / "cache-shared"] * 2
    _netns_train(tmp_path, two_hosts, data, "shared", caches=shared, extra=["--cache", "on"])
    for folder in own:  # each host built a whole cache of its own
        assert len(list((folder / "decoded").glob("*/manifest.json"))) == 1
    assert len(list((shared[0] / "decoded").glob("*/manifest.json"))) == 1
    a = torch.load(tmp_path / "runs/own/checkpoints/last.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "runs/shared/checkpoints/last.pt", weights_only=True)["model"]
    for key, value in a.items():
        torch.testing.assert_close(value, b[key], rtol=0, atol=0, msg=key)


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait_for(condition, procs, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        dead = [p.args[-1] for p in procs if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, f"waiting for {what}"
        time.sleep(0.2)


def _kill_node(agent: subprocess.Popen) -> None:
    """SIGKILL a torchrun agent and its workers."""
    kill_tree(agent.pid)
    agent.wait()


def test_elastic_a_node_leaves_and_the_rest_go_on(tmp_path):
    """--nnodes 1:2: a node dies; the other restarts its worker at the new world size and
    resumes from the last checkpoint. One worker per node."""
    data = make_image_folder(tmp_path / "data", classes=3, per_class=20)
    port = 29600 + os.getpid() % 300
    run_dir = tmp_path / "runs/elastic"
    train = ["--data", str(data), "--name", "elastic", "--image-size", "16", "--batch-size", "4"]
    train += ["--workers", "0", "--epochs", "3", "--cache", "off"]

    def node(is_host: int, label: str) -> subprocess.Popen:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1:2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "--rdzv-id=elastic",
            # the node that left is given up after 3 missed heartbeats of a second
            # (torch's default: of 5 s, which made this test wait 15 s for it)
            f"--rdzv-conf=is_host={is_host},last_call_timeout=3,keep_alive_interval=1,"
            "keep_alive_max_attempt=3",
            "--max-restarts=3",
            "--monitor-interval=0.5",
            "-m",
            "paratrain",
            "train",
            *train,
        ]
        log = open(tmp_path / f"{label}.log", "w")  # noqa: SIM115 - closed with the process
        return subprocess.Popen(
            command,
            cwd=tmp_path,
            env=_env(tmp_path),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    staying = node(1, "staying")  # hosts the rendezvous store
    leaving = node(0, "leaving")
    try:
        _wait_for(lambda: len(_rows(run_dir)) >= 1, [staying, leaving], "epoch 1 on two nodes")
        _kill_node(leaving)  # the node is gone, agent and worker
        assert staying.wait(timeout=180) == 0, (tmp_path / "staying.log").read_text()[-3000:]
    finally:
        for proc in (staying, leaving):
            if proc.poll() is None:
                _kill_node(proc)
    rows = _rows(run_dir)
    assert [r["epoch"] for r in rows] == [1, 2, 3]  # every epoch once
    assert [r["world_size"] for r in rows] == [2, 1, 1]
    log = (tmp_path / "staying.log").read_text()
    assert "world size 2 -> 1: global batch 8 -> 4, lr 0.005 -> 0.0025" in log
    assert "resumed from runs/elastic/checkpoints/last.pt at epoch 2" in log
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 1
