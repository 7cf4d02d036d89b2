"""SCORES: a validation score's name -> (its family's module, what it measures). Nothing
else lives here.

A score is computed by ``paratrain.report.scores.<family>`` (a module holding
:class:`~paratrain.report.scores.base.Score` objects as ``SCORES``) from the exact
evaluation's totals: counts summed over every rank and the all-reduced confusion
matrix (several labels an image: every image's probabilities, gathered in order), so
every score is the same at any world size; a score a task does not have is None. Each one is a column of the
metrics row (``val_<name>``), a choice of ``--monitor`` and a figure of ``paratrain
eval``. Adding one is an entry in its family's module (or a new module) and one line
here. Nothing here imports torch: the command line reads these names at no cost.
"""

from __future__ import annotations

SCORES: dict[str, tuple[str, str]] = {
    "loss": ("loss", "the lowest mean cross-entropy"),
    "top1": ("topk", "the share of images whose highest-scored class is right"),
    "top5": ("topk", "the share whose five highest include the right class (5+ classes)"),
    "top5_error": ("topk", "the share whose five highest miss the right class (5+ classes)"),
    "macro_f1": ("per_class", "the mean F1 over the classes that have validation images"),
    "balanced_acc": ("per_class", "the mean recall over the classes (balanced accuracy)"),
    "map": (
        "multilabel",
        "several labels an image: the mean over the classes of average precision",
    ),
    "micro_f1": ("multilabel", "F1 over every (image, label) pair, at the chosen threshold"),
}
# the scores of a run with several labels an image (--task multilabel); "map" is theirs
# alone, the others are a run's of one class an image
MULTILABEL: tuple[str, ...] = ("map", "micro_f1", "macro_f1", "loss")


def of_task(task: str) -> tuple[str, ...]:
    """The scores a run of ``task`` has (what --monitor may pick)."""
    if task == "multilabel":
        return MULTILABEL
    return tuple(name for name in SCORES if name != "map")


# name -> what it measures, for --monitor's help
SUMMARIES: dict[str, str] = {name: summary for name, (_, summary) in SCORES.items()}
