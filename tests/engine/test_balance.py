"""--balance: a distributed class-balanced sampler (exact class quotas an epoch, the same
order at any world size, resumable mid-epoch), class weights in the loss, auto at a 4:1
imbalance, and the monitor that follows."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from imagefolders import make_image_folder
from paratrain import TrainConfig, train
from paratrain.data.samplers import BalancedSampler, balanced_quotas, train_sampler
from paratrain.engine.checkpointing import checkpoint
from paratrain.engine.prerun.balance import decide
from paratrain.engine.run.recipe import build_criterion, class_weights
from paratrain.errors import AgreedUserError

LABELS = np.array([0] * 600 + [1] * 150 + [2] * 60)  # 10:2.5:1


def test_quotas_follow_the_tempered_inverse_frequency_and_sum_to_the_epoch():
    counts = np.bincount(LABELS)
    for power in (0.25, 0.5, 1.0):
        quotas = balanced_quotas(counts, len(LABELS), power)
        target = counts ** (1 - power) / (counts ** (1 - power)).sum() * len(LABELS)
        assert quotas.sum() == len(LABELS) and np.abs(quotas - target).max() < 1
    assert balanced_quotas(counts, 810, 1.0).tolist() == [270, 270, 270]
    assert balanced_quotas(np.array([5, 0, 3]), 8, 1.0).tolist() == [4, 0, 4]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_sampler_draws_each_classs_quota_at_every_world_size(world):
    """The stated tolerance: every class within world-1 draws of its quota over the
    epoch (the padding that gives every rank as many samples repeats up to world-1)."""
    samplers = [BalancedSampler(LABELS, r, world, seed=7, power=0.5) for r in range(world)]
    for s in samplers:
        s.set_epoch(3)
    drawn = [index for s in samplers for index, _ in s]
    assert len({len(s) for s in samplers}) == 1  # every rank the same number of samples
    quotas = balanced_quotas(np.bincount(LABELS), len(LABELS), 0.5)
    counts = Counter(LABELS[drawn].tolist())
    for label, quota in enumerate(quotas.tolist()):
        assert abs(counts[label] - quota) <= world - 1, (label, counts[label], quota)
    one = BalancedSampler(LABELS, 0, 1, seed=7, power=0.5)
    one.set_epoch(3)
    assert sorted(drawn)[: len(LABELS) - world] <= sorted(i for i, _ in one)  # same draws


def test_the_order_is_the_seeds_and_the_epochs_and_resumes_where_it_stopped():
    a, b = BalancedSampler(LABELS, 0, 2, seed=1), BalancedSampler(LABELS, 0, 2, seed=1)
    a.set_epoch(2)
    b.set_epoch(2)
    whole = list(a)
    assert whole == list(b)
    b.set_epoch(3)
    assert [i for i, _ in whole] != [i for i, _ in b]  # a new order every epoch
    b.set_epoch(2, consumed=100)  # 50 steps of this rank's share, on 2 ranks
    assert list(b) == whole[50:]
    one = BalancedSampler(LABELS, 0, 1, seed=1)
    one.set_epoch(2)
    rare = [i for i, _ in one if LABELS[i] == 2]
    assert len(rare) > len(set(rare)) == 60  # the rare class's images repeat, evenly
    assert max(Counter(rare).values()) - min(Counter(rare).values()) <= 1


def test_a_class_of_one_image_is_drawn_its_quota_and_said(monkeypatch):
    said = []
    monkeypatch.setattr(
        "paratrain.engine.prerun.balance.get_logger",
        lambda: type("L", (), {"warning": said.append, "info": said.append})(),
    )
    labels = np.array([0] * 40 + [1] * 9 + [2])
    cfg = decide(TrainConfig(balance="sampler"), labels, ["a", "b", "c"])
    assert cfg.balance == "sampler" and cfg.monitor == "macro_f1"
    sampler = train_sampler(labels, 0, 1, 0, balance_power=0.5)
    sampler.set_epoch(0)
    drawn = Counter(labels[[i for i, _ in sampler]].tolist())
    quota = balanced_quotas(np.bincount(labels), 50, 0.5)[2]
    assert drawn[2] == quota > 1
    assert any(f"class c has 1 training image; each epoch draws it {quota} time" in s for s in said)


def test_auto_balances_from_four_to_one_says_so_and_sets_the_monitor(monkeypatch):
    said = []
    monkeypatch.setattr(
        "paratrain.engine.prerun.balance.get_logger",
        lambda: type("L", (), {"warning": said.append, "info": said.append})(),
    )
    four = np.array([0] * 40 + [1] * 10)
    three = np.array([0] * 30 + [1] * 10)
    assert decide(TrainConfig(), four, ["x", "y"]).balance == "sampler"
    assert "largest class (x, 40 images) is 4.0x the smallest (y, 10)" in said[0]
    plain = decide(TrainConfig(), three, ["x", "y"])
    assert (plain.balance, plain.monitor) == ("none", "top1") and len(said) == 1
    kept = decide(TrainConfig(monitor="loss", balance="loss"), three, ["x", "y"])
    assert (kept.balance, kept.monitor) == ("loss", "loss")
    with pytest.raises(AgreedUserError, match="--monitor top5: the data has 2 classes"):
        decide(TrainConfig(monitor="top5"), three, ["x", "y"])


def test_loss_weights_average_one_per_image_and_favour_the_rare():
    counts = [600, 150, 60]
    weights = class_weights(counts, 0.5)
    assert float((weights.double() * torch.tensor(counts).double()).sum()) == pytest.approx(810)
    assert weights[2] / weights[0] == pytest.approx(10**0.5, rel=1e-5)
    criterion = build_criterion(TrainConfig(balance="loss"), counts)
    assert torch.equal(criterion.weight, weights)
    assert build_criterion(TrainConfig(balance="sampler"), counts).weight is None


@pytest.mark.parametrize("balance", ["sampler", "loss"])
def test_a_run_on_imbalanced_classes_balances_and_keeps_best_by_macro_f1(tmp_path, balance):
    data = make_image_folder(tmp_path / "data", classes=3, per_class=4)
    for i in range(4, 40):  # class_0: 40 images, 10x the others
        (data / "class_0" / f"{i:03d}.jpg").write_bytes((data / "class_0/000.jpg").read_bytes())
    summary = train(
        TrainConfig(
            data=str(data),
            model="resnet18",
            image_size=16,
            batch_size=8,
            workers=0,
            epochs=1,
            cache="off",
            output_dir=str(tmp_path / "runs"),
            name="b",
            balance=balance,
        )  # fmt: skip
    )
    row = json.loads((tmp_path / "runs/b/metrics.jsonl").read_text().splitlines()[-1])
    assert row["val_count"] == 8 + 1 + 1 and summary["final"]["val_count"] == 10  # unweighted
    best = checkpoint.load(tmp_path / "runs/b/checkpoints/best.pt")
    assert best.monitor == "macro_f1" and best.best_score == pytest.approx(row["val_macro_f1"])
    assert best.train_config().balance == balance
