"""Preemption: SIGTERM or SIGUSR1 asks for a checkpoint at the next step boundary.

The handler only records the signal; the loop all-reduces the request with its other
per-step flags, so every rank stops at the same step. If a rank cannot reach a step
boundary within ``grace`` seconds (stuck in a collective, say), a watchdog ends it, so
the launcher never has to wait for it; once the step boundary is reached, saving may take
as long as it needs. A rank is often told more than once: a cluster signals every
process of the job, the launcher passes the signal on to its workers, and a launcher
that dies sends them SIGTERM (PR_SET_PDEATHSIG). Each later signal waits for the save
the first one asked for; the grace period still bounds the wait for a step boundary.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from paratrain.log import get_logger

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised after the checkpoint is written; the process exits with 128 + signal."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}; checkpoint saved")
        self.signum = signum
        self.exit_code = 128 + signum


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C (SIGINT) held until the block ends, then raised: an interrupt inside
    torch's zip writer surfaces as its RuntimeError instead, and a collective left by
    one rank midway leaves the others waiting. Main thread only, as signals are."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield  # not ours to change (ignored, or another handler installed)
        return
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during training, told with what the run kept and how to go on."""

    def __init__(self, run_dir: Path, last: Path | None):
        kept = (
            f"its last checkpoint {last} is whole: --resume {run_dir} continues from it"
            if last is not None
            else "no checkpoint was saved yet"
        )
        super().__init__(f"interrupted; {kept}")


class PreemptionGuard:
    def __init__(self, grace_s: float = 20.0):
        self.signum = 0
        self.grace_s = grace_s
        self._previous: dict[int, Any] = {}  # signal number -> the handler before
        self._watchdog: threading.Timer | None = None

    def reached_boundary(self) -> None:
        """Every rank stopped at the same step: saving may take as long as it takes."""
        if self._watchdog is not None:
            self._watchdog.cancel()

    def install(self) -> PreemptionGuard:
        """Catch SIGTERM and SIGUSR1 (main thread only: signals go there)."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Put back the handlers found at install."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> PreemptionGuard:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame) -> None:
        if self.signum:  # told again (the group's signal, then the launcher's): one save
            return
        self.signum = signum
        self._watchdog = threading.Timer(self.grace_s, os._exit, args=(128 + signum,))
        self._watchdog.daemon = True
        self._watchdog.start()


def requeue_command(environ: Mapping[str, str]) -> list[str] | None:
    """``scontrol requeue`` for this SLURM job (array tasks as ``<array job>_<task>``)."""
    array_job, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{task}" if array_job and task else environ.get("SLURM_JOB_ID")
    return ["scontrol", "requeue", job] if job else None


def requeue(environ: Mapping[str, str]) -> bool:
    """Requeue this SLURM job (--requeue); a warning, not a failure, when it cannot."""
    command = requeue_command(environ)
    log = get_logger()
    if command is None:
        log.warning("--requeue: not under SLURM (no SLURM_JOB_ID); not requeued")
        return False
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        log.warning(f"{' '.join(command)} failed: {result.stderr.strip() or result.returncode}")
        return False
    log.info(f"requeued: {' '.join(command)}")
    return True
