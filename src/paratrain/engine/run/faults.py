"""Failure injection for tests: make one rank fail at a chosen step.

``PARATRAIN_INJECT="rank=1,step=3,kind=raise"`` (kinds: raise, kill, nan, hang, and
disk_full: the checkpoint written after that step fails as on a full disk), and
optionally ``attempt=0`` to fire only in the first attempt of a restarted job
(torchrun's TORCHELASTIC_RESTART_COUNT). Unset, this costs one dictionary look-up.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

ENV = "PARATRAIN_INJECT"


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    kind: str
    attempt: int | None = None


class InjectedFailure(RuntimeError):
    pass


def planned(rank: int) -> Fault | None:
    """The fault planned for this rank (and this restart attempt), or None."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    fields = dict(part.split("=", 1) for part in spec.split(",") if "=" in part)
    fault = Fault(
        rank=int(fields.get("rank", 0)),
        step=int(fields.get("step", 1)),
        kind=fields.get("kind", "raise"),
        attempt=int(fields["attempt"]) if "attempt" in fields else None,
    )
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if fault.rank != rank or (fault.attempt is not None and fault.attempt != attempt):
        return None
    return fault


def fire(fault: Fault | None, step: int) -> bool:
    """Called once per step; True when the loss of this step must be made non-finite."""
    if fault is None or fault.step != step:
        return False
    if fault.kind == "raise":
        raise InjectedFailure(f"injected failure at step {step}")
    if fault.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "hang":
        while True:
            time.sleep(1)
    return fault.kind == "nan"


def disk_full(fault: Fault | None, step: int, path: object) -> None:
    """A checkpoint write after ``step`` fails as on a full disk, where one is planned."""
    if fault is not None and fault.kind == "disk_full" and fault.step == step:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
