"""Recipe options: each trains to a finite loss and does what it says."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace

import pytest
import torch

from imagefolders import make_image_folder
from paratrain import TrainConfig, train
from paratrain.cli import main
from paratrain.config import resolve_train
from paratrain.engine.checkpointing import checkpoint
from paratrain.engine.run.recipe import build_mixer
from paratrain.errors import UserError
from paratrain.models.registry import build_model


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("recipe") / "data", classes=3, per_class=8)


def run(data, out, name, **options):
    defaults = dict(image_size=16, epochs=1, batch_size=8, workers=0)
    cfg = TrainConfig(data=str(data), output_dir=str(out), name=name, **{**defaults, **options})
    summary = train(cfg)
    state = checkpoint.load(out / name / "checkpoints" / "last.pt")
    return cfg, summary, state


@pytest.mark.parametrize(
    "options",
    [
        {"opt": "adamw", "lr": 0.001},
        {"label_smoothing": 0.1},
        {"mixup": 0.2},
        {"cutmix": 1.0},
        {"mixup": 0.2, "cutmix": 1.0, "label_smoothing": 0.1},
        {"seed": 7},
    ],
    ids=lambda o: ",".join(o),
)
def test_option_trains_to_finite_loss(small_data, tmp_path, options):
    cfg, summary, state = run(small_data, tmp_path, "r", **options)
    assert math.isfinite(summary["final"]["train_loss"])
    assert summary["final"]["val_count"] == 6
    # the settings as the run resolved them: balanced data of one class an image, so no
    # balancing, top-1; an average of the weights over two epochs of 3 steps, at least 10
    resolved = {"balance": "none", "monitor": "top1", "task": "multiclass", "ema_decay": 0.9}
    assert state.config == {**cfg.to_dict(), **resolved}
    if cfg.opt == "adamw":
        assert "exp_avg" in next(iter(state.optimizer["state"].values()))


def test_adamw_gets_its_own_defaults_unless_given(small_data):
    cfg = resolve_train({"data": str(small_data), "opt": "adamw"})
    assert (cfg.rate(1), cfg.weight_decay) == (0.001, 0.05)  # at batch 16
    cfg = resolve_train({"data": str(small_data), "opt": "adamw", "lr": 0.003})
    assert (cfg.rate(2), cfg.weight_decay) == (0.003, 0.05)  # --lr: the rate used
    cfg = resolve_train({"data": str(small_data)})
    assert (cfg.opt, cfg.rate(1)) == ("sgd", 0.01)


def test_mixer_mixes_images_and_targets_alike():
    torch.manual_seed(0)
    images = torch.rand(6, 3, 8, 8)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])  # each image's neighbour has another class
    other = images.roll(1, 0)
    mixed, targets = build_mixer(TrainConfig(mixup=0.4), num_classes=3)(images, labels)
    lam = float(targets[0, labels[0]])
    assert targets.shape == (6, 3) and 0 < lam < 1
    torch.testing.assert_close(mixed, lam * images + (1 - lam) * other)
    mixed, targets = build_mixer(TrainConfig(cutmix=1.0), num_classes=3)(images, labels)
    lam = float(targets[0, labels[0]])
    pasted = (mixed != images).any(dim=1)  # pixels that came from the neighbour
    assert torch.equal(mixed[:, :, pasted[0]], other[:, :, pasted[0]])
    assert pasted.float().mean(dim=(1, 2)).tolist() == pytest.approx([1 - lam] * 6)
    for alphas in ({"mixup": 0.4}, {"cutmix": 1.0}, {"mixup": 0.4, "cutmix": 1.0}):
        _, targets = build_mixer(TrainConfig(**alphas), num_classes=3)(images, labels)
        torch.testing.assert_close(targets.sum(1), torch.ones(6))
    assert build_mixer(TrainConfig(), num_classes=3) is None


def test_freeze_backbone_trains_only_the_head(small_data, tmp_path):
    cfg, _, state = run(small_data, tmp_path, "f", freeze_backbone=True, lr=0.1)
    initial = build_model(TrainConfig(**{**cfg.to_dict(), "freeze_backbone": False}), 3)
    before = initial.state_dict()
    names = [name for name, _ in initial.named_parameters()]
    moved = {n for n in names if not torch.equal(state.model[n], before[n])}
    assert moved == {"fc.weight", "fc.bias"}
    assert state.optimizer["param_groups"][0]["params"] == [0, 1]


def test_ema_is_evaluated_and_saved_beside_the_raw_weights(small_data, tmp_path, capsys):
    _, summary, state = run(small_data, tmp_path, "e", ema_decay=0.5)
    final = summary["final"]
    assert {"val_top1_ema", "val_loss_ema"} <= set(final)
    assert state.ema["n_averaged"] == 3  # 18 images, batch 8: three steps
    raw, averaged = state.model, state.ema["model"]
    assert raw.keys() == averaged.keys()
    assert not torch.equal(raw["fc.weight"], averaged["fc.weight"])
    last = str(tmp_path / "e/checkpoints/last.pt")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", last, "--ema", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["top1"] == pytest.approx(final["val_top1_ema"])
    assert result["report_dir"].endswith("eval-ema")
    assert main(["eval", "--checkpoint", last, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["top1"] == pytest.approx(final["val_top1"])


def test_tensorboard_scalars_per_step_and_per_epoch(small_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(small_data, tmp_path, "t", tensorboard=True, epochs=2)
    events = EventAccumulator(str(tmp_path / "t/tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/acc", "train/lr", "train/images_per_s"} <= tags
    assert {"epoch/val_top1", "epoch/train_loss", "epoch/lr", "epoch/train_images_per_s"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events.Scalars("epoch/val_top1")] == [1, 2]
    metrics = [json.loads(x) for x in (tmp_path / "t/metrics.jsonl").read_text().splitlines()]
    logged = [e.value for e in events.Scalars("epoch/val_top1")]
    assert logged == pytest.approx([r["val_top1"] for r in metrics])


def test_tensorboard_missing_is_a_clear_error(small_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(UserError, match="needs the tensorboard package"):
        train(resolve_train({"data": str(small_data), "tensorboard": True}), dry_run=True)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--opt", "lion", "invalid choice"),
        ("--label-smoothing", "1.5", "--label-smoothing must be in [0, 1)"),
        ("--ema-decay", "1.0", "--ema-decay must be in [0, 1), or auto"),
        ("--mixup", "-1", "--mixup must be at least 0, got -1.0"),
    ],
)
def test_bad_recipe_values_are_one_line_errors(small_data, capsys, flag, value, message):
    try:
        code = main(["train", "--data", str(small_data), flag, value])
    except SystemExit as exc:  # argparse's own checks exit from inside parse_args
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_ema_warms_up_as_timm_does_then_keeps_its_decay():
    """(1 + n) / (10 + n) after n updates while that is below the decay: the average of
    a short run is not mostly its random start; a resumed average goes on from its
    count."""
    from paratrain.engine.run.recipe import EMA
    from paratrain.parallel.parts import ModelParts

    layer = torch.nn.Linear(1, 1, bias=False)
    ema = EMA(ModelParts([layer]), 0.3)
    expected = None
    for value in (1.0, 2.0, 3.0, 4.0):
        with torch.no_grad():
            layer.weight.fill_(value)
        decay = ema.decay_now()
        ema.update()  # the first copies the weights
        expected = value if expected is None else decay * expected + (1 - decay) * value
        assert ema.module.weight.item() == pytest.approx(expected)
    assert ema.steps == 4 and ema.decay_now() == 0.3  # 5/14 is above 0.3: the decay
    assert EMA(ModelParts([layer]), 0.99).decay_now() == pytest.approx(1 / 10)
    again = EMA(ModelParts([torch.nn.Linear(1, 1, bias=False)]), 0.3)
    again.load_state_dict(ema.state_dict())
    assert again.steps == 4 and again.module.weight.item() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("given", "strategy", "decided"),
    [
        ("auto", "ddp", 0.99),  # 1600 images, batch 16 x 2 replicas: 50 steps, two epochs: 100
        ("auto", "fsdp", 0.0),  # keeps no whole copy of the weights: none
        ("auto", "budget", 0.0),  # --budget: none
        ("auto", "multilabel", 0.0),  # several labels an image: none
        (0.9, "ddp", 0.9),
        (0.0, "ddp", 0.0),
        (None, "ddp", 0.0),  # a config written before auto
    ],
)
def test_ema_decay_auto_averages_about_two_epochs_where_the_strategy_keeps_one(
    given, strategy, decided
):
    from paratrain.engine.run.recipe import EMA_EPOCHS, decide_ema

    budget = "60s" if strategy == "budget" else None
    task = "multilabel" if strategy == "multilabel" else "multiclass"
    strategy = "ddp" if strategy in ("budget", "multilabel") else strategy
    cfg = TrainConfig(data="d", ema_decay=given, strategy=strategy, batch_size=16, budget=budget,
                      task=task)  # fmt: skip
    assert EMA_EPOCHS == 2
    assert decide_ema(cfg, 1600, 2).ema_decay == pytest.approx(decided)
    # a tiny epoch still averages at least 10 steps; a huge one at most 1 in 10,000
    auto = replace(cfg, ema_decay="auto", strategy="ddp", budget=None, task="multiclass")
    assert decide_ema(auto, 8, 1).ema_decay == 0.9
    huge = decide_ema(auto, 10**8, 1)
    assert huge.ema_decay == 0.9999


@pytest.mark.parametrize(
    ("strategy", "budget", "said"),
    [("ddp", None, True), ("fsdp", None, False), ("pipeline", None, False), ("ddp", "60s", False)],
)
def test_the_start_lines_say_ema_auto_only_where_the_run_will_keep_an_average(
    strategy, budget, said
):
    """Before its decay is made concrete in the run, --ema-decay auto is said as an
    average where one will be kept, and not at all where the strategy keeps no whole
    weights or --budget turns it off."""
    from paratrain.engine.prerun.describe import run_facts

    cfg = TrainConfig(data="d", strategy=strategy, budget=budget, batch_size=16)
    assert cfg.ema_decay == "auto"
    facts = run_facts(cfg, processes="2", world=2, cuda=False, backend="gloo", data="d",
                      precision="fp32", cache="off")  # fmt: skip
    assert ("EMA of the weights (auto" in facts.recipe) == said, facts.recipe
