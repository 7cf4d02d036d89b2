"""Convolutions over tiny feature maps as one matrix product, on CPU.

Where a convolution's output is 2x2 pixels or smaller (ResNet's layer4 at 64 px, its
layer3 and layer4 at 32 px and below), or 4x4 with 512 channels or more (layer4 at 128
px), the CPU convolution kernels are far below their usual speed; unfolding the input
(im2col) and multiplying by the weight matrix does the same arithmetic several times
faster. Measured on a 2-core AMX CPU, forward + backward of a 3x3 convolution, batch
16: 512->512 channels at 2x2, 10.1 ms as a convolution, 4.8 ms as a product (bf16; 16.4
vs 8.1 ms in fp32); 256->512 at stride 2 onto 2x2, 4.8 vs 2.7 ms; but 256->256 at 4x4,
2.6 vs 2.6 ms and at 8x8 4.9 vs 9.6 — hence the limits in ``takes_product``. The weights
and state dict are the module's own; only how its forward computes changes.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

MAX_OUTPUT_PIXELS = 4
WIDE_CHANNELS, WIDE_MAX_OUTPUT_PIXELS = 512, 16


def _output_size(size: int, kernel: int, stride: int, padding: int) -> int:
    return (size + 2 * padding - kernel) // stride + 1


def _padding(conv: nn.Conv2d) -> tuple[int, int]:
    """A convolution's padding in pixels (``eligible`` leaves out "same" and "valid")."""
    padding = conv.padding
    if isinstance(padding, str):
        raise ValueError(f"padding {padding!r} is not in pixels")
    return padding[0], padding[1]


def as_matrix_product(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """``conv(x)`` computed as unfold @ weight, in ``x``'s memory format.

    The columns are ordered as the weight lies in memory, so the weight enters the
    product as a view: a channels_last weight (as ``--memory-format`` makes it) read in
    (C, kh, kw) order would be gathered anew at every forward, and its gradient scattered
    back at every backward — for ResNet's 512x512 convolutions that cost more than the
    product itself (measured: 30 of a 60 ms step at 64 px)."""
    n, _, height, width = x.shape
    ph, pw = _padding(conv)
    rows = _output_size(height, conv.kernel_size[0], conv.stride[0], ph)
    columns = _output_size(width, conv.kernel_size[1], conv.stride[1], pw)
    weight = conv.weight
    if weight.is_contiguous():  # (C, kh, kw) order: torch's unfold
        cols = F.unfold(x, conv.kernel_size, padding=(ph, pw), stride=conv.stride)
        cols = cols.transpose(1, 2).reshape(-1, cols.shape[1])
        matrix = weight.reshape(conv.out_channels, -1)
    else:  # channels_last weight: (kh, kw, C) order, patches cut from the NHWC input
        (kh, kw), (sh, sw) = conv.kernel_size, conv.stride
        nhwc = F.pad(x.permute(0, 2, 3, 1), (0, 0, pw, pw, ph, ph))
        patches = nhwc.unfold(1, kh, sh).unfold(2, kw, sw)  # n, rows, columns, C, kh, kw
        cols = patches.permute(0, 1, 2, 4, 5, 3).reshape(n * rows * columns, -1)
        matrix = weight.permute(0, 2, 3, 1).reshape(conv.out_channels, -1)
    out = cols @ matrix.t()
    if conv.bias is not None:
        out = out + conv.bias
    out = out.view(n, rows, columns, conv.out_channels).permute(0, 3, 1, 2)
    return out.contiguous() if x.is_contiguous() else out  # the input's memory format


def takes_product(pixels: int, out_channels: int, x: torch.Tensor) -> bool:
    """Whether the product beats the convolution kernel for this output, as measured
    (forward + backward, 3x3, 2 threads; batches 4, 16 and 64 alike): always at 2x2 and
    below; at up to 4x4 for 512 or more output channels — 512->512 at 4x4, batch 16:
    11.7 -> 6.4 ms channels_last bf16, 16.6 -> 13.9 fp32, 10.0 -> 6.5 contiguous bf16 —
    except contiguous fp32, where the kernel is faster (11.7 vs 14.0 ms); 256 channels
    at 4x4 gain nothing (2.6 vs 2.6 ms)."""
    if pixels <= MAX_OUTPUT_PIXELS:
        return True
    if pixels > WIDE_MAX_OUTPUT_PIXELS or out_channels < WIDE_CHANNELS:
        return False
    return torch.is_autocast_enabled("cpu") or not x.is_contiguous()


def _forward(self: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 4:
        ph, pw = _padding(self)
        rows = _output_size(x.shape[2], self.kernel_size[0], self.stride[0], ph)
        columns = _output_size(x.shape[3], self.kernel_size[1], self.stride[1], pw)
        if takes_product(rows * columns, self.out_channels, x):
            return as_matrix_product(x, self)
    return self._conv_forward(x, self.weight, self.bias)


def eligible(module: nn.Module) -> bool:
    """Plain 2-D convolutions with a kernel larger than 1x1 (a 1x1 one is a product
    already) and zero padding given in pixels."""
    return (
        type(module) is nn.Conv2d
        and module.groups == 1
        and module.dilation == (1, 1)
        and module.padding_mode == "zeros"
        and not isinstance(module.padding, str)
        and module.kernel_size != (1, 1)
    )


def apply(model: nn.Module) -> int:
    """Give every eligible convolution the small-map path; returns how many."""
    count = 0
    for module in model.modules():
        if eligible(module):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count
