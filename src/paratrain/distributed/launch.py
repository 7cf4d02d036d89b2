"""Local multi-process launch through torch's own elastic launcher (torchrun).

``paratrain train --nproc N ...`` becomes ``torchrun --standalone --nproc-per-node N
-m paratrain train ...``, run in-process through ``torch.distributed.run``: a c10d
rendezvous on a free local port, and torch's agent watching the workers. When one
worker fails the agent stops the others, so no rank is left hanging.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from paratrain.distributed.env import DistEnv, detect
from paratrain.distributed.runtime import threads_per_process
from paratrain.errors import UserError

T = TypeVar("T")

# set by the launcher for its workers: what it checked need not be checked N times again
CHECKED = "PARATRAIN_CHECKED"

# Exit code of a worker whose collective failed because another rank went away: the
# launcher then reports the rank that failed first for a reason of its own.
PEER_LOST = 10

MONITOR_S = 0.5  # how often torch's launcher looks at its workers

# what torch's launcher handles while it watches its workers (TORCHELASTIC_SIGNALS_TO_HANDLE):
# its own four, and SIGUSR1, a cluster's preemption notice (srun --signal=USR1, scancel
# --signal=USR1), whose default action would end the launcher at once and leave its
# workers to a parent's death. Handled, each is passed on to the workers, which save.
LAUNCHER_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")
FORK = "PARATRAIN_FORK"  # 0: workers start as new interpreters, never forked
HANDLED = "TORCHELASTIC_SIGNALS_TO_HANDLE"  # where torch's launcher puts them, and leaves them
_PEER_SIGNS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out",
    "timed out",
    "Socket closed",
)


def is_peer_loss(exc: BaseException) -> bool:
    """A collective failed because another rank went away: a consequence, reported as such, not a cause."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistBackendError) or (
        isinstance(exc, RuntimeError) and any(sign in text for sign in _PEER_SIGNS)
    )


def root_cause(failures: dict) -> tuple[int, Any]:
    """The failure that caused the others: not a lost peer, not killed by the agent."""

    def secondary(failure) -> bool:
        return failure.exitcode in (PEER_LOST, -15)

    ranked = sorted(failures.items(), key=lambda item: (secondary(item[1]), item[1].timestamp))
    return ranked[0]


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    """Fail at once, naming the port, rather than after a rendezvous time-out."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise UserError(
                f"--master-port {port} is not available on {host}: {exc.strerror}"
            ) from None


def launch(
    nproc: int,
    argv: Sequence[str],
    max_restarts: int = 0,
    master_port: int | None = None,
    fork: Fork | None = None,
) -> int:
    """Run ``python -m paratrain <argv>`` in ``nproc`` workers; return the exit code.
    ``fork``: the workers forked from this process into its entry, where that is safe
    (``may_fork``)."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if master_port is not None:
        check_port_free(master_port)
        rendezvous = [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{master_port}",
            f"--rdzv-id=paratrain-{os.getpid()}",
        ]
    else:
        rendezvous = ["--standalone"]  # c10d on a free port chosen by the OS

    # torch's own notices of the agent's work (a fork's "Terminating process ..." too)
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logs = tempfile.mkdtemp(prefix="paratrain-launch-")  # the agent, given none, leaves one
    args = torchrun.parse_args(
        [
            *rendezvous,
            f"--log-dir={logs}",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            f"--monitor-interval={MONITOR_S}",
            f"--signals-to-handle={','.join(LAUNCHER_SIGNALS)}",
            "--module",
            "paratrain",
        ]
    )
    # Set after parsing: torchrun's own parser would read the worker's flags as its own.
    args.training_script_args = list(argv)
    try:
        with launcher_scope(threads_per_process(nproc)):
            if fork is not None and may_fork():
                fork.preload()
                _run_forked(torchrun, args, list(argv), fork.entry)
            else:
                torchrun.run(args)
    except SignalException as stopped:  # the launcher itself was told to stop
        return 128 + int(stopped.sigval)
    except ChildFailedError as failed:
        return _failed(failed, max_restarts)
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return 0


def _failed(failed: Any, max_restarts: int) -> int:
    """The launcher's exit code when its workers failed (torch's ChildFailedError), the
    failure that caused the others told where the worker did not tell it itself."""
    rank, failure = root_cause(failed.failures)
    restarts = f" (after {max_restarts} restart(s))" if max_restarts else ""
    if failure.exitcode < 0:
        print(
            f"paratrain: error: rank {rank} was killed by signal {failure.signal_name()}{restarts}",
            file=sys.stderr,
        )
        return 1
    if restarts or failure.exitcode not in (2, 3) and failure.exitcode < 128:
        print(
            f"paratrain: error: rank {rank} failed with exit code {failure.exitcode}{restarts}",
            file=sys.stderr,
        )
    return failure.exitcode or 1


