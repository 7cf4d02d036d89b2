"""Process group lifetime, backend and device choice, per-process threads and seeding."""

from __future__ import annotations

import datetime
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from paratrain.distributed.env import DistEnv
from paratrain.errors import UserError


@dataclass(frozen=True)
class Runtime:
    env: DistEnv
    device: torch.device
    backend: str | None  # None when no process group is needed

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.env.rank

    @property
    def world_size(self) -> int:
        """The number of processes in the job."""
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that speaks and writes."""
        return self.env.is_main


def runs_on_cuda(requested: str | None) -> bool:
    """Whether a run given ``--device requested`` (None: the default) uses CUDA."""
    return torch.cuda.is_available() and not (requested or "").startswith("cpu")


def choose_device(env: DistEnv, requested: str | None = None) -> torch.device:
    """cuda:LOCAL_RANK where CUDA is present (or asked for), else cpu."""
    if requested is not None:
        if requested.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"--device {requested}: CUDA is not available on this machine")
        if requested == "cuda":
            return torch.device("cuda", env.local_rank % torch.cuda.device_count())
        try:
            device = torch.device(requested)
        except RuntimeError:
            raise UserError(f"--device: not a device name: {requested!r}") from None
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise UserError(
                f"--device {requested}: this machine has {torch.cuda.device_count()} GPU(s) "
                f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})"
            )
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def choose_backend(device: torch.device, requested: str | None = None) -> str:
    """nccl on CUDA, gloo on CPU, unless asked (nccl on a CPU is refused in one line)."""
    if requested == "nccl" and device.type != "cuda":
        raise UserError("--backend nccl needs CUDA devices; use gloo on CPU")
    if requested is not None:
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity, else the machine's)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return cores or 1


def threads_per_process(local_world_size: int) -> int:
    """Share this machine's cores among the processes started on it."""
    return max(1, usable_cores() // max(local_world_size, 1))


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX): where bf16 autocast is faster than fp32."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.is_file() else ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def resolve_precision(requested: str, device: torch.device, cpuinfo: str | None = None) -> str:
    """The precision to train in: the requested one, or auto's choice for this device:
    bf16 autocast where the device computes bf16 natively — CUDA devices that support
    it, CPUs with AVX512-BF16 or AMX (read from /proc/cpuinfo) — and fp32 elsewhere,
    where emulated bf16 would be slower than fp32."""
    if requested == "16-mixed" and device.type != "cuda":
        raise UserError(
            "--precision 16-mixed needs CUDA (float16 with a GradScaler); "
            "on CPU use bf16-mixed or 32"
        )
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "32"
    return "bf16-mixed" if cpu_has_native_bf16(cpuinfo) else "32"


@contextmanager
def distributed(
    env: DistEnv,
    device: str | None = None,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> Iterator[Runtime]:
    """Initialise the process group for this worker and always tear it down."""
    dev = choose_device(env, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if os.environ.get("PARATRAIN_THREADS"):  # set by `paratrain scale` for its runs
        torch.set_num_threads(int(os.environ["PARATRAIN_THREADS"]))
    elif "OMP_NUM_THREADS" not in os.environ or env.source == "torchrun":
        torch.set_num_threads(threads_per_process(env.local_world_size))
    if not env.distributed:
        yield Runtime(env=env, device=dev, backend=None)
        return
    chosen = choose_backend(dev, backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=chosen,
        store=_store(env, timeout),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=dev if dev.type == "cuda" else None,
    )
    try:
        yield Runtime(env=env, device=dev, backend=chosen)
    except BaseException:
        # A launched worker that fails exits right after reporting. Closing the group
        # first would let peers report a lost connection before this rank reports the
        # cause; the sockets close with the process instead.
        if env.source == "single" or not os.environ.get("TORCHELASTIC_RUN_ID"):
            dist.destroy_process_group()
        raise
    dist.destroy_process_group()


def _store(env: DistEnv, timeout: datetime.timedelta) -> dist.Store:
    """torch's own env:// (torchrun) or tcp:// (SLURM) rendezvous store, with a prefix per
    restart attempt: torchrun's agent keeps one store across restarts, and without the
    prefix a restarted worker can read the previous attempt's peer addresses."""
    from torch.distributed.rendezvous import rendezvous

    if env.source == "slurm":
        url = f"tcp://{_host_for_url(env.master_addr)}:{env.master_port}"
    else:
        url = "env://"
    store, _, _ = next(rendezvous(url, rank=env.rank, world_size=env.world_size, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"paratrain/attempt_{attempt}/", store)


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) with the same value."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
