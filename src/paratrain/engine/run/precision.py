"""--precision: autocast dtype, and a GradScaler for float16 (the mode itself is chosen
by distributed/runtime.resolve_precision, where the device is chosen)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from paratrain.config import TrainConfig
from paratrain.distributed.runtime import Runtime, resolve_precision
from paratrain.errors import UserError
from paratrain.models import cpu_bf16


class Precision:
    def __init__(self, mode: str, device: torch.device):
        self.mode, self.device = mode, device
        self.dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(mode)
        self.scaler = torch.amp.GradScaler("cuda") if mode == "16-mixed" else None

    def prepare(self, parts: Iterable[torch.nn.Module]) -> None:
        """On CPU under bf16 autocast, a convolution that strides over a 1-pixel input
        runs in fp32 (models/cpu_bf16 says why); only such ones, since fp32 for every
        small one cost 13-20% at 64 px. CUDA is left alone."""
        if self.dtype is None or self.device.type == "cuda" or not cpu_bf16.affected():
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
        else:  # read by the optimizer's step (engine/run/recipe.StorageOrderSGD), like a scaler's
            setattr(optimizer, "found_inf", found_inf.float().reshape(()))  # noqa: B010
            try:
                optimizer.step()
            finally:
                delattr(optimizer, "found_inf")


def build(cfg: TrainConfig, runtime: Runtime) -> Precision:
    """``--precision`` resolved for this process's device; an impossible choice fails
    alike on every rank (the same device type everywhere) and rank 0 tells it."""
    from paratrain.errors import AgreedUserError

    try:
        return Precision(resolve_precision(cfg.precision, runtime.device), runtime.device)
    except UserError as exc:
        raise AgreedUserError(str(exc)) from None


_PAUSED: dict[int, torch.autocast] = {}  # module id -> the autocast it paused


def _fp32_when_strided_over_one_pixel(module: torch.nn.modules.conv._ConvNd, args: tuple):
    x = args[0]
    if not torch.is_autocast_enabled(x.device.type) or not cpu_bf16.strided_over_one_pixel(
        module, x
    ):
        return None
    paused = torch.autocast(x.device.type, enabled=False)
    paused.__enter__()
    _PAUSED[id(module)] = paused
    return (x.float(), *args[1:])


def _restore_autocast(module: torch.nn.Module, _args: tuple, _output) -> None:
    paused = _PAUSED.pop(id(module), None)
    if paused is not None:
        paused.__exit__(None, None, None)
