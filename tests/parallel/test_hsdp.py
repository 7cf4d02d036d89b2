"""--strategy hsdp on two nodes of two processes: trains as ddp does, and its checkpoints
move between hsdp, fsdp and ddp, resharded on load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from imagefolders import make_image_folder
from paratrain.cli import main
from paratrain.engine.checkpointing import checkpoint
from slurmstub import sbatch
from spawn import as_the_cli_resolves, fit_on_rank, run_distributed

pytestmark = pytest.mark.slow

# a LayerNorm ViT in fp32: training is smooth enough for two orders of summing (ddp's
# all-reduce, hsdp's reduce-scatter and all-reduce) to give the same curve; a ResNet
# with BatchNorm over 4 images of 1x1 maps turns a 1e-7 difference into 1e-2 in 3 steps
TRAIN = ["--model", "timm/test_vit", "--image-size", "32", "--batch-size", "4", "--lr"]
TRAIN += ["0.001", "--workers", "0", "--cache", "off", "--precision", "32", "--deterministic"]
CONFIG = dict(model="timm/test_vit", image_size=32, batch_size=4, lr=0.001, workers=0)
CONFIG.update(cache="off", precision="32")


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["train_loss"] for row in rows]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """An hsdp run through `paratrain slurm` on 2 stub nodes x 2 processes, and the same
    job as ddp on 4 ranks of one machine."""
    root = tmp_path_factory.mktemp("hsdp")
    data = make_image_folder(root / "data", classes=3, per_class=20)
    port = 29000 + os.getpid() % 1000
    args = ["slurm", "--nodes", "2", "--procs-per-node", "2", "--port", str(port)]
    args += ["--python", sys.executable, "--data", str(data), "--strategy", "hsdp"]
    args += ["--epochs", "2", *TRAIN]
    script = root / "job.sh"
    from contextlib import redirect_stdout
    from io import StringIO

    printed = StringIO()
    with redirect_stdout(printed):
        assert main(args) == 0
    script.write_text(printed.getvalue())
    job, task_logs = sbatch(root, script)
    assert job.returncode == 0, job.stderr + task_logs
    reference = {"data": str(data), "output_dir": str(root / "runs"), "name": "ddp", "epochs": 2}
    reference = as_the_cli_resolves({**reference, **CONFIG, "deterministic": True})
    run_distributed(fit_on_rank, 4, reference)
    return root, data, root / "runs/stub-4242", root / "runs/ddp"


def test_hsdp_on_two_nodes_trains_as_ddp_does(two_nodes):
    _, _, hsdp, ddp = two_nodes
    state = checkpoint.read_for_resume(hsdp / "checkpoints/last")
    assert state.strategy == "hsdp" and state.sharded
    assert (state.layout["replicate"], state.layout["shard"]) == (2, 2)  # nodes x processes
    # the same loss curve: the same weights and gradients (fp32; sums in another order)
    assert _losses(hsdp) == pytest.approx(_losses(ddp), rel=1e-5)
    whole, reference = (
        checkpoint.load(hsdp / "checkpoints/last"),
        checkpoint.load(ddp / "checkpoints/last.pt"),
    )
    for key, value in reference.model.items():
        torch.testing.assert_close(whole.model[key], value, rtol=1e-4, atol=1e-5, msg=key)


def _resume(root: Path, data: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PARATRAIN_CACHE"] = str(root / "cache")
    return subprocess.run(
        [sys.executable, "-m", "paratrain", "train", "--data", str(data), *TRAIN, *flags],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_an_hsdp_checkpoint_reshards_into_fsdp_and_into_one_process(two_nodes):
    root, data, hsdp, _ = two_nodes
    fsdp = _resume(root, data, "--strategy", "fsdp", "--nproc", "2", "--epochs", "3",
                   "--resume", str(hsdp / "checkpoints/last"), "--name", "to-fsdp")  # fmt: skip
    assert fsdp.returncode == 0, fsdp.stderr
    assert "resumed from" in fsdp.stdout and "at epoch 3" in fsdp.stdout
    alone = _resume(root, data, "--epochs", "4", "--name", "to-ddp",
                    "--resume", str(root / "runs/to-fsdp/checkpoints/last"))  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    assert "world size 2 -> 1" in alone.stdout
    assert checkpoint.load(root / "runs/to-ddp/checkpoints/last.pt").progress["epoch"] == 4


def test_one_file_reshards_into_hsdp_on_two_nodes_and_hsdp_into_fsdp(two_nodes, tmp_path):
    root, data, _, ddp = two_nodes
    config = {"data": str(data), "output_dir": str(tmp_path), **CONFIG, "epochs": 3}
    config.update(name="from-ddp", strategy="hsdp", resume=str(ddp / "checkpoints/last.pt"))
    run_distributed(fit_on_rank, 4, config, per_node=2)  # ddp's one file -> hsdp's shards
    state = checkpoint.read_for_resume(tmp_path / "from-ddp/checkpoints/last")
    assert (state.layout["replicate"], state.layout["shard"]) == (2, 2)
    config.update(name="to-fsdp", strategy="fsdp", epochs=4)
    config["resume"] = str(tmp_path / "from-ddp/checkpoints/last")
    run_distributed(fit_on_rank, 2, config)  # hsdp's 2x2 shards -> fsdp's 2
    moved = checkpoint.load(tmp_path / "to-fsdp/checkpoints/last")
    assert moved.progress["epoch"] == 4 and moved.strategy == "fsdp"
