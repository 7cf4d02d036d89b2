"""ModelParts: the model as a list of modules, whatever the strategy made of it.

One module for data parallelism (plain, DDP, DataParallel, FSDP), one per stage for model
partitioning. The loop, checkpointing and evaluation talk only to this list, so every
strategy shares them. Everything a caller needs to know (where inputs go, how many model
copies there are, which copy this process is) is given when the parts are constructed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from paratrain.parallel.layout import Layout
from paratrain.parallel.optim_state import Grouping


class StepPrecision(Protocol):
    """What a forward and backward need of the run's precision (engine.precision)."""

    def autocast(self) -> contextlib.AbstractContextManager: ...

    def backward(self, loss: torch.Tensor) -> None: ...


def memory_format_for(
    model: nn.Module, requested: str, device: torch.device | None = None
) -> torch.memory_format:
    """auto: channels_last for convolutional models, on any ``device`` (NHWC suits both
    cuDNN's tensor-core kernels and oneDNN's CPU convolutions), contiguous for the rest. Measured with
    `paratrain bench --batch-size 16 --memory-format ...` on a 2-core CPU, ResNet-18,
    bf16: 149.6 vs 107.5 images/s at 128 px, 319.1 vs 264.0 at 64 px (channels_last vs
    contiguous)."""
    if requested == "channels_last":
        return torch.channels_last
    if requested == "contiguous":
        return torch.contiguous_format
    # convolutional: most weights in Conv2d layers (a ViT's one patch-embedding conv is not)
    in_conv = sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, nn.Conv2d)
        for p in m.parameters(recurse=False)
    )
    convolutional = in_conv > 0.5 * sum(p.numel() for p in model.parameters())
    return torch.channels_last if convolutional else torch.contiguous_format


