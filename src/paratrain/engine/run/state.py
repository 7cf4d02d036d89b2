"""The checkpoint's parts that say where training stands: Progress, the best score so far
(Best) and every rank's random-number states (RngStates); each saves and loads itself
(torch.distributed.checkpoint's ``Stateful``: ``state_dict`` / ``load_state_dict``).

Everything here is saved as plain Python values and tensors, so a checkpoint loads with
``torch.load(weights_only=True)``: no pickled objects, nothing that runs code.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from paratrain.distributed import comm
from paratrain.log import get_logger, since_start


@dataclass
class Progress:
    """Where training stands: enough to resume in the middle of an epoch."""

    epoch: int = 0  # the epoch being trained (0-based)
    step_in_epoch: int = 0  # optimizer steps done in it
    consumed: int = 0  # samples of the epoch's global order trained on (all replicas)
    global_step: int = 0
    skipped_steps: int = 0
    seconds: float = 0.0  # wall-clock earlier runs of this one spent (--budget), as loaded
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
            "seconds": self.seconds + since_start(),  # with this command's, so far
            "totals": self.totals.detach().cpu().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Where a checkpoint left training (the sums where the checkpoint has them)."""
        self.epoch = int(state.get("epoch", 0))
        self.step_in_epoch = int(state.get("step_in_epoch", 0))
        self.consumed = int(state.get("consumed", 0))
        self.global_step = int(state.get("global_step", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.seconds = float(state.get("seconds", 0.0))
        totals = state.get("totals")
        if isinstance(totals, torch.Tensor):
            self.totals = totals.to(torch.float64).clone()

    @classmethod
    def of(cls, state: dict[str, Any]) -> Progress:
        progress = cls()
        progress.load_state_dict(state)
        return progress

    def continue_under(self, saved_step: int, step: int, keeps_totals: bool) -> None:
        """A resumed epoch under another global batch (``saved_step`` samples a step
        then, ``step`` now) goes on from the same sample of its order: nothing skipped or
        repeated. The epoch's sums so far stay with one rank alone (``keeps_totals``:
        rank 0, where the global batch is unchanged)."""
        if saved_step != step:
            self.step_in_epoch = self.consumed // step
        if not (saved_step == step and keeps_totals):
            self.totals = torch.zeros(3, dtype=torch.float64)


@dataclass
class Best:
    """The best --monitor score so far and the monitor's name: what picks best.pt."""

    monitor: str
    score: float = -math.inf

    def offer(self, score: float) -> bool:
        """Whether ``score`` is the best so far (a tie: the newer is kept)."""
        better = score >= self.score
        self.score = max(self.score, score)
        return better

    def state_dict(self) -> dict[str, Any]:
        return {"score": self.score, "monitor": self.monitor}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The checkpoint's best, where it was scored by this monitor; under another, it
        is set aside (said), and the next evaluation's score makes best.pt."""
        if not state or state.get("score") is None:
            return
        if state.get("monitor", "top1") == self.monitor:
            self.score = float(state["score"])
            return
        get_logger().info(
            f"--monitor {self.monitor}, the checkpoint's best was by {state.get('monitor')} "
            f"({float(state['score']):.4g}): set aside; best.pt is next written by "
            f"{self.monitor} from the next evaluation on"
        )


class RngStates:
    """Every rank's random-number generators (Python, numpy, torch, CUDA)."""

    def __init__(self, rank: int):
        self.rank = rank

    def state_dict(self) -> list[dict[str, Any]]:
        return gathered_rng_states()  # a collective: every rank saves

    def load_state_dict(self, state: list[dict[str, Any]] | None) -> None:
        restore_rng(state, self.rank)


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
