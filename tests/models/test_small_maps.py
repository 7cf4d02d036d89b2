"""Convolutions over tiny maps computed as one matrix product: same values, same grads."""

from __future__ import annotations

import copy

import pytest
import torch
import torchvision
from torch import nn

from paratrain.models import small_maps


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize(
    "cin, cout, size, stride, padding, bias",
    [
        (64, 32, 2, 1, 1, False),
        (32, 64, 4, 2, 1, True),
        (16, 16, 1, 1, 1, True),
        (8, 8, 3, 2, 0, False),
        (8, 4, 4, 3, 1, True),
    ],
)
def test_small_map_product_equals_the_convolution(cin, cout, size, stride, padding, bias, fmt):
    """Both column orders: (C, kh, kw) for contiguous weights, (kh, kw, C) for
    channels_last ones (each the order the weight lies in memory)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(cin, cout, 3, stride, padding, bias=bias).double().to(memory_format=fmt)
    fast = copy.deepcopy(conv)
    assert small_maps.apply(fast) == 1
    x = torch.randn(5, cin, size, size, dtype=torch.float64).contiguous(memory_format=fmt)
    x.requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    expected, got = conv(x), fast(x2)
    assert got.shape == expected.shape and got.shape[2] * got.shape[3] <= 4
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fast.weight.grad, conv.weight.grad, rtol=1e-12, atol=1e-12)
    assert fast.weight.grad.stride() == fast.weight.stride()  # no copy to the parameter's layout
    if bias:
        torch.testing.assert_close(fast.bias.grad, conv.bias.grad, rtol=1e-12, atol=1e-12)


def test_the_output_keeps_the_input_memory_format():
    conv = nn.Conv2d(8, 8, 3, padding=1)
    small_maps.apply(conv)
    x = torch.randn(2, 8, 2, 2)
    assert conv(x).is_contiguous()
    channels_last = conv(x.contiguous(memory_format=torch.channels_last))
    assert channels_last.is_contiguous(memory_format=torch.channels_last)


def test_larger_maps_take_the_convolution_itself():
    conv = nn.Conv2d(4, 4, 3, padding=1)
    small_maps.apply(conv)
    x = torch.randn(2, 4, 8, 8)
    assert torch.equal(conv(x), conv._conv_forward(x, conv.weight, conv.bias))


def test_only_plain_convolutions_change_and_the_state_dict_does_not():
    model = torchvision.models.mobilenet_v3_small(num_classes=3)
    before = list(model.state_dict())
    changed = small_maps.apply(model)
    plain = [m for m in model.modules() if small_maps.eligible(m)]
    assert changed == len(plain) > 0
    assert all(m.groups == 1 and m.kernel_size != (1, 1) for m in plain)
    assert not any(
        "forward" in vars(m) for m in model.modules() if isinstance(m, nn.Conv2d) and m.groups > 1
    )
    assert list(model.state_dict()) == before
    copied = copy.deepcopy(model)  # EMA copies the model: the copy computes with its own weights
    conv = next(m for m in copied.modules() if small_maps.eligible(m))
    assert conv.forward.__self__ is conv


def test_which_outputs_take_the_product():
    channels_last = torch.randn(2, 8, 4, 4).contiguous(memory_format=torch.channels_last)
    contiguous = torch.randn(2, 8, 4, 4)
    assert small_maps.takes_product(4, 64, contiguous)  # 2x2: always
    assert small_maps.takes_product(16, 512, channels_last)  # 4x4, wide
    assert not small_maps.takes_product(16, 256, channels_last)  # 4x4, narrower
    assert not small_maps.takes_product(25, 512, channels_last)  # 5x5
    assert not small_maps.takes_product(16, 512, contiguous)  # the kernel wins in fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert small_maps.takes_product(16, 512, contiguous)


def test_a_wide_4x4_convolution_takes_the_product_and_equals_the_convolution(monkeypatch):
    torch.manual_seed(0)
    conv = nn.Conv2d(256, 512, 3, padding=1).double().to(memory_format=torch.channels_last)
    fast = copy.deepcopy(conv)
    small_maps.apply(fast)
    x = torch.randn(2, 256, 4, 4, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    calls = []
    real = small_maps.as_matrix_product
    monkeypatch.setattr(small_maps, "as_matrix_product", lambda *a: calls.append(1) or real(*a))
    got = fast(x)
    assert calls == [1]
    torch.testing.assert_close(got, conv(x), rtol=1e-12, atol=1e-12)
