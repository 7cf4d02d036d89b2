"""`paratrain slurm`: print an sbatch script that runs a training job on N nodes.

The script follows the usual shape: one srun task per node, each a torchrun agent; the
agents meet in a c10d rendezvous hosted on the allocation's first node; torchrun starts
one worker per device. SLURM sends USR1 to the batch shell two minutes before the time
limit; the shell passes it on as SIGTERM, paratrain saves a checkpoint at the next step
boundary and (with --requeue) requeues the job, which resumes from it.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from paratrain.config import SlurmOptions
from paratrain.errors import UserError

SIGNAL_SECONDS = 120  # USR1 this long before the time limit: time to save and requeue


def _sbatch_header(job: SlurmOptions) -> list[str]:
    """The #SBATCH lines: one torchrun agent per node, the resources asked, and a signal
    before the time limit so that the run saves and requeues."""
    header = [
        f"#SBATCH --job-name={job.job_name}",
        f"#SBATCH --nodes={job.nodes}",
        "#SBATCH --ntasks-per-node=1  # one torchrun agent per node",
    ]
    if job.gpus_per_node:
        header.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    if job.cpus_per_task:
        header.append(f"#SBATCH --cpus-per-task={job.cpus_per_task}")
    for key, value in (("time", job.time), ("partition", job.partition), ("account", job.account)):
        if value:
            header.append(f"#SBATCH --{key}={value}")
    header += [
        f"#SBATCH --signal=B:USR1@{SIGNAL_SECONDS}  # to this shell, before the time limit",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=%x-%j.out",
    ]
    return header


def sbatch_script(job: SlurmOptions, train_args: Sequence[str]) -> str:
    """The batch script; ``train_args`` are passed to ``paratrain train`` unchanged."""
    job.validate()
    if any(a == "--nproc" or a.startswith("--nproc=") for a in train_args):
        raise UserError("paratrain slurm: leave out --nproc; --nodes and --gpus-per-node set it")
    header = _sbatch_header(job)
    args = list(train_args)
    for flag, extra in (
        ("--requeue", []),
        ("--resume", ["auto"]),
        ("--name", ["${SLURM_JOB_NAME}-${SLURM_JOB_ID}"]),
    ):
        if flag not in args and not any(a.startswith(flag + "=") for a in args):
            args += [flag, *extra]
    train = " ".join(_quote(a) for a in args)
    return "\n".join(
        [
            "#!/bin/bash",
            *header,
            "",
            "set -uo pipefail",
            "# The first node of the allocation hosts torchrun's c10d rendezvous.",
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"rdzv_port=${{PARATRAIN_RDZV_PORT:-{job.port}}}",
            "",
            "# USR1 (time limit near, or preemption) goes on to every task as SIGTERM: paratrain",
            "# saves at the next step boundary and, with --requeue, requeues the job.",
            'forward() { kill -TERM "$srun_pid" 2>/dev/null; }',
            "trap forward USR1",
            "",
            "srun --kill-on-bad-exit=1 \\",
            f"    {job.python} -m torch.distributed.run \\",
            f"    --nnodes={job.nodes} --nproc-per-node={job.per_node} \\",
            '    --rdzv-backend=c10d --rdzv-endpoint="$head_node:$rdzv_port" '
            '--rdzv-id="$SLURM_JOB_ID" \\',
            f"    --max-restarts={job.max_restarts} \\",
            f"    -m paratrain train {train} &",
            "srun_pid=$!",
            "# wait returns early when a trapped signal arrives; wait again for the real end",
            'while wait "$srun_pid"; status=$?; kill -0 "$srun_pid" 2>/dev/null; do :; done',
            'exit "$status"',
            "",
        ]
    )


def _quote(arg: str) -> str:
    """Quote for the shell, but leave ${SLURM_...} references to be expanded there."""
    if "${SLURM_" in arg:
        return f'"{arg}"'
    return shlex.quote(arg)
