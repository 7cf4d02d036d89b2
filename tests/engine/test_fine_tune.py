"""Fine-tuning controls: the backbone frozen for K epochs then thawed, the head's own
learning rate, layer-wise learning-rate decay, and the shipped fine-tune recipe."""

from __future__ import annotations

import copy

import pytest
import torch

from paratrain import TrainConfig
from paratrain.config import resolve_train
from paratrain.config.train import read_recipe
from paratrain.engine.run.precision import Precision
from paratrain.engine.run.recipe import build_optimizer, build_recipe
from paratrain.engine.run.schedule import Schedule, base_lr
from paratrain.engine.run.step import Stepper, train_step
from paratrain.errors import UserError
from paratrain.models.registry import create_model
from paratrain.parallel import optim_state
from paratrain.parallel.parts import ModelParts


def _parts(cfg: TrainConfig, model: torch.nn.Module) -> ModelParts:
    parts = ModelParts([model])
    parts.grouping = optim_state.grouping(cfg, model)
    return parts


def _stepper(cfg: TrainConfig, classes: int = 3) -> tuple[Stepper, torch.nn.Module]:
    torch.manual_seed(0)
    model = create_model(cfg.model, classes)
    parts = _parts(cfg, model)
    optimizer = build_optimizer(parts, cfg, 1)
    recipe = build_recipe(cfg, parts, classes, Precision("32", torch.device("cpu")))
    return Stepper(parts, optimizer, recipe), model


def _batch(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 32, 32, generator=generator), torch.tensor([0, 1, 2, 0])


def _backbone(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("fc.")}


def test_a_frozen_backbone_and_its_batchnorm_stay_put_then_thaw():
    cfg = TrainConfig(model="resnet18", freeze_epochs=1, weight_decay=0.01)
    stepper, model = _stepper(cfg)
    freezing = stepper.recipe.freezing
    assert freezing is not None
    before, head = _backbone(model), model.fc.weight.clone()
    freezing.set_epoch(0)
    model.train()
    for seed in range(2):
        train_step(stepper, [_batch(seed)], 1)
    after = _backbone(model)
    for key, value in before.items():  # weights, running statistics and batch counts
        assert torch.equal(after[key], value), key
    assert not torch.equal(model.fc.weight, head)
    assert model.training and model.layer1[0].bn1.training is False  # held in eval
    momentum = stepper.optimizer.state
    assert model.conv1.weight not in momentum and model.fc.weight in momentum
    assert freezing.set_epoch(1)  # the epoch it thaws at says so
    model.train()
    train_step(stepper, [_batch(3)], 1)
    assert not torch.equal(model.conv1.weight, before["conv1.weight"])
    assert not torch.equal(model.bn1.running_mean, before["bn1.running_mean"])
    assert model.layer1[0].bn1.training


def test_freezing_needs_a_head_and_is_not_freeze_backbone():
    with pytest.raises(UserError, match="give one"):
        resolve_train({"data": "d", "freeze_epochs": 2, "freeze_backbone": True})


def test_a_backbone_that_would_never_thaw_is_refused_or_said_under_a_budget(
    image_folder, tmp_path, monkeypatch, capsys
):
    """--freeze-epochs 3 --epochs 1 trained a frozen backbone throughout, hinted at in
    the start line only: now one line refusing it. --budget plans the epochs itself, so
    there a plan that ends before the thaw is said once, when it is made."""
    with pytest.raises(UserError) as never:
        resolve_train({"data": "d", "freeze_epochs": 3, "epochs": 1})
    assert str(never.value).startswith(
        "--freeze-epochs 3 with --epochs 1: the backbone would stay frozen for the whole run"
    )
    with pytest.raises(UserError, match="would stay frozen"):
        resolve_train({"data": "d", "freeze_epochs": 2, "epochs": 2})
    assert resolve_train({"data": "d", "freeze_epochs": 2, "epochs": 3}).freeze_epochs == 2
    from paratrain import TrainConfig, train
    from paratrain.engine.prerun import budget

    monkeypatch.setattr(budget.Budget, "after_step", _plans_two_epochs)
    monkeypatch.setattr(budget.Budget, "after_epoch", lambda self, done, cost: 2.0)
    cfg = TrainConfig(
        data=str(image_folder), image_size=16, batch_size=8, workers=0, freeze_epochs=3,
        budget="1m", budget_recipe="fixed", output_dir=str(tmp_path / "r"), cache="off",
    )  # fmt: skip
    summary = train(cfg.validate())
    assert summary is not None and summary["epochs"] == 2
    said = [x for x in capsys.readouterr().out.splitlines() if "stays frozen" in x]
    assert said == [
        "--budget fits 2.0 epoch(s), not more than --freeze-epochs 3: the backbone stays "
        "frozen for the whole run"
    ]


def _plans_two_epochs(self, done: float) -> float | None:
    """A budget whose plan, made at the first step, is two epochs."""
    if self.planned is None:
        self.planned = 2.0
        return 2.0
    return None


