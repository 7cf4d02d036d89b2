"""Cutting models into stages: units, balance, split points, unified optimizer state."""

from __future__ import annotations

import itertools

import pytest
import torch
import torchvision
from torch import nn

from paratrain.errors import UserError
from paratrain.models.registry import create_model
from paratrain.parallel import fsdp, optim_state, partition


@pytest.mark.parametrize(
    "name",
    ["resnet18", "densenet121", "efficientnet_b0", "mobilenet_v3_small", "googlenet", "swin_t"],
)
def test_stages_chained_compute_the_model_and_share_its_state_dict(name):
    torch.manual_seed(0)
    model = create_model(name, 5, 64).eval()
    traced = partition.trace(model, name)
    assert len(traced.units) >= 8
    starts = partition.balance([float(u.parameters) for u in traced.units], 3)
    stages = partition.build_stages(traced, starts)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
        out = x
        for stage in stages:
            out = stage(out)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    keys = [set(stage.state_dict()) for stage in stages]
    assert set().union(*keys) == set(model.state_dict())  # the original names
    assert sum(len(k) for k in keys) == len(model.state_dict())  # each tensor in one stage
    assert sum(u.parameters for u in traced.units) == sum(p.numel() for p in model.parameters())


def test_resnet_units_are_its_blocks():
    traced = partition.trace(torchvision.models.resnet18(num_classes=5))
    assert traced.names == [
        "conv1",
        "bn1",
        "relu",
        "maxpool",
        "layer1.0",
        "layer1.1",
        "layer2.0",
        "layer2.1",
        "layer3.0",
        "layer3.1",
        "layer4.0",
        "layer4.1",
        "avgpool",
        "fc",
    ]


def test_vit_units_are_its_encoder_layers():
    model = create_model("vit_b_16", 5, 32)
    names = partition.trace(model).names
    layers = [n for n in names if n.startswith("encoder.layers.")]
    assert layers == [f"encoder.layers.encoder_layer_{i}" for i in range(12)]


def test_a_stage_may_begin_with_an_in_place_activation():
    """ResNet's ReLU after the stem is in place; a stage starting there gets a leaf input."""
    model = torchvision.models.resnet18(num_classes=5)
    traced = partition.trace(model)
    stages = partition.build_stages(traced, [0, traced.names.index("relu")])
    x = torch.randn(2, 3, 32, 32)
    middle = stages[0](x).detach().requires_grad_(True)
    stages[1](middle).sum().backward()  # would raise on an in-place op over a leaf
    assert middle.grad is not None


def _brute_force(costs, stages):
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = [0, *cuts, len(costs)]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_balance_minimises_the_slowest_stage(stages):
    generator = torch.Generator().manual_seed(stages)
    for _ in range(20):
        costs = (torch.rand(9, generator=generator) * 10).tolist()
        starts = partition.balance(costs, stages)
        assert starts[0] == 0 and starts == sorted(set(starts)) and len(starts) == stages
        bounds = [*starts, len(costs)]
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        assert worst == pytest.approx(_brute_force(costs, stages))


def test_balance_refuses_more_stages_than_units():
    with pytest.raises(UserError, match="only 2 units"):
        partition.balance([1.0, 2.0], 3)


def test_split_points_by_name_or_prefix_and_clear_errors():
    names = partition.trace(torchvision.models.resnet18(num_classes=5)).names
    assert partition.stage_starts(names, ["layer3"], 2) == [0, names.index("layer3.0")]
    assert partition.stage_starts(names, ["layer2.1", "fc"], 3) == [
        0,
        names.index("layer2.1"),
        names.index("fc"),
    ]
    with pytest.raises(UserError, match="3 stages need 2 split point"):
        partition.stage_starts(names, ["layer3"], 3)
    with pytest.raises(UserError, match="'layer9' does not begin a unit"):
        partition.stage_starts(names, ["layer9"], 2)
    with pytest.raises(UserError, match="in model order"):
        partition.stage_starts(names, ["layer4", "layer2"], 3)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: fx cannot trace it
            return self.a(x)
        return x


def test_an_untraceable_model_is_a_user_error():
    with pytest.raises(UserError, match="branchy cannot be cut into stages"):
        partition.trace(Branchy(), "branchy")


def test_planning_leaves_weights_buffers_and_random_state_alone():
    model = torchvision.models.resnet18(num_classes=5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(2, 3, 32, 32)
    torch.manual_seed(7)
    traced, starts = partition.plan_stages(model, 2, sample)
    after_rng = torch.rand(1)
    torch.manual_seed(7)
    assert torch.equal(after_rng, torch.rand(1))
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(u.seconds > 0 for u in traced.units)
    assert sum(u.activation_bytes for u in traced.units) > 0
    plans = partition.describe(traced, starts)
    assert sum(p.time_share for p in plans) == pytest.approx(1.0)
    text = partition.format_plan(plans, ["cpu", "cpu"], 2)
    assert "stage 0 on cpu: conv1 .. " in text and "stage 1 on cpu:" in text


def test_optimizer_state_round_trips_through_names_and_merges_stages():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    names = optim_state.trainable_names(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 2)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    named = optim_state.by_name(state, names)
    assert set(named["state"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    first = optim_state.by_index(named, names[:2])  # a stage's share
    second = optim_state.by_index(named, names[2:])
    assert sorted(first["state"]) == [0, 1] and first["param_groups"][0]["params"] == [0, 1]
    merged = optim_state.merge_named(
        [optim_state.by_name(first, names[:2]), optim_state.by_name(second, names[2:])], names
    )
    back = optim_state.by_index(merged, names)
    assert back["param_groups"][0]["params"] == [0, 1, 2, 3]
    for index, value in state["state"].items():
        assert torch.equal(back["state"][index]["momentum_buffer"], value["momentum_buffer"])


def test_fsdp_units_are_the_blocks_inside_containers():
    model = torchvision.models.resnet18(num_classes=5)
    blocks = fsdp.blocks(model)
    assert blocks == [*model.layer1, *model.layer2, *model.layer3, *model.layer4]


def test_balance_keeps_every_stage_within_the_device_memory():
    costs = [1.0, 1.0, 1.0, 1.0, 4.0, 3.0]
    sizes = [10.0, 10.0, 10.0, 10.0, 1.0, 1.0]
    assert partition.balance(costs, 2) == [0, 4]  # by time alone 4 | 7, but 40 bytes | 2
    fitted = partition.balance(costs, 2, sizes, limit=25.0)
    bounds = [*fitted, len(costs)]
    groups = list(itertools.pairwise(bounds))
    assert all(sum(sizes[a:b]) <= 25.0 for a, b in groups)
    assert fitted == [0, 2]  # 20 bytes | 22 bytes: the fastest cut that fits
    with pytest.raises(UserError, match="no cut into 2 stages fits"):
        partition.balance(costs, 2, sizes, limit=15.0)


def test_training_bytes_count_weights_gradients_optimizer_and_scaled_activations():
    model = torchvision.models.resnet18(num_classes=5)
    traced, _ = partition.plan_stages(model, 2, partition.sample_images(32, 2))
    sizes = partition.training_bytes(traced, batch=8, slots=1)
    for unit, size in zip(traced.units, sizes, strict=True):
        assert size == pytest.approx(3 * unit.parameter_bytes + 4 * unit.activation_bytes)
