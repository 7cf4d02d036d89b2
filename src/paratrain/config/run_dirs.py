"""Run directories claimed atomically, so runs started together never share one.

A sweep that starts several runs in the same second, or two runs given the same
``--name``, would otherwise write their checkpoints and metrics over each other: the
check for an existing folder and its creation must be one step, ``mkdir`` without
``exist_ok``, which the file system grants to exactly one caller.
"""

from __future__ import annotations

import time
from pathlib import Path

from paratrain.errors import UserError


def claim_new_name(output_dir: Path) -> str:
    """A timestamp name whose folder this call created (the next free ``-2``, ``-3`` ...
    when another run took it first)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in (stamp, *(f"{stamp}-{i}" for i in range(2, 1000))):
        try:
            (output_dir / name).mkdir(parents=True)
            return name
        except FileExistsError:
            continue
        except OSError as exc:
            raise UserError(f"--output-dir: cannot create {output_dir / name}: {exc}") from None
    raise UserError(f"--output-dir: no free run name left for {stamp} in {output_dir}")


def already_holds_a_run(run_dir: Path) -> UserError:
    """The refusal for a run folder that is taken, naming both ways on."""
    return UserError(
        f"{run_dir} already holds a run: --resume auto continues it, another --name "
        "starts a new one"
    )


def claim_checkpoints(run_dir: Path, new_run: bool) -> None:
    """Create ``run_dir/checkpoints``. For a new run, in one step that refuses when
    another run made it first (one that exists, or one started at the same moment with
    the same name); a continued run finds it there."""
    try:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=not new_run)
    except FileExistsError:
        raise already_holds_a_run(run_dir) from None
    except OSError as exc:
        raise UserError(f"--output-dir: cannot create {run_dir}: {exc.strerror or exc}") from None
