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

# what torch's launcher handles while it watches its workers (TORCHELASTIC_SIGNALS_TO_HANDLE):
# its own four, and SIGUSR1, a cluster's preemption notice (srun --signal=USR1, scancel
# --signal=USR1), whose default action would end the launcher at once and leave its
# workers to a parent's death. Handled, each is passed on to the workers, which save.
LAUNCHER_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")
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
    nproc: int, argv: Sequence[str], max_restarts: int = 0, master_port: int | None = None
) -> int:
    """Run ``python -m paratrain <argv>`` in ``nproc`` workers; return the exit code."""
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

    for name in ("torch.distributed.elastic", "torch.distributed.run"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    logs = tempfile.mkdtemp(prefix="paratrain-launch-")  # the agent, given none, leaves one
    args = torchrun.parse_args(
        [
            *rendezvous,
            f"--log-dir={logs}",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.5",
            f"--signals-to-handle={','.join(LAUNCHER_SIGNALS)}",
            "--module",
            "paratrain",
        ]
    )
    # Set after parsing: torchrun's own parser would read the worker's flags as its own.
    args.training_script_args = list(argv)
    try:
        with launcher_scope(threads_per_process(nproc)):
            torchrun.run(args)
    except SignalException as stopped:  # the launcher itself was told to stop
        return 128 + int(stopped.sigval)
    except ChildFailedError as failed:
        rank, failure = root_cause(failed.failures)
        restarts = f" (after {max_restarts} restart(s))" if max_restarts else ""
        if failure.exitcode < 0:
            print(
                f"paratrain: error: rank {rank} was killed by signal {failure.signal_name()}"
                f"{restarts}",
                file=sys.stderr,
            )
            return 1
        if restarts or failure.exitcode not in (2, 3) and failure.exitcode < 128:
            print(
                f"paratrain: error: rank {rank} failed with exit code {failure.exitcode}{restarts}",
                file=sys.stderr,
            )
        return failure.exitcode or 1
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    return 0


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
        code = launch(nproc, argv, max_restarts=max_restarts, master_port=master_port)
    finally:
        os.environ.pop(CHECKED, None)
    if code:
        raise SystemExit(code)
    return None
