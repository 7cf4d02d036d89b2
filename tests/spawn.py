"""The one spawn helper for multi-process tests: N gloo processes that meet through a file.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in every
process with the process group initialised (through a file store: no port is taken),
and returns the per-rank results. A failure in any rank fails the call with every
failed rank's traceback (RanksFailed); the group is always destroyed.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank, world_size, port, fn, args, out_dir, per_node):
    per_node = per_node or world_size  # ranks as nodes of per_node processes each
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node),
    )
    torch.set_num_threads(1)
    # the group meets through a file, not a port: a port picked free here could be taken,
    # before rank 0 binds it, by a launcher of another test running beside this one
    dist.init_process_group(
        "gloo",
        init_method=f"file://{Path(out_dir) / 'store'}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    # every rank's mesh whole before any goes on: a rank whose fn needs no communication
    # could otherwise end, and close its side, while another still handshakes (seen once:
    # gloo's connectFullMesh failing on rank 0, "Connection closed by peer")
    dist.barrier()
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"{rank}.pt")
    except BaseException:  # every rank's own error kept: which reaches the parent first is a race
        (Path(out_dir) / f"{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


class RanksFailed(Exception):
    """Some rank of ``run_distributed`` failed: every failed rank's traceback, in rank order."""


def run_distributed(fn, world_size: int, *args, per_node: int | None = None):
    """``per_node``: the ranks pose as nodes of that many processes each (LOCAL_RANK,
    LOCAL_WORLD_SIZE and GROUP_RANK as torchrun sets them on several machines)."""
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(world_size, free_port(), fn, args, out_dir, per_node),
            nprocs=world_size,
            join=False,
            # fork: children share the parent's imported torch (seconds saved per
            # rank); each child sets one intra-op thread before any parallel work.
            start_method="fork",
        )
        _wait_all(context.processes)
        failed = [r for r, p in enumerate(context.processes) if p.exitcode != 0]
        if failed:
            told = [
                f"rank {r}: {(Path(out_dir) / f'{r}.err').read_text()}"
                if (Path(out_dir) / f"{r}.err").is_file()
                else f"rank {r}: exited with {context.processes[r].exitcode}"
                for r in failed
            ]
            raise RanksFailed("\n".join(told))
        return [
            torch.load(Path(out_dir) / f"{r}.pt", weights_only=False) for r in range(world_size)
        ]


def _wait_all(processes, grace: float = 30.0) -> None:
    """Every rank ended. A rank that fails leaves the others to end as they would in a
    job (their collectives with it fail; they finish what they were writing), as torchrun
    does within its own grace period; those still running ``grace`` seconds after the
    first failure are stopped."""
    failed_at = None
    while alive := [p for p in processes if p.is_alive()]:  # once: a rank may end between
        if failed_at is None and any(p.exitcode not in (None, 0) for p in processes):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for p in processes:
                p.kill()
        alive[0].join(0.1)


def in_single_process(fn, *args):
    """Run ``fn(0, 1, *args)`` here, without a process group (the 1-process reference)."""
    return fn(0, 1, *args)


def as_the_cli_resolves(values: dict) -> dict:
    """``values`` with the presets the command line would fill in (fit_on_rank builds
    TrainConfig as given: a reference for a command's run needs the same settings)."""
    from paratrain.config import resolve_train

    return resolve_train(values).to_dict()


def fit_on_rank(rank, world_size, values: dict) -> dict:
    """paratrain's training loop on this rank of the group: returns its run summary."""
    from paratrain.config import TrainConfig
    from paratrain.distributed.env import detect
    from paratrain.distributed.runtime import Runtime
    from paratrain.engine.trainer import fit

    runtime = Runtime(env=detect(os.environ), device=torch.device("cpu"), backend="gloo")
    return fit(TrainConfig(**values), runtime)
