"""Several labels an image: the loss and the targets, the mixers, average precision and
the threshold, the task decided from the data, and evaluation that is the same at 1, 2
and 3 processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

from paratrain.config import TrainConfig
from paratrain.data.label_sets import encode, label_counts
from paratrain.data.samplers import ShardedEvalSampler
from paratrain.engine.run.task import (
    MultiClass,
    MultiLabel,
    MultiLabelLoss,
    multilabel_mixer,
    task_of,
)
from paratrain.report.scores.multilabel import THRESHOLDS, average_precision, choose_threshold

SIZE, CLASSES = 16, 5


def _brute_average_precision(scores: list[float], truth: list[int]) -> float:
    """The mean over the positives of precision among images scored at least as high."""
    positives = [s for s, t in zip(scores, truth, strict=True) if t]
    return sum(
        sum(t for s2, t in zip(scores, truth, strict=True) if s2 >= s)
        / sum(1 for s2 in scores if s2 >= s)
        for s in positives
    ) / len(positives)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.95]), st.integers(0, 1)),
        min_size=1,
        max_size=30,
    )
)
def test_average_precision_counts_tied_scores_together(pairs):
    """Scores from a few values, so ties are common: the step function of
    scikit-learn's average_precision_score, checked against its definition."""
    scores, truth = [s for s, _ in pairs], [t for _, t in pairs]
    got = average_precision(torch.tensor(scores), torch.tensor(truth))
    if not any(truth):
        assert got is None
    else:
        assert got == pytest.approx(_brute_average_precision(scores, truth), abs=1e-12)


def test_average_precision_of_a_perfect_and_a_reversed_ranking():
    truth = torch.tensor([1, 1, 0, 0])
    assert average_precision(torch.tensor([0.9, 0.8, 0.2, 0.1]), truth) == 1.0
    assert average_precision(torch.tensor([0.1, 0.2, 0.8, 0.9]), truth) == pytest.approx(
        (1 / 3 + 2 / 4) / 2
    )


def test_the_threshold_is_the_one_with_the_best_micro_f1():
    outputs = torch.tensor([[0.62, 0.30], [0.58, 0.20], [0.40, 0.90], [0.10, 0.46]])
    truth = torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1]])
    assert choose_threshold(outputs, truth) == 0.45  # all right above 0.40, up to 0.46
    assert choose_threshold(torch.full((2, 2), 0.5), torch.ones(2, 2)) in THRESHOLDS
    # every threshold alike (nothing right or wrong to tell them apart): 0.5
    assert choose_threshold(torch.zeros(2, 2), torch.zeros(2, 2)) == 0.5


def test_label_sets_number_each_distinct_combination():
    ids, table = encode([[2, 0], [1], [0, 2], [0, 2, 2]], 3)
    assert ids.tolist() == [0, 1, 0, 0] and table.tolist() == [[1, 0, 1], [0, 1, 0]]
    assert label_counts(ids, table).tolist() == [3, 1, 3]


def test_the_task_looks_targets_up_and_scores_each_label():
    table = np.array([[1, 0, 1], [0, 1, 0]], np.uint8)
    task = task_of(table, torch.device("cpu"))
    assert isinstance(task, MultiLabel) and isinstance(
        task_of(None, torch.device("cpu")), MultiClass
    )
    labels = torch.tensor([1, 0])
    assert task.targets(labels).tolist() == [[0, 1, 0], [1, 0, 1]]
    logits = torch.tensor([[-1.0, 2.0, 3.0], [1.0, -1.0, 1.0]])  # 2 of 3 right, then 3 of 3
    assert float(task.correct(logits, labels)) == pytest.approx(2 / 3 + 1)


def test_the_loss_is_binary_cross_entropy_with_smoothing_towards_one_over_classes():
    logits, targets = torch.randn(4, 5), torch.randint(0, 2, (4, 5)).float()
    plain = torch.nn.functional.binary_cross_entropy_with_logits(logits, targets)
    assert torch.allclose(MultiLabelLoss()(logits, targets), plain)
    smoothed = targets * 0.9 + 0.1 / 5
    want = torch.nn.functional.binary_cross_entropy_with_logits(logits, smoothed)
    assert torch.allclose(MultiLabelLoss(0.1)(logits, targets), want)


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_the_mixers_mix_targets_as_they_mix_images(kind):
    """Each image is a constant equal to its row's first target, so the mixed image's
    mean is the share of the first image in it, and the mixed target's first entry
    must be that same share."""
    torch.manual_seed(0)
    mix = multilabel_mixer(1.0 if kind == "mixup" else 0.0, 1.0 if kind == "cutmix" else 0.0)
    assert mix is not None
    targets = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    images = targets[:, :1, None, None].expand(4, 3, 8, 8).clone()
    for _ in range(5):
        mixed, soft = mix(images, targets)
        assert torch.allclose(mixed.mean(dim=(1, 2, 3)), soft[:, 0], atol=1e-6)
        # row 1 is its own [0, 1, 1] and row 0's [1, 0, 1] in some proportion
        assert torch.allclose(soft[1, 1], 1 - soft[1, 0], atol=1e-6)
        assert torch.allclose(soft[1, 2], torch.tensor(1.0))
        assert ((soft >= 0) & (soft <= 1)).all()
    assert multilabel_mixer(0.0, 0.0) is None


