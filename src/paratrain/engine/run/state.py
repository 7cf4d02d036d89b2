"""Where training stands (Progress) and the random-number states a checkpoint keeps.

Everything here is saved as plain Python values and tensors, so a checkpoint loads with
``torch.load(weights_only=True)``: no pickled objects, nothing that runs code.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from paratrain.distributed import comm


@dataclass
class Progress:
    """Where training stands: enough to resume in the middle of an epoch."""

    epoch: int = 0  # the epoch being trained (0-based)
    step_in_epoch: int = 0  # optimizer steps done in it
    consumed: int = 0  # samples of the epoch's global order trained on (all replicas)
    global_step: int = 0
    skipped_steps: int = 0
    best_top1: float = -1.0
    seconds: float = 0.0  # wall-clock the run had spent when this was saved (--budget)
    # this process's (loss x n, correct, n) over the epoch so far, where the loss is
    totals: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))

    def start_epoch(self, epoch: int) -> None:
        """A new epoch: nothing of it consumed, its sums at zero."""
        self.epoch, self.step_in_epoch, self.consumed = epoch, 0, 0
        self.totals = torch.zeros(3, dtype=torch.float64, device=self.totals.device)

    def state_dict(self) -> dict[str, Any]:
        """Plain values and a CPU tensor (torch.distributed.checkpoint's Stateful)."""
        return {
            "epoch": self.epoch,
            "step_in_epoch": self.step_in_epoch,
            "consumed": self.consumed,
            "global_step": self.global_step,
            "skipped_steps": self.skipped_steps,
            "best_top1": self.best_top1,
            "seconds": self.seconds,
            "totals": self.totals.detach().cpu().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Where a checkpoint left training (the sums where the checkpoint has them)."""
        self.epoch = int(state.get("epoch", 0))
        self.step_in_epoch = int(state.get("step_in_epoch", 0))
        self.consumed = int(state.get("consumed", 0))
        self.global_step = int(state.get("global_step", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.best_top1 = float(state.get("best_top1", -1.0))
        self.seconds = float(state.get("seconds", 0.0))
        totals = state.get("totals")
        if isinstance(totals, torch.Tensor):
            self.totals = totals.to(torch.float64).clone()

    @classmethod
    def of(cls, state: dict[str, Any]) -> Progress:
        progress = cls()
        progress.load_state_dict(state)
        return progress


def rng_state() -> dict[str, Any]:
    """This process's generators, as plain values and tensors."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)  # the legacy form: (name, keys, pos, gauss, cached)
    return {
        "python": {"version": version, "state": list(mt), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Put this process's generators back as ``rng_state`` found them."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][: torch.cuda.device_count()])


def gathered_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG state, in rank order (a collective: all ranks call it)."""
    return comm.all_gather_object(rng_state())


def restore_rng(saved: list[dict[str, Any]] | None, rank: int) -> None:
    """Each rank gets its own saved state back; with another world size, rank 0's."""
    if saved:
        set_rng_state(saved[rank] if rank < len(saved) else saved[0])
