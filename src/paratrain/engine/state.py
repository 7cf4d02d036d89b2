"""What a checkpoint holds beyond the model: RNG states, and the full training state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from paratrain.dist import comm


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gathered_rng_states() -> list[dict[str, Any]]:
    """Every rank's RNG state, in rank order (a collective: all ranks call it)."""
    return comm.all_gather_object(rng_state())


def restore_rng(saved: list[dict[str, Any]] | None, rank: int) -> None:
    """Each rank gets its own saved state back; with another world size, rank 0's."""
    if saved:
        set_rng_state(saved[rank] if rank < len(saved) else saved[0])
