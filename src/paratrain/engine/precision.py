"""--precision: autocast dtype, and a GradScaler for float16.

auto picks bf16 autocast where the device computes bf16 natively — CUDA devices that
support it, CPUs with AVX512-BF16 or AMX (read from /proc/cpuinfo) — and fp32 elsewhere,
where emulated bf16 would be slower than fp32.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

import torch

from paratrain.errors import UserError

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.is_file() else ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def resolve(requested: str, device: torch.device, cpuinfo: str | None = None) -> str:
    """The precision to train in: the requested one, or auto's choice for this device."""
    if requested == "16-mixed" and device.type != "cuda":
        raise UserError(
            "--precision 16-mixed needs CUDA (float16 with a GradScaler); "
            "on CPU use bf16-mixed or 32"
        )
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "32"
    return "bf16-mixed" if cpu_has_native_bf16(cpuinfo) else "32"


class Precision:
    def __init__(self, mode: str, device: torch.device):
        self.mode, self.device = mode, device
        self.dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(mode)
        self.scaler = torch.amp.GradScaler("cuda") if mode == "16-mixed" else None

    def prepare(self, parts: Iterable[torch.nn.Module]) -> None:
        """On CPU, BatchNorm under autocast computes in its input's dtype, so in bf16 its
        batch statistics carry 8 bits of mantissa: at 1x1 spatial size (16 px into a
        ResNet) the variance of a few values collapses and training diverges (measured:
        the default digits job hit a NaN loss in epoch 6). Normalization layers therefore
        take fp32 input there, as mixed-precision recipes keep BatchNorm in fp32; the
        convolutions around them still run in bf16. CUDA's batch norm computes its
        statistics in fp32 from low-precision input already."""
        if self.dtype is None or self.device.type == "cuda":
            return
        for part in parts:
            for module in part.modules():
                if isinstance(module, torch.nn.modules.batchnorm._NormBase):
                    module.register_forward_pre_hook(_to_fp32)

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()


# Below this many values per channel (batch x height x width), a bf16 batch's statistics
# are too coarse; above it the fp32 casts would cost more (ResNet-18 at 128 px, all
# BatchNorms in fp32: 16% slower forward+backward on this CPU) than they buy.
FP32_NORM_BELOW = 4096


def _to_fp32(_module: torch.nn.Module, args: tuple) -> tuple:
    x = args[0]
    if x.dtype in (torch.bfloat16, torch.float16) and x.numel() // x.shape[1] < FP32_NORM_BELOW:
        return (x.float(), *args[1:])
    return args
