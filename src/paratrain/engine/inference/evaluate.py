"""Exact distributed evaluation, and `paratrain eval`'s worker.

Every rank evaluates its own unpadded shard; per-sample losses and correct counts are
gathered and summed, never averaged, so the result is the same at every world size:
1,001 images on 3 ranks count 1,001, not 1,002. The training loop's validation and
`paratrain eval` both run :func:`evaluate`, over loaders made by one function
(data/loaders.validation_loader).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from paratrain.config import EvalOptions, TrainConfig
from paratrain.data.folder import DataSplit
from paratrain.distributed import comm
from paratrain.distributed.env import DistEnv
from paratrain.errors import UserError
from paratrain.models.registry import logits_of
from paratrain.parallel.parts import ModelParts
from paratrain.report.scores.base import Totals, compute_all, ranking
from paratrain.report.scores.multilabel import choose_threshold, per_class_ap
from paratrain.report.scores.per_class import per_class


@dataclass(frozen=True)
class EvalResult:
    loss: float
    top1: float | None  # None with several labels an image
    top5: float | None  # only with at least 5 classes
    count: int
    confusion: torch.Tensor | None = None  # [true, predicted] counts over every rank
    predictions: list[tuple[int, int]] | None = None  # (dataset index, predicted class)
    # several labels an image: every image's probabilities and 0/1 labels, in the
    # dataset's order, and the threshold chosen on them (report/scores/multilabel)
    outputs: torch.Tensor | None = None
    truth: torch.Tensor | None = None
    threshold: float | None = None

    @property
    def totals(self) -> Totals:
        return Totals(self.loss, self.top1, self.top5, self.count, self.confusion,
                      self.outputs, self.truth, self.threshold)  # fmt: skip

    def row(self) -> dict[str, float | None]:
        """The metrics row's validation columns: ``val_<score>`` for every score, and
        ``val_threshold`` where one was chosen."""
        row = {f"val_{name}": value for name, value in self.scores().items()}
        if self.threshold is not None:
            row["val_threshold"] = self.threshold
        return row

    def per_class_ap(self) -> list[float | None]:
        """Each class's average precision (several labels an image; else empty)."""
        return per_class_ap(self.totals)

    @cached_property
    def _scores(self) -> dict[str, float | None]:
        return compute_all(self.totals)  # once per result: the row, --monitor, the report

    def scores(self) -> dict[str, float | None]:
        """Every registered score (report/scores), by name."""
        return dict(self._scores)

    def as_dict(self) -> dict:
        """The totals and every score, for JSON (and the threshold, where chosen)."""
        chosen = {"threshold": self.threshold} if self.threshold is not None else {}
        return {"count": self.count, **self.scores(), **chosen}

    def per_class(self) -> list[dict[str, float | int | None]]:
        """Each class's precision, recall, F1 and support, from the exact confusion
        matrix (so the same at every world size); None where undefined."""
        return per_class(self.totals)

    @property
    def macro_f1(self) -> float | None:
        return self._scores["macro_f1"]

    @property
    def balanced_accuracy(self) -> float | None:
        return self._scores["balanced_acc"]

    def score(self, monitor: str) -> float:
        """The figure --monitor picks the best checkpoint by (higher is better)."""
        return ranking(monitor, self._scores[monitor])

    def per_class_accuracy(self) -> list[float | None]:
        """Each class's share of correct predictions, from the confusion matrix (None for
        a class with no validation image: there is nothing to be right or wrong about)."""
        if self.confusion is None:
            raise ValueError("no confusion matrix: nothing was evaluated")
        totals = self.confusion.sum(dim=1)
        shares = (self.confusion.diagonal() / totals.clamp(min=1)).tolist()
        return [
            share if total else None for share, total in zip(shares, totals.tolist(), strict=True)
        ]


