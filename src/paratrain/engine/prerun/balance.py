"""--balance auto and --monitor auto decided from the training split's classes, once,
before anything is built from them (the sampler, the loss, best.pt's score), and said."""

from __future__ import annotations

import dataclasses

import numpy as np

from paratrain.config import TrainConfig
from paratrain.errors import AgreedUserError
from paratrain.log import get_logger
from paratrain.report.scores import of_task

AUTO_RATIO = 4.0  # --balance auto balances from this largest-to-smallest class ratio on


def decide(cfg: TrainConfig, labels: np.ndarray, classes: list[str]) -> TrainConfig:
    """``cfg`` with --balance and --monitor concrete: auto balances by sampling where the
    largest class is at least AUTO_RATIO times the smallest; the monitor is macro-F1
    where the classes are balanced, else top-1."""
    counts = np.bincount(np.asarray(labels, np.int64), minlength=len(classes))
    balance = cfg.balance
    if balance == "auto" and cfg.task != "multilabel":
        present = np.flatnonzero(counts)
        large, small = present[np.argmax(counts[present])], present[np.argmin(counts[present])]
        ratio = counts[large] / max(counts[small], 1)
        balance = "sampler" if ratio >= AUTO_RATIO else "none"
        if balance == "sampler":
            get_logger().info(
                f"--balance auto: the largest class ({classes[large]}, {counts[large]} "
                f"images) is {ratio:.1f}x the smallest ({classes[small]}, {counts[small]}): "
                f"each epoch draws classes by (1/count)^{cfg.balance_power:g}, best.pt by "
                "macro-F1 (--balance none trains on the data as it is)"
            )
    if balance == "sampler":
        _tell_rare(counts, classes, cfg.balance_power)
    monitor = cfg.monitor
    if monitor == "auto":
        monitor = "macro_f1" if balance != "none" else "top1"
        monitor = "map" if cfg.task == "multilabel" else monitor
    _check_monitor(monitor, cfg.task)
    if monitor.startswith("top5") and len(classes) < 5:
        raise AgreedUserError(
            f"--monitor {monitor}: the data has {len(classes)} classes, and top-5 needs at "
            "least 5 (choose top1, macro_f1, balanced_acc or loss)"
        )
    return dataclasses.replace(cfg, balance=balance, monitor=monitor)


def _check_monitor(monitor: str, task: str) -> None:
    """A score the task has (report/scores.of_task): mAP for several labels an image,
    top-k for one."""
    if monitor in of_task(task):
        return
    if task == "multilabel":
        raise AgreedUserError(
            f"--monitor {monitor}: not a score of several labels an image (choose "
            f"{', '.join(of_task(task))})"
        )
    raise AgreedUserError(
        f"--monitor {monitor}: a score of several labels an image; this data gives one "
        f"class an image (choose {', '.join(of_task(task))})"
    )


def _tell_rare(counts: np.ndarray, classes: list[str], power: float) -> None:
    """A class of one training image is drawn as often as its quota says: said, so that
    a user who did not mean it sees it."""
    from paratrain.data.samplers import balanced_quotas

    quotas = balanced_quotas(counts, int(counts.sum()), power)
    for index in np.flatnonzero(counts == 1):
        get_logger().warning(
            f"--balance sampler: class {classes[index]} has 1 training image; each epoch "
            f"draws it {quotas[index]} time(s)"
        )
