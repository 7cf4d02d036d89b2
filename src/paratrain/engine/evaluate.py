"""Exact distributed evaluation.

Every rank evaluates its own unpadded shard; per-sample losses and correct counts are
gathered and summed, never averaged, so the result is the same at every world size:
1,001 images on 3 ranks count 1,001, not 1,002.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from paratrain.dist import comm


@dataclass(frozen=True)
class EvalResult:
    loss: float
    top1: float
    top5: float | None  # only with at least 5 classes
    count: int

    def as_dict(self) -> dict:
        return {"loss": self.loss, "top1": self.top1, "top5": self.top5, "count": self.count}


def logits_of(output) -> torch.Tensor:
    """Models such as GoogLeNet return a named tuple in training mode."""
    return output.logits if hasattr(output, "logits") else output


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: DataLoader, device: torch.device, num_classes: int
) -> EvalResult:
    was_training = model.training
    model.eval()
    k = 5 if num_classes >= 5 else None
    losses: list[torch.Tensor] = []
    correct1 = torch.zeros((), dtype=torch.int64)
    correct5 = torch.zeros((), dtype=torch.int64)
    for images, labels in loader:
        images = images.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        logits = logits_of(model(images)).float()
        losses.append(nn.functional.cross_entropy(logits, labels, reduction="none").double().cpu())
        top = logits.topk(k or 1, dim=1).indices
        hits = top.eq(labels[:, None])
        correct1 += hits[:, 0].sum().cpu()
        if k:
            correct5 += hits.any(dim=1).sum().cpu()
    model.train(was_training)

    local = torch.cat(losses) if losses else torch.zeros(0, dtype=torch.float64)
    # fsum of every per-sample loss is exactly rounded, so independent of rank order.
    all_losses = [x for part in comm.all_gather_object(local.tolist()) for x in part]
    counts = comm.all_reduce_sum(torch.stack([correct1, correct5, torch.tensor(len(local))]))
    n = int(counts[2])
    if n == 0:
        return EvalResult(loss=float("nan"), top1=float("nan"), top5=None, count=0)
    return EvalResult(
        loss=math.fsum(all_losses) / n,
        top1=int(counts[0]) / n,
        top5=int(counts[1]) / n if k else None,
        count=n,
    )
