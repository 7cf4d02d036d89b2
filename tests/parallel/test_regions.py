"""parallel/regions: a model's repeated blocks, checkpointed and compiled in place.

Checkpointing changes what autograd keeps, never what a step computes: the gradients
and BatchNorm's running statistics are those of the step without it, bit for bit, on
one process and under fsdp on two; the bytes saved for backward fall."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torchvision

from paratrain.parallel import regions
from spawn import run_distributed


@pytest.mark.parametrize(
    ("name", "count", "first", "kind"),
    [
        ("resnet18", 8, "layer1.0", "BasicBlock"),
        ("resnet50", 16, "layer1.0", "Bottleneck"),
        ("vit_b_16", 12, "encoder.layers.encoder_layer_0", "EncoderBlock"),
        ("convnext_tiny", 18, "features.1.0", "CNBlock"),
    ],
)
def test_the_repeated_blocks_are_the_residual_and_encoder_blocks(name, count, first, kind):
    found = regions.repeated_blocks(torchvision.models.get_model(name))
    assert len(found) == count and found[0][0] == first
    assert {type(block).__name__ for _, block in found} == {kind}


def _saved_bytes(model: torch.nn.Module, x: torch.Tensor) -> int:
    """What autograd keeps for backward during the forward (distinct storages)."""
    seen: dict[int, int] = {}

    def pack(tensor):
        seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in weights), out


def test_checkpointed_blocks_give_the_same_step_and_keep_a_fraction_of_the_activations():
    torch.manual_seed(0)
    plain = torchvision.models.resnet50(num_classes=5)
    checkpointed = copy.deepcopy(plain)
    regions.checkpoint_activations(regions.repeated_blocks(checkpointed))
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 5, (4,))
    kept = {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        kept[name], out = _saved_bytes(model, x)
        torch.nn.functional.cross_entropy(out, y).backward()
    assert kept["checkpointed"] < 0.5 * kept["plain"]  # 0.36 here: the stem is kept whole
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    states = plain.state_dict(), checkpointed.state_dict()
    assert list(states[0]) == list(states[1])  # no wrapper in any name
    for key, value in states[0].items():  # running statistics moved once, not twice
        assert torch.equal(value, states[1][key]), key


def _fsdp_step(rank: int, world: int, checkpointing: bool) -> dict:
    from paratrain.config import TrainConfig
    from paratrain.distributed.env import detect
    from paratrain.distributed.runtime import Runtime
    from paratrain.models.registry import build_model
    from paratrain.parallel.parallelize import parallelize

    cfg = TrainConfig(
        model="resnet18", image_size=32, precision="32", strategy="fsdp",
        activation_checkpointing=checkpointing, memory_format="contiguous",
    )  # fmt: skip
    runtime = Runtime(env=detect(os.environ), device=torch.device("cpu"), backend="gloo")
    parts = parallelize(build_model(cfg, 4), cfg, runtime)
    torch.manual_seed(rank)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 4, (4,))
    torch.nn.functional.cross_entropy(parts(x), y).backward()
    grads = {n: p.grad.full_tensor() for n, p in parts[0].named_parameters()}
    return {"grads": grads, "state": parts.state_dict()}


@pytest.mark.slow
def test_checkpointed_blocks_under_fsdp_give_the_same_gradients_and_statistics():
    plain = run_distributed(_fsdp_step, 2, False)[0]
    checkpointed = run_distributed(_fsdp_step, 2, True)[0]
    assert plain["grads"].keys() == checkpointed["grads"].keys()
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(checkpointed["grads"][name], grad, rtol=0, atol=0, msg=name)
    for key, value in plain["state"].items():
        torch.testing.assert_close(checkpointed["state"][key], value, rtol=0, atol=0, msg=key)