def may_fork() -> bool:
    """Whether the workers may be forked from this process, as torch's launcher does for
    a function (``start_method="fork"``), rather than started as new interpreters:
    each then begins with torch, torchvision and paratrain imported (docs/benchmarks.md:
    the first step 1.3 to 1.6 s sooner on 2 cores; a worker's imports and exit not paid
    again). Only where it is safe: Linux; no CUDA device (a driver set up here would be
    unusable in a forked child: GPU workers always start afresh); and no thread pool
    made here (OpenMP's, made by this process's first parallel torch operation, would
    hang a forked child's first parallel loop): every thread here is Python's own or
    the idle BLAS server that importing numpy starts (``_idle_blas``). PARATRAIN_FORK=0
    turns it off."""
    if not sys.platform.startswith("linux") or os.environ.get(FORK, "1") == "0":
        return False
    import torch

    if torch.cuda.is_available():
        return False
    try:
        native = {int(tid) for tid in os.listdir("/proc/self/task")}
        # this thread's id asked anew: in a forked process threading keeps the forking
        # thread's (Python 3.11), and this one would pass for a thread made elsewhere
        python = {thread.native_id for thread in threading.enumerate()}
        python.add(threading.get_native_id())
        maps = Path("/proc/self/maps").read_text().splitlines()
        return all(_idle_blas(tid, maps) for tid in native - python)
    except (OSError, ValueError):
        return False


def _idle_blas(tid: int, maps: list[str]) -> bool:
    """Whether thread ``tid`` of this process waits on a futex (Linux syscall 202) that
    lies in OpenBLAS's memory (its library's mapping, or the anonymous one just after
    it, among the lines of /proc/self/maps): numpy's BLAS server, which OpenBLAS itself
    makes safe across a fork."""
    call = Path(f"/proc/self/task/{tid}/syscall").read_text().split()
    if len(call) < 2 or call[0] != "202":
        return False
    address, owner = int(call[1], 16), ""
    for line in maps:
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        named = fields[5] if len(fields) > 5 else ""
        if low <= address < high:
            return "openblas" in (named or owner).lower()
        owner = named
    return False


@dataclass(frozen=True)
class Fork:
    """How a launcher forks its workers: the entry each runs with the command's
    arguments (the command line's: cli.forked_worker), and what they all need, imported
    once here before the fork."""

    entry: Callable[[list[str]], None]
    preload: Callable[[], None]


def _run_forked(
    torchrun: Any, args: Any, argv: list[str], entry: Callable[[list[str]], None]
) -> None:
    """torchrun.run(args), its workers forked into ``entry(argv)``."""
    from torch.distributed.launcher.api import elastic_launch

    if args.standalone:  # as torchrun.run: c10d on a free port
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = f"paratrain-{os.getpid()}"
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=entry)(argv)


def as_forked_worker() -> None:
    """The start of a worker forked from its launcher, before the command runs: like
    torch's own workers, a session of its own, and the signals' default handlers (not
    the launcher's: torch's agent installs its own there)."""
    os.setsid()
    for name in LAUNCHER_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)


@contextmanager
def launcher_scope(threads: int) -> Iterator[None]:
    """While torch's launcher runs: ``OMP_NUM_THREADS`` for its workers, unless set
    (torchrun would otherwise pin each to one thread and print a notice about it). After
    it, this process as it was: its environment, and the signal handlers that the
    launcher installs for SIGTERM, SIGINT, SIGHUP, SIGQUIT and SIGUSR1 (which it is told
    to handle too: ``LAUNCHER_SIGNALS``) and leaves (a Python session
    that launched a run would otherwise answer a later Ctrl-C with the launcher's
    SignalException rather than KeyboardInterrupt)."""
    omp, handled = os.environ.get("OMP_NUM_THREADS"), os.environ.get(HANDLED)
    os.environ["OMP_NUM_THREADS"] = omp or str(threads)
    main = threading.current_thread() is threading.main_thread()  # signals are its alone
    signals = [getattr(signal, name) for name in LAUNCHER_SIGNALS if hasattr(signal, name)]
    before = {sig: signal.getsignal(sig) for sig in signals} if main else {}
    try:
        yield
    finally:
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        if handled is None:
            os.environ.pop(HANDLED, None)
        else:
            os.environ[HANDLED] = handled
        for sig, handler in before.items():
            if handler is not None:  # None: set outside Python, cannot be put back
                signal.signal(sig, handler)


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: this process is sent ``sig`` when the process that started it dies, by any
    signal (PR_SET_PDEATHSIG), so a launcher killed with SIGKILL leaves no worker
    training on, re-parented to init. SIGTERM: a worker saves at its next step and
    ends, as when a cluster preempts it. Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # not allowed here (a sandbox): the launcher's own shutdown still applies
    if parent == 1 or os.getppid() != parent:  # it died before the call took effect
        os.kill(os.getpid(), sig)


def launch_or_run(
    nproc: int,
    argv: list[str],
    work: Callable[[DistEnv], T],
    *,
    max_restarts: int = 0,
    master_port: int | None = None,
    fork: Fork | None = None,
) -> T | None:
    """``work(env)`` here when this process is the job's only one, or already one of a
    launched job's (torchrun, srun); else start ``nproc`` workers running ``paratrain
    <argv>`` through torch's elastic launcher, wait, and return None (a failed worker's
    exit code becomes this process's)."""
    env = detect(os.environ)
    if env.source != "single":  # started by a launcher: it must not outlive it
        die_with_parent()
    if nproc <= 1 or env.source != "single":
        return work(env)
    os.environ[CHECKED] = "1"
    try:
        code = launch(nproc, argv, max_restarts, master_port, fork)
    finally:
        os.environ.pop(CHECKED, None)
    if code:
        raise SystemExit(code)
    return None
