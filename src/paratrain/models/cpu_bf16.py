"""Where bf16 on a CPU goes wrong: strided convolutions over a 1-pixel input.

Under bf16 on a CPU, a strided convolution over a 1-pixel input (the 1x1 maps reaching
ResNet's layer4 at 16 px, 3x3 kernel, stride 2) gets a weight gradient with garbage,
even inf, at the taps that see only padding (torch 2.14.1, measured on an AMX CPU: 29 of
30 tries off by more than 5% of fp32's; 0 of 30 for 1x1 at stride 1 or 2x2 and 3x3 at
stride 1 or 2; 24 of 30 on an AVX512-BF16 CPU without AMX). Such convolutions run in fp32 (engine/run/precision, parallel/fsdp). The
smallest reproduction is tests/upstream/test_upstream_cpu.py, marked xfail(strict=True).
"""

from __future__ import annotations

import torch
from torch import nn

# The torch release that no longer computes the garbage; None while every release does
# (the xfail(strict=True) reproduction says when to set it).
FIXED_IN: tuple[int, int] | None = None


def affected(torch_version: str | None = None) -> bool:
    """Whether this torch still needs the fp32 detour."""
    if FIXED_IN is None:
        return True
    version = torch_version or torch.__version__
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    return (major, minor) < FIXED_IN


def strided_over_one_pixel(module: nn.modules.conv._ConvNd, x: torch.Tensor) -> bool:
    """Whether convolution ``module`` on ``x`` strides over a 1-pixel side."""
    return any(
        size == 1 and kernel > 1 and stride > 1
        for size, kernel, stride in zip(x.shape[2:], module.kernel_size, module.stride, strict=True)
    )


def convolutions_over_one_pixel(model: nn.Module, image_size: int) -> set[str]:
    """The names of the convolutions that stride over a 1-pixel input when ``model``
    takes ``image_size``-pixel images: one forward of two images, on the model's own
    device (the meta device computes shapes only), in eval mode, without gradients."""
    found: set[str] = set()
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd):

            def look(mod: nn.modules.conv._ConvNd, args: tuple, name: str = name) -> None:
                if strided_over_one_pixel(mod, args[0]):
                    found.add(name)

            hooks.append(module.register_forward_pre_hook(look))
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(torch.zeros(2, 3, image_size, image_size, device=device))
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
    return found
