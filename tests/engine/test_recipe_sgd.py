"""SGD over channels_last weights in their storage order: exactly torch's SGD."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision

from paratrain.engine.run.recipe import StorageOrderSGD
from paratrain.parallel.parts import ModelParts


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=3).to(memory_format=torch.channels_last)


def _steps(model, optimizer, steps: int = 3) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
        loss = model(x).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("nesterov", [False, True])
def test_same_weights_and_state_as_torch_sgd(fused, nesterov):
    reference, model = _model(), _model()
    options = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=nesterov, fused=fused)
    _steps(reference, torch.optim.SGD(reference.parameters(), **options))
    optimizer = StorageOrderSGD(model.parameters(), **options)
    _steps(model, optimizer)
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
        assert a.stride() == b.stride()  # still channels_last
    state = optimizer.state_dict()["state"]
    assert len(state) == len(list(model.parameters()))
    conv = next(i for i, p in enumerate(model.parameters()) if p.dim() == 4)
    buffer = state[conv]["momentum_buffer"]
    assert buffer.shape == next(p for p in model.parameters() if p.dim() == 4).shape
    assert buffer.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("fused", [True, False])
def test_without_momentum_it_steps_as_torch_sgd(fused):
    """--momentum 0: SGD keeps no buffers (once a zip over none stopped the first step)."""
    reference, model = _model(), _model()
    options = dict(lr=0.1, momentum=0.0, weight_decay=1e-3, fused=fused)
    _steps(reference, torch.optim.SGD(reference.parameters(), **options))
    optimizer = StorageOrderSGD(model.parameters(), **options)
    _steps(model, optimizer)
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_resuming_contiguous_optimizer_state_into_channels_last_weights(name):
    """A pipeline's or fsdp's checkpoint (contiguous) resumed by a channels_last run:
    torch's fused kernels read such mixed layouts in different orders, so loading lays
    the state out as its parameter and the step equals the uninterrupted run's."""
    reference, model = _model(), _model()

    def build(params):
        if name == "adamw":
            return torch.optim.AdamW(params, lr=0.01, fused=True)
        return StorageOrderSGD(params, lr=0.1, momentum=0.9, fused=True)

    uninterrupted = build(reference.parameters())
    _steps(reference, uninterrupted, 2)
    saved = copy.deepcopy(uninterrupted.state_dict())
    for entry in saved["state"].values():  # as a contiguous run would have saved them
        for key, value in entry.items():
            if value.dim() == 4:
                entry[key] = value.contiguous()
    assert any(
        not v.is_contiguous(memory_format=torch.channels_last)
        for e in saved["state"].values()
        for v in e.values()
        if v.dim() == 4
    )
    model.load_state_dict(reference.state_dict())
    optimizer = build(model.parameters())
    ModelParts([model]).load_optimizer_state_dict(optimizer, saved)
    _steps(reference, uninterrupted, 1)
    _steps(model, optimizer, 1)
    for a, b in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
