"""Pictures of a run: training curves and confusion matrices (matplotlib, no display)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from paratrain.report.metrics import headline

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def new_figure(**kwargs: Any) -> Figure:
    """A matplotlib Figure that is only ever saved to a file: no pyplot, whose state a
    file does not need (the list of open figures, each to be closed; a window backend
    chosen on a desktop; 0.1 s more import); savefig draws it with Agg. Freed when
    dropped."""
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def curves_figure(rows: Sequence[dict[str, Any]]) -> Figure:
    """Train and validation loss, validation top-1, learning rate per epoch."""
    epochs = [r["epoch"] for r in rows]
    fig = new_figure(figsize=(13, 3.6))
    axes = fig.subplots(1, 3)
    axes[0].plot(epochs, [r["train_loss"] for r in rows], "o-", label="train")
    axes[0].plot(epochs, [r["val_loss"] for r in rows], "o-", label="validation")
    axes[0].set_title("loss")
    axes[0].legend()
    name = headline(rows[0])[0] if rows else "top1"
    scores = [headline(r)[1] for r in rows]
    axes[1].plot(epochs, [100 * (v if v is not None else math.nan) for v in scores], "o-",
                 color="tab:green")  # fmt: skip
    if any(r.get("val_top1_ema") is not None for r in rows):
        axes[1].plot(epochs, [100 * (r.get("val_top1_ema") or 0) for r in rows], "s--", label="EMA")
        axes[1].legend()
    axes[1].set_title(f"validation {'top-1' if name == 'top1' else name} (%)")
    axes[2].plot(epochs, [r["lr"] for r in rows], "o-", color="tab:purple")
    axes[2].set_title("learning rate")
    for ax in axes:
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(_whole_epochs())  # epochs 1 and 2: no ticks at 1.5
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_curves(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """curves.png: curves_figure's picture."""
    curves_figure(rows).savefig(path, dpi=100)


def _whole_epochs():
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


def plot_confusion(matrix: np.ndarray, classes: Sequence[str], path: Path) -> None:
    """confusion_matrix.png: rows are true classes, columns predictions, shares per row."""
    shares = matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1)
    size = max(4.0, 0.45 * len(classes) + 2)
    fig = new_figure(figsize=(size, size))
    ax = fig.subplots()
    ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    ticks = range(len(classes))
    ax.set_xticks(ticks, classes, rotation=90)
    ax.set_yticks(ticks, classes)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if len(classes) <= 20:
        for i in ticks:
            for j in ticks:
                ax.text(
                    j,
                    i,
                    str(int(matrix[i, j])),
                    ha="center",
                    va="center",
                    color="white" if shares[i, j] > 0.5 else "black",
                    fontsize=8,
                )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