def _full_batch_logits(
    model: nn.Module | ModelParts, images: torch.Tensor, batch_size: int | None, tta: bool = False
) -> torch.Tensor | None:
    """A short last batch is padded to the loader's batch size (repeating its last image)
    and the padding dropped: math libraries pick kernels by batch size, and a kernel
    chosen for 13 images may round a sample differently from the one chosen for 16, so
    without this a sample's loss would depend on how the shards happened to end."""
    n = images.shape[0]
    if batch_size is not None and n < batch_size:
        padded = torch.cat([images, images[-1:].expand(batch_size - n, *images.shape[1:])])
        images = padded.contiguous(memory_format=_format_of(images))
    output = model(images)
    if tta:  # --tta flip: the mirror's logits averaged in (every stage runs both)
        mirrored = model(images.flip(-1).contiguous(memory_format=_format_of(images)))
        if output is not None and mirrored is not None:
            return (logits_of(output).float() + logits_of(mirrored).float())[:n] / 2
    if output is None:  # a pipeline stage before the last: the last one counts
        return None
    return logits_of(output)[:n].float()


def _pad_forward_calls(
    model: nn.Module | ModelParts,
    loader: DataLoader,
    last: torch.Tensor | None,
    calls: int,
    tta: bool,
) -> None:
    """``calls`` forward passes whose outputs count nothing, so that a rank whose exact
    shard holds fewer batches (none, even) still joins every collective that a sharded
    forward makes on the others (FSDP all-gathers each unit's parameters). The images are
    this rank's last batch, or, where it had none, the set's first image."""
    if calls <= 0:
        return
    if last is None:
        dataset, device = loader.dataset, getattr(model, "input_device", None)
        fetch = getattr(dataset, "__getitems__", None)
        items = fetch([0]) if fetch is not None else [dataset[0]]
        last = loader.collate_fn(items)[0].to(device or "cpu")
    assert last is not None
    for _ in range(calls):
        _full_batch_logits(model, last, loader.batch_size, tta)


def _format_of(images: torch.Tensor) -> torch.memory_format:
    channels_last = images.dim() == 4 and images.is_contiguous(memory_format=torch.channels_last)
    return torch.channels_last if channels_last else torch.contiguous_format


@torch.no_grad()
def evaluate(
    model: nn.Module | ModelParts,
    loader: DataLoader,
    device: torch.device,
    num_classes: int,
    detailed: bool = False,
    tta: bool = False,
    limit: int | None = None,
    label_sets: np.ndarray | None = None,
) -> EvalResult:
    """Loss, top-1 and top-5 over every rank's shard; with ``detailed``, also the confusion
    matrix and every sample's prediction (dataset indices from the loader's sampler);
    with ``tta``, each image's logits averaged with its mirror's; with ``limit``, only
    each rank's first ``limit`` batches (--limit-val-batches: a smoke run). With
    ``label_sets`` (several labels an image, data/label_sets.py): the binary
    cross-entropy, every image's probabilities, mAP and F1 at a chosen threshold."""
    was_training = model.training
    model.eval()
    tally: _Tally | _LabelSetTally = (
        _Tally(num_classes, detailed) if label_sets is None else _LabelSetTally(label_sets)
    )
    fmt = getattr(model, "memory_format", torch.preserve_format)
    label_device = getattr(model, "output_device", None) or device
    mine = len(loader) if limit is None else min(len(loader), limit)
    # agreed before any forward: a sharded forward is a collective on every rank
    calls = comm.all_reduce_max(mine) if getattr(model, "collective_forward", False) else mine
    images = None
    for batch, (images, labels) in enumerate(loader):
        if batch >= mine:
            break
        images = images.to(device, non_blocking=True, memory_format=fmt)
        labels = labels.to(label_device, non_blocking=True)
        logits = _full_batch_logits(model, images, loader.batch_size, tta)
        if logits is not None:
            tally.add(logits, labels)
    _pad_forward_calls(model, loader, images, calls - mine, tta)
    model.train(was_training)
    return tally.result(loader)