RESNET_BLOCKS = [f"layer{s}.{b}" for s in range(1, 5) for b in range(2)]


def test_layer_decay_scales_each_block_by_its_depth_below_the_head():
    cfg = TrainConfig(model="resnet18", layer_decay=0.5, head_lr_mult=10.0)
    model = create_model("resnet18", 3)
    scales = optim_state.grouping(cfg, model).scales
    assert scales["fc.weight"] == scales["fc.bias"] == 10.0
    for depth, block in enumerate(reversed(RESNET_BLOCKS), start=1):  # layer4.1 is 1 below
        assert scales[f"{block}.conv1.weight"] == 0.5**depth, block
        assert scales[f"{block}.bn2.bias"] == 0.5**depth, block
    assert scales["conv1.weight"] == scales["bn1.weight"] == 0.5**9  # the stem: one layer


@pytest.mark.parametrize(
    ("model", "first", "last", "head"),
    [
        ("vit_b_16", "class_token", "encoder.layers.encoder_layer_11.ln_1.weight", "heads"),
        ("convnext_tiny", "features.0.0.weight", "features.7.2.block.0.weight", "classifier"),
        ("timm/vit_tiny_patch16_224", "cls_token", "blocks.11.attn.qkv.weight", "head"),
        ("timm/convnext_atto", "stem.0.weight", "stages.3.blocks.1.conv_dw.weight", "head.fc"),
    ],
)
def test_layer_decay_finds_the_blocks_of_vits_and_convnexts(model, first, last, head):
    cfg = TrainConfig(model=model, layer_decay=0.8)
    with torch.device("meta"):
        built = create_model(model, 3, 224)
    grouping = optim_state.grouping(cfg, built)
    assert grouping.head == head
    names = [n for n, _ in built.named_parameters()]
    scales = [grouping.scale(n) for n in names]
    assert all(a <= b for a, b in zip(scales, scales[1:], strict=False))  # towards the head
    assert grouping.scale(first) == min(scales) < grouping.scale(last) < 1.0
    assert max(s for n, s in zip(names, scales, strict=True) if not grouping.in_head(n)) < 1.0
    depth = round(torch.log(torch.tensor(min(scales))).item() / torch.log(torch.tensor(0.8)).item())
    assert depth >= 12  # a block per layer, not a stage per group


def test_the_schedule_sets_each_group_at_its_scale_and_checkpoints_keep_them():
    cfg = TrainConfig(model="resnet18", layer_decay=0.5, head_lr_mult=4.0, lr=0.1)
    stepper, model = _stepper(cfg)
    optimizer = stepper.optimizer
    assert len(optimizer.param_groups) == 10  # the stem, 8 blocks, the head
    Schedule(peak=0.1, epochs=2, kind="constant").apply(optimizer, 0.0)
    by_param = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    assert by_param[id(model.fc.weight)] == pytest.approx(0.4)
    assert by_param[id(model.layer4[1].conv1.weight)] == pytest.approx(0.05)
    assert by_param[id(model.conv1.weight)] == pytest.approx(0.1 * 0.5**9)
    assert base_lr(optimizer) == pytest.approx(0.1)
    saved = copy.deepcopy(optimizer.state_dict())
    again, _ = _stepper(cfg)
    again.optimizer.load_state_dict(saved)
    assert [g["lr_scale"] for g in again.optimizer.param_groups] == [
        g["lr_scale"] for g in optimizer.param_groups
    ]


def test_groups_by_kind_and_by_scale_index_alike_everywhere():
    cfg = TrainConfig(model="resnet18", layer_decay=0.7, norm_weight_decay=0.0)
    model = create_model("resnet18", 3)
    grouping = optim_state.grouping(cfg, model)
    groups = optim_state.named_groups(model, grouping)
    names = optim_state.trainable_names(model, grouping)
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert {kind for kind, _, _ in groups} == {"decay", "norm", "bias"}  # fc.bias
    for _kind, scale, members in groups:
        assert all(grouping.scale(n) == scale for n in members)
    # a stage holding only some groups' parameters takes only those
    stage = optim_state.by_index(
        {
            "state": {},
            "param_groups": [
                {"params": members, "kind": kind, "lr_scale": scale}
                for kind, scale, members in groups
            ],
        },
        [n for n in names if n.startswith("layer4")],
    )
    assert all(group["params"] for group in stage["param_groups"])


def test_the_fine_tune_recipe_is_a_fine_tune():
    recipe = read_recipe("fine-tune")
    cfg = resolve_train(
        {"data": "d", "model": "resnet34", "weights": "IMAGENET1K_V1"}, recipe=recipe
    )
    scratch = resolve_train({"data": "d", "model": "resnet34"})
    assert cfg.rate(2) < scratch.rate(2) and cfg.head_lr_mult > 1 and cfg.freeze_epochs >= 1
    assert (cfg.sched, cfg.warmup_epochs, cfg.label_smoothing) == ("cosine", 1, 0.1)
    assert cfg.val_resize == 256 and cfg.weights == "IMAGENET1K_V1"
