"""--task auto decided from the data, once, before anything is built from it: several
labels an image (a labels file's rows, a Sequence(ClassLabel) column) make the run
multi-label; a task the data cannot give is one line."""

from __future__ import annotations

import dataclasses

from paratrain.config import TrainConfig
from paratrain.data.folder import DataSplit
from paratrain.errors import AgreedUserError

SEVERAL_FROM = (
    "several labels an image come from a labels file (--labels FILE.csv|.jsonl, names "
    "separated by ; or |, or 0/1 columns) or a dataset's Sequence(ClassLabel) column"
)


def decide_task(cfg: TrainConfig, split: DataSplit) -> TrainConfig:
    """``cfg`` with --task concrete (auto: what the data gives)."""
    given = "multilabel" if split.multilabel else "multiclass"
    if cfg.task == "multilabel" and not split.multilabel:
        raise AgreedUserError(
            f"--task multilabel: --data {cfg.data} gives one class an image"
            + (" (an image folder's class is its subfolder)" if not cfg.labels else "")
            + f"; {SEVERAL_FROM}"
        )
    if cfg.task == "multiclass" and split.multilabel:
        raise AgreedUserError(
            f"--task multiclass: --data {cfg.data} gives several labels to some images; "
            "--task multilabel (or auto) trains on them"
        )
    if given == "multilabel":
        for flag, value, off in (("--balance", cfg.balance, ("auto", "none")),
                                 ("--teacher", cfg.teacher, (None,))):  # fmt: skip
            if value not in off:
                raise AgreedUserError(
                    f"{flag} {value}: not with several labels an image (--task multilabel)"
                )
        return dataclasses.replace(cfg, task=given, balance="none")
    return dataclasses.replace(cfg, task=given)