class _Tally:
    """This rank's sums over its shard: each sample's loss, top-1 and top-5 hits, the
    confusion counts and (``detailed``) each prediction; ``result`` gathers every
    rank's into one exact result."""

    def __init__(self, num_classes: int, detailed: bool):
        self.classes, self.detailed = num_classes, detailed
        self.k = 5 if num_classes >= 5 else None
        self.losses: list[torch.Tensor] = []
        self.correct1 = torch.zeros((), dtype=torch.int64)
        self.correct5 = torch.zeros((), dtype=torch.int64)
        self.confusion = torch.zeros(num_classes * num_classes, dtype=torch.int64)
        self.predicted: list[int] = []

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        loss = nn.functional.cross_entropy(logits, labels, reduction="none")
        self.losses.append(loss.double().cpu())
        top = logits.topk(self.k or 1, dim=1).indices
        hits = top.eq(labels[:, None])
        self.correct1 += hits[:, 0].sum().cpu()
        if self.k:
            self.correct5 += hits.any(dim=1).sum().cpu()
        pairs = (labels * self.classes + top[:, 0]).cpu()  # exact: counts, summed over ranks
        self.confusion += torch.bincount(pairs, minlength=self.classes * self.classes)
        if self.detailed:
            self.predicted += top[:, 0].tolist()

    def result(self, loader: DataLoader) -> EvalResult:
        local = torch.cat(self.losses) if self.losses else torch.zeros(0, dtype=torch.float64)
        # fsum of every per-sample loss is exactly rounded, so independent of rank order.
        all_losses = [x for part in comm.all_gather_object(local.tolist()) for x in part]
        counts = torch.stack([self.correct1, self.correct5, torch.tensor(len(local))])
        counts = comm.all_reduce_sum(counts)
        n = int(counts[2])
        if n == 0:
            return EvalResult(loss=float("nan"), top1=float("nan"), top5=None, count=0)
        predictions = None
        if self.detailed:
            indices = list(getattr(loader.sampler, "indices", range(len(self.predicted))))
            pairs = list(zip(indices, self.predicted, strict=True))
            predictions = sorted(p for part in comm.all_gather_object(pairs) for p in part)
        return EvalResult(
            loss=math.fsum(all_losses) / n,
            top1=int(counts[0]) / n,
            top5=int(counts[1]) / n if self.k else None,
            count=n,
            confusion=comm.all_reduce_sum(self.confusion).view(self.classes, self.classes),
            predictions=predictions,
        )


class _LabelSetTally:
    """Several labels an image: this rank's per-image losses, probabilities and 0/1
    labels; ``result`` gathers every rank's and orders them by dataset index, so the
    scores (which rank the images) are the same at any world size."""

    def __init__(self, label_sets: np.ndarray):
        self.table = torch.as_tensor(label_sets, dtype=torch.float32)
        self.losses: list[torch.Tensor] = []
        self.outputs: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        truth = self.table[labels.long().cpu()]
        logits = logits.float().cpu()
        loss = nn.functional.binary_cross_entropy_with_logits(logits, truth, reduction="none")
        self.losses.append(loss.double().mean(dim=1))
        self.outputs.append(torch.sigmoid(logits))
        self.labels.append(labels.long().cpu())

    def result(self, loader: DataLoader) -> EvalResult:
        classes = self.table.shape[1]
        outputs = torch.cat(self.outputs) if self.outputs else torch.zeros(0, classes)
        labels = torch.cat(self.labels) if self.labels else torch.zeros(0, dtype=torch.long)
        losses = torch.cat(self.losses) if self.losses else torch.zeros(0, dtype=torch.float64)
        indices = list(getattr(loader.sampler, "indices", range(len(labels))))[: len(labels)]
        mine = (torch.tensor(indices, dtype=torch.long), outputs, labels, losses)
        parts = comm.all_gather_object(mine)
        order = torch.argsort(torch.cat([p[0] for p in parts]))
        outputs = torch.cat([p[1] for p in parts])[order]
        truth = self.table[torch.cat([p[2] for p in parts])[order]]
        losses = torch.cat([p[3] for p in parts])[order]
        n = len(order)
        if n == 0:
            return EvalResult(loss=float("nan"), top1=None, top5=None, count=0)
        return EvalResult(
            loss=math.fsum(losses.tolist()) / n,
            top1=None,
            top5=None,
            count=n,
            outputs=outputs,
            truth=truth.bool(),
            threshold=choose_threshold(outputs, truth),
        )


@dataclass
class EvalJob:
    """What `paratrain eval` evaluates: a checkpoint's weights and settings on a split's
    validation images, checked before any process starts."""

    weights: dict[str, torch.Tensor]
    saved: TrainConfig
    split: DataSplit
    report_dir: Path
    skipped: int = 0  # unreadable validation images left out, as the run did

    def describe(self, opts: EvalOptions) -> str:
        """What `eval --dry-run` says would run."""
        return (
            f"would evaluate {opts.checkpoint} ({self.saved.model} at "
            f"{self.saved.image_size}px, {len(self.split.classes)} classes) on "
            f"{len(self.split.val)} validation images of {self.split.root} with "
            f"{opts.nproc} process(es)"
        )


