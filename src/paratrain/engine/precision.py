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

from paratrain.config import TrainConfig
from paratrain.distributed.runtime import Runtime
from paratrain.errors import UserError

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX): where bf16 autocast is faster than fp32."""
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
        """On CPU under bf16 autocast, a strided convolution over a 1-pixel input (the 1x1
        maps reaching ResNet's layer4 at 16 px, 3x3 kernel, stride 2) gets a weight
        gradient with garbage, even inf, at the taps that see only padding (torch 2.14.1,
        measured on an AMX CPU: 29 of 30 tries off by more than 5% of fp32's; 0 of 30 for
        1x1 at stride 1 or 2x2 and 3x3 at stride 1 or 2). Such convolutions run in fp32
        there; only they, since fp32 for every small one cost 13-20% at 64 px. CUDA is
        left alone."""
        if self.dtype is None or self.device.type == "cuda":
            return
        for part in parts:
            for module in part.modules():
                if isinstance(module, torch.nn.modules.conv._ConvNd):
                    module.register_forward_pre_hook(_fp32_when_strided_over_one_pixel)
                    module.register_forward_hook(_restore_autocast, always_call=True)

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's autocast context (nothing under fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward, through the GradScaler under 16-mixed."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradients back to their true scale before clipping (16-mixed)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor | None = None) -> None:
        """The optimizer step. Under 16-mixed the GradScaler hands the scale and its inf
        check to torch's fused SGD/AdamW kernels, so nothing is read back to the host.
        ``found_inf`` (a device flag, > 0 to skip) goes the same way to a fused kernel,
        which then leaves weights and optimizer state as they were; not with a scaler."""
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        elif found_inf is None:
            optimizer.step()
        else:
            optimizer.found_inf = found_inf.float().reshape(())
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf


def build(cfg: TrainConfig, runtime: Runtime) -> Precision:
    """``--precision`` resolved for this process's device; an impossible choice fails
    alike on every rank (the same device type everywhere) and rank 0 tells it."""
    from paratrain.errors import AgreedUserError

    try:
        return Precision(resolve(cfg.precision, runtime.device), runtime.device)
    except UserError as exc:
        raise AgreedUserError(str(exc)) from None


def _fp32_when_strided_over_one_pixel(module: torch.nn.Module, args: tuple):
    x = args[0]
    if not torch.is_autocast_enabled(x.device.type) or not any(
        size == 1 and k > 1 and s > 1
        for size, k, s in zip(x.shape[2:], module.kernel_size, module.stride, strict=True)
    ):
        return None
    module._paratrain_autocast = torch.autocast(x.device.type, enabled=False)
    module._paratrain_autocast.__enter__()
    return (x.float(), *args[1:])


def _restore_autocast(module: torch.nn.Module, _args: tuple, _output) -> None:
    context = module.__dict__.pop("_paratrain_autocast", None)
    if context is not None:
        context.__exit__(None, None, None)
