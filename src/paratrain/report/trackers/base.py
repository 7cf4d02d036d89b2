"""What every experiment tracker is (the interface the run calls) and what the run knows
of each kind (its registry entry's module holds one :class:`TrackerKind` as
``TRACKER``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from paratrain.report.trackers import TRACKERS


class Tracker(Protocol):
    """One tracker of a run, on rank 0: the settings at its opening, then scalars."""

    def step(self, step: int, scalars: dict[str, float]) -> None: ...

    def epoch(self, epoch: int, step: int, scalars: dict[str, float]) -> None: ...

    def finish(self, curves: Path | None, checkpoint: Path | None) -> None: ...

    def close(self, failed: bool) -> None: ...


@dataclass(frozen=True)
class TrackerKind:
    """A kind of tracker, as the run sees it before opening one."""

    name: str
    # (run folder, the resolved settings, the tracked runs' ids: read, and filled by a
    # tracker whose runs a resumed run goes on logging into) -> the tracker
    open: Callable[[Path, dict, dict], Tracker]
    package: str | None = None  # the module it imports (checked before the launch)
    extra: str | None = None  # paratrain's extra that installs it
    # its server reached within the timeout: None, or why not (local files: no reach)
    reach: Callable[[float], str | None] | None = None
    writes: tuple[str, ...] = ()  # what it makes in the run folder before the first step


def kind(name: str) -> TrackerKind:
    """The registered tracker ``name`` (its module imported on first use)."""
    if name not in TRACKERS:
        raise KeyError(f"no tracker {name!r}; the trackers are {', '.join(TRACKERS)}")
    module = importlib.import_module(f"paratrain.report.trackers.{name}")
    found: TrackerKind = module.TRACKER
    return found


def flat(settings: dict[str, Any]) -> dict[str, str]:
    """Settings as trackers' parameters take them: strings, None as empty."""
    return {k: "" if v is None else str(v) for k, v in settings.items()}


def answers(url: str, timeout: float) -> str | None:
    """None when ``url`` answers (any HTTP status), else why not."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # it answered, if not with 200
    except (OSError, ValueError) as exc:  # URLError, refused, timed out, a bad URL
        reason = getattr(exc, "reason", None) or exc
        return f"{url} did not answer within {timeout:g} s ({reason})"
    return None