class ModelParts(list):
    """The model as a list of modules, with where they run and which rank reads what.

    ``devices``: one device per module (default: where each module's parameters are);
    inputs go to the first, labels meet the logits on the last. ``layout``: which rank
    is which (parallel/base.Layout): ``replicas`` ranks read different batches (the world
    size, except that a pipeline's stages together read one), this rank is ``replica``.
    """

    fixed_batch = False  # True where every training batch must have the full size
    collective_state = False  # True where gathering the state needs every rank
    # True where a forward is itself a collective (FSDP all-gathers each unit's
    # parameters): every rank must then make the same number of forward calls
    collective_forward = False
    fused_optimizer = True  # False where torch's fused optimizer kernels cannot run (DTensor)
    grouping: Grouping | None = None  # the optimizer's groups, made from the whole model

    def __init__(
        self,
        modules: Iterable[nn.Module],
        *,
        devices: Sequence[torch.device] | None = None,
        layout: Layout | None = None,
        memory_format: torch.memory_format = torch.contiguous_format,
    ):
        super().__init__(modules)
        if devices is None:  # where the modules are
            devices = [_device_of(module) for module in self]
        if len(devices) == 1 and len(self) > 1:
            devices = list(devices) * len(self)
        if len(devices) != len(self):
            raise ValueError(f"{len(self)} module(s) but {len(devices)} device(s)")
        self.devices = list(devices)
        self.layout = layout or Layout()
        self.memory_format = memory_format

    @property
    def replicas(self) -> int:
        """Ranks reading different batches: what the global batch is a multiple of."""
        return self.layout.dp_size

    @property
    def replica(self) -> int:
        """Which of them this rank is."""
        return self.layout.dp_rank

    @property
    def input_device(self) -> torch.device:
        """Where the images go: the first part's device."""
        return self.devices[0]

    @property
    def output_device(self) -> torch.device:
        """Where the logits come out, and the labels go: the last part's device."""
        return self.devices[-1]

    def with_modules(self, modules: Iterable[nn.Module]) -> ModelParts:
        """The same placement around other modules (torch.compile's wrappers)."""
        parts = ModelParts(
            modules, devices=self.devices, layout=self.layout, memory_format=self.memory_format
        )
        parts.grouping = self.grouping
        return parts

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The parts' forward, each on its device (a pipeline stage before the last:
        None)."""
        out = inputs
        for device, part in zip(self.devices, self, strict=True):
            out = part(out.to(device, non_blocking=True))
        return out

    def forward_backward(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        precision: StepPrecision,
        divisor: float,
        lap: Callable[[str], None] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One micro-batch's forward and backward; its loss and logits (None where this
        process does not produce them). The loss's gradient is divided by ``divisor``
        (infinite: a stand-in's, weighted zero);
        ``lap("forward")`` is called between the two (bench times them)."""
        from paratrain.models.registry import logits_of  # torchvision: where a model runs

        with precision.autocast():
            logits = logits_of(self(images))
            loss = criterion(logits, targets)
        if lap is not None:
            lap("forward")
        precision.backward(loss / divisor)
        return loss.detach(), logits.detach()

    def after_backward(self) -> None:
        """Called once the step's gradients are complete, before the optimizer step."""

    def agree_buffers(self) -> None:
        """Before evaluating and saving: every copy of the model takes the first copy's
        buffers (BatchNorm statistics), so the sharded evaluation and the checkpoint see
        one model. DDP is built without its own broadcast at every forward
        (parallel/ddp.data_parallel): that broadcast ran in evaluation forwards too, a
        collective that a rank whose exact shard holds no batch never joins."""
        if self.replicas == 1:
            return
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            for buffer in self.buffers():
                dist.broadcast(buffer, src=0)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Indexed like a single-device optimizer over the whole model's parameters."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """A single-device-layout optimizer state, with this optimizer's own implementation flags and each tensor laid out as its parameter."""
        from paratrain.parallel.optim_state import load_optimizer, own_implementation

        load_optimizer(optimizer, own_implementation(state, optimizer))

    def sharded_state(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, torch.Tensor], list[dict]]:
        """What this rank holds of the model and optimizer, as flat tensors, and the
        optimizer's param groups by parameter name: what a sharded checkpoint saves and
        loads into. Only strategies whose state is spread over ranks (collective_state)
        save sharded."""
        raise NotImplementedError(f"{type(self).__name__} saves single-file checkpoints")

    def load_sharded_state(
        self, optimizer: torch.optim.Optimizer, flat: dict[str, torch.Tensor], groups: list
    ) -> None:
        """Take the tensors :meth:`sharded_state` returned, filled from a checkpoint."""
        raise NotImplementedError(f"{type(self).__name__} saves single-file checkpoints")

    def gather_groups(self, groups: list[dict]) -> list[dict]:
        """The whole model's param groups from every rank's (a collective where each rank
        holds a part of the model)."""
        return groups

    @property
    def training(self) -> bool:
        """Whether every part is in training mode."""
        return all(part.training for part in self)

    def train(self, mode: bool = True) -> ModelParts:
        """Every part to training (or eval) mode."""
        for part in self:
            part.train(mode)
        return self

    def eval(self) -> ModelParts:
        """Every part to eval mode."""
        return self.train(False)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Gradients stay local (DDP's no_sync) until the step that leaves this context."""
        stack = contextlib.ExitStack()
        for part in self:
            ddp = getattr(part, "_orig_mod", part)  # under torch.compile
            if isinstance(ddp, nn.parallel.DistributedDataParallel):
                stack.enter_context(ddp.no_sync())
        return stack

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every part's parameters, in order: what the optimizer gets."""
        for part in self:
            yield from part.parameters()

    def buffers(self) -> Iterator[torch.Tensor]:
        """Every part's buffers (BatchNorm statistics)."""
        for part in self:
            yield from part.buffers()

    def unwrapped(self) -> list[nn.Module]:
        """The modules without DDP/DataParallel/compile wrappers: what state dicts are taken from."""
        return [unwrap(part) for part in self]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """One unified, unwrapped state dict (no ``module.`` or ``_orig_mod.`` prefixes)."""
        state: dict[str, torch.Tensor] = {}
        for part in self.unwrapped():
            state.update({k: v.detach().cpu() for k, v in part.state_dict().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """A whole-model state dict into the parts: each takes its own keys, strictly."""
        for part in self.unwrapped():
            own = part.state_dict().keys()
            part.load_state_dict({k: v for k, v in state.items() if k in own}, strict=True)


def _device_of(module: nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def unwrap(module: nn.Module) -> nn.Module:
    """Peel DDP/DataParallel (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    while True:
        if isinstance(module, nn.parallel.DistributedDataParallel | nn.DataParallel):
            module = module.module
        elif isinstance(getattr(module, "_orig_mod", None), nn.Module):
            module = getattr(module, "_orig_mod")  # noqa: B009 (torch.compile's wrapper)
        else:
            return module
