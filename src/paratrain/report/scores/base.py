"""What a score is, what it is computed from, and the registry's lookups."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paratrain.report.scores import SCORES

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Totals:
    """The exact evaluation's totals over every rank."""

    loss: float  # the mean cross-entropy (NaN when nothing was evaluated)
    top1: float | None  # the share of images right at the first guess (None: multi-label)
    top5: float | None  # within five guesses; None with fewer than 5 classes
    count: int
    confusion: torch.Tensor | None = None  # [true, predicted] counts
    # several labels an image: every image's probabilities and 0/1 labels [images,
    # classes] in the images' order, and the threshold chosen on them
    outputs: torch.Tensor | None = None
    truth: torch.Tensor | None = None
    threshold: float | None = None


@dataclass(frozen=True)
class Score:
    name: str
    compute: Callable[[Totals], float | None]  # None: undefined for these totals
    higher_is_better: bool = True
    label: str = ""  # how `paratrain eval` names it (its name if empty)
    share: bool = True  # a share of the images, shown as a percentage


def shown(name: str, value: float) -> str:
    """A score as `paratrain eval`'s line shows it ("macro-F1 70.83%", "loss 0.5000")."""
    found = score(name)
    figure = f"{value:.2%}" if found.share else f"{value:.4f}"
    return f"{found.label or name} {figure}"


def score(name: str) -> Score:
    """The registered score ``name`` (its family's module imported on first use)."""
    if name not in SCORES:
        raise KeyError(f"no score {name!r}; the scores are {', '.join(SCORES)}")
    family = importlib.import_module(f"paratrain.report.scores.{SCORES[name][0]}")
    found: Score = family.SCORES[name]
    return found


def compute_all(totals: Totals) -> dict[str, float | None]:
    """Every registered score of ``totals``, by name (NaN where nothing was evaluated)."""
    return {name: score(name).compute(totals) for name in SCORES}


def ranking(name: str, value: float | None) -> float:
    """``value`` of score ``name`` as higher-is-better (for --monitor; -inf if undefined)."""
    if value is None or math.isnan(value):
        return float("-inf")
    return float(value) if score(name).higher_is_better else -float(value)