def prepare_evaluation(opts: EvalOptions) -> EvalJob:
    """The checkpoint read, its data split as training split it, its weights checked
    against its model: every mistake one line before any process starts."""
    from paratrain.data.loaders import memory_folder, read_split
    from paratrain.data.scan import without_unreadable
    from paratrain.engine.checkpointing import checkpoint
    from paratrain.models.registry import check_weights_fit

    path = str(opts.checkpoint)  # required: the options were checked
    state = checkpoint.load(path, with_optimizer=False)
    saved = state.train_config(path)
    data_dir = opts.data or saved.data
    if not data_dir:
        raise UserError("--data is needed: the checkpoint does not name its data")
    from paratrain.data.loaders import recorded_sides
    from paratrain.engine.checkpointing.run_dir import run_dir_of

    split = recorded_sides(read_split(replace(saved, data=data_dir)), run_dir_of(path))
    if split.classes != state.classes:
        raise UserError(
            f"classes of {data_dir} ({len(split.classes)}) differ from the checkpoint's "
            f"({len(state.classes)}): {split.classes[:5]} vs {state.classes[:5]}"
        )
    skipped = 0
    if saved.bad_images == "skip":  # as the run did: its validation left them out
        kept, bad = without_unreadable(split.val, memory_folder(saved))
        split, skipped = replace(split, val=kept), len(bad)
    weights = state.weights(path, opts.ema)
    check_weights_fit(saved.model, len(split.classes), saved.train_size, weights, path)
    return EvalJob(weights, saved, split, eval_dir(path, opts.ema), skipped)


def eval_dir(state_path: str, ema: bool = False) -> Path:
    """<run>/eval for a checkpoint inside a run directory, else eval-<name> beside it."""
    from paratrain.engine.checkpointing.run_dir import run_dir_of

    suffix = "-ema" if ema else ""
    path, run = Path(state_path), run_dir_of(state_path)
    return run / f"eval{suffix}" if run else path.parent / f"eval-{path.stem}{suffix}"


def evaluate_checkpoint(job: EvalJob, opts: EvalOptions, env: DistEnv) -> dict:
    """This process's share of `paratrain eval` (the one evaluation worker): the model
    on this machine's device, each validation image counted once across the ranks; the
    report written by rank 0."""
    from paratrain.data.loaders import default_workers, validation_loader
    from paratrain.distributed.runtime import distributed
    from paratrain.log import setup_logging
    from paratrain.models.registry import create_model

    setup_logging(env.rank, env.world_size)
    saved, split = job.saved, job.split
    # this machine's device, not the training run's: a CUDA checkpoint evaluates on a CPU
    with distributed(env, opts.device, None, saved.timeout) as runtime:
        model = create_model(saved.model, len(split.classes), saved.train_size)
        model.load_state_dict(job.weights)
        model.to(runtime.device)
        workers = (
            opts.workers if opts.workers is not None else default_workers(env.local_world_size)
        )
        loader = validation_loader(
            split.val, saved, opts.batch_size, workers, runtime.rank, runtime.world_size
        )
        result = evaluate(
            model, loader, runtime.device, len(split.classes), True, job.saved.tta == "flip",
            label_sets=split.label_sets,
        )  # fmt: skip
        report = {**result.as_dict(), "world_size": runtime.world_size}
        if runtime.is_main and split.multilabel:
            from paratrain.report.evaluation import write_label_sets_evaluation

            report.update(
                per_class=dict(zip(split.classes, result.per_class_ap(), strict=True)),
                per_class_scores=dict(zip(split.classes, result.per_class(), strict=True)),
                report_dir=str(write_label_sets_evaluation(result, split, job.report_dir)),
            )
        elif runtime.is_main:
            from paratrain.report.evaluation import write_evaluation

            assert result.confusion is not None and result.predictions is not None
            out = write_evaluation(result.confusion, result.predictions, split, job.report_dir)
            report.update(
                per_class=dict(zip(split.classes, result.per_class_accuracy(), strict=True)),
                per_class_scores=dict(zip(split.classes, result.per_class(), strict=True)),
                report_dir=str(out),
            )
        return report