def test_the_task_is_decided_from_the_data_and_a_wrong_one_is_one_line(tmp_path):
    from imagefolders import make_image_folder, make_multilabel_folder
    from paratrain.data.folder import build_split
    from paratrain.data.sources.base import open_source
    from paratrain.engine.prerun import balance
    from paratrain.engine.prerun.task import decide_task
    from paratrain.errors import UserError

    folder = make_image_folder(tmp_path / "f", classes=2, per_class=4)
    listing = make_multilabel_folder(tmp_path / "m", classes=3, images=12)
    one = build_split(folder)
    several = build_split(open_source(str(tmp_path / "m"), labels=listing))
    assert decide_task(TrainConfig(data=str(folder)), one).task == "multiclass"
    decided = decide_task(TrainConfig(data="m", labels=str(listing)), several)
    assert decided.task == "multilabel" and decided.balance == "none"
    assert balance.decide(decided, several.train.labels, several.classes).monitor == "map"
    with pytest.raises(UserError, match=r"--task multilabel: --data .* gives one class an image"):
        decide_task(TrainConfig(data=str(folder), task="multilabel"), one)
    with pytest.raises(UserError, match="--task multiclass: --data m gives several labels"):
        decide_task(TrainConfig(data="m", labels=str(listing), task="multiclass"), several)
    with pytest.raises(UserError, match="--balance sampler: not with several labels"):
        decide_task(TrainConfig(data="m", labels=str(listing), balance="sampler"), several)
    with pytest.raises(UserError, match="--teacher resnet18: not with several labels"):
        decide_task(TrainConfig(data="m", labels=str(listing), teacher="resnet18"), several)
    with pytest.raises(UserError, match="--monitor top1: not a score of several labels"):
        balance.decide(
            TrainConfig(task="multilabel", monitor="top1"), several.train.labels, several.classes
        )
    with pytest.raises(UserError, match="--monitor map: a score of several labels an image; "):
        balance.decide(TrainConfig(monitor="map"), one.train.labels, one.classes)


def _label_sets() -> np.ndarray:
    rng = np.random.default_rng(3)
    table = rng.integers(0, 2, (9, CLASSES)).astype(np.uint8)
    table[:, 0] = 1  # every set some label; class 4 never (its AP is None)
    table[:, 4] = 0
    return table


def _dataset(images: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(images)
    x = torch.randn(images, 3, SIZE, SIZE, generator=generator)
    y = torch.randint(0, 9, (images,), generator=generator)
    return TensorDataset(x, y)


class _BatchMates(torch.nn.Module):
    """Each image's scores moved by its batch-mates' mean: the whole batch shows in
    every row, far above any rounding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = x.flatten(1)[:, :CLASSES]
        return scores + scores.mean(0, keepdim=True)


def _evaluate(rank, world, images: int, batch: int, mates: bool = False):
    from paratrain.engine.inference.evaluate import evaluate
    from paratrain.models.registry import create_model

    torch.manual_seed(5)
    model = _BatchMates() if mates else create_model("resnet18", CLASSES)
    dataset = _dataset(images)
    loader = DataLoader(
        dataset, batch_size=batch, sampler=ShardedEvalSampler(images, rank, world, batch)
    )
    result = evaluate(model, loader, torch.device("cpu"), CLASSES, label_sets=_label_sets())
    return result.row(), result.per_class_ap(), result.outputs, result.count


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_evaluation_is_identical_at_one_two_and_three_processes(world):
    """23 images in batches of 4 (shards of 12/11 at 2, 8/8/7 at 3): the probabilities,
    gathered in dataset order, are one process's to the bit, and so are mAP, each
    class's AP, the threshold and the F1s. The shards are one process's batches dealt
    whole, so a math library that rounds an image by its batch and row rounds it alike
    (on one CPU without AVX-512, images 14 and 20 came out 6e-8 apart when shards were
    dealt image by image; the test below shows the layout with a model that looks at
    the whole batch)."""
    from spawn import in_single_process, run_distributed

    reference = in_single_process(_evaluate, 23, 4)
    row, aps, outputs, count = reference
    assert count == 23 and row["val_top1"] is None and row["val_map"] is not None
    assert aps[4] is None and row["val_threshold"] in THRESHOLDS
    for got in run_distributed(_evaluate, world, 23, 4):
        assert got[3] == 23
        assert torch.equal(got[2], outputs)
        assert got[0] == row and got[1] == aps


@pytest.mark.slow
def test_each_image_meets_the_batch_mates_it_has_in_one_process():
    """A model whose every output depends on the whole batch: 3 processes give one
    process's outputs only if each image keeps its batch (23 images in batches of 4,
    the short last one padded alike), which shards dealt image by image would not."""
    from spawn import in_single_process, run_distributed

    _, _, outputs, _ = in_single_process(_evaluate, 23, 4, True)
    for got in run_distributed(_evaluate, 3, 23, 4, True):
        assert torch.equal(got[2], outputs)
