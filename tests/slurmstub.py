"""Stub SLURM commands for the suite: sbatch runs a job script at once, srun starts one
task per node on this machine (tests/distributed/test_slurm.py, tests/parallel/test_hsdp.py)."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

# Stand-ins for the SLURM commands the script calls: sbatch runs the script at once with
# the job's variables set; srun starts one task per node, here all on this machine.
STUBS = {
    "sbatch": """#!/bin/bash
nodes=$(sed -n 's/^#SBATCH --nodes=\\([0-9]*\\).*/\\1/p' "$1")
echo "Submitted batch job 4242"
SLURM_JOB_ID=4242 SLURM_JOB_NAME=stub SLURM_NNODES=$nodes SLURM_JOB_NUM_NODES=$nodes \\
SLURM_JOB_NODELIST="node[1-$nodes]" exec bash "$1"
""",
    "srun": """#!/bin/bash
while [[ "$1" == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_PROCID=$i SLURM_NODEID=$i SLURM_LOCALID=0 SLURM_NTASKS=$SLURM_NNODES \\
  SLURMD_NODENAME=node$((i + 1)) "$@" > "$STUB_LOGS/task$i.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
""",
    "scontrol": """#!/bin/bash
case "$1 $2" in
  "show hostnames") echo 127.0.0.1 ;;
  requeue*) echo "$@" >> "$STUB_LOGS/requeue" ;;
esac
""",
}


def _stub_bin(root: Path) -> Path:
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name, text in STUBS.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _env(root: Path, **extra: str) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def sbatch(
    root: Path, script: Path, timeout: float = 400
) -> tuple[subprocess.CompletedProcess, str]:
    """The job script run through the stub SLURM commands: the job, and its tasks' logs."""
    logs = root / "logs"
    logs.mkdir()
    env = _env(root, STUB_LOGS=str(logs), PATH=f"{_stub_bin(root)}:{os.environ['PATH']}")
    job = subprocess.run(
        ["sbatch", str(script)], cwd=root, env=env, capture_output=True, text=True, timeout=timeout
    )
    return job, "\n".join(p.read_text() for p in sorted(logs.glob("task*.log")))
