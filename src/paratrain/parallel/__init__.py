"""parallelize(): wrap a model for the chosen strategy and return its ModelParts.

The order is fixed, and each step depends on the one before:

1. move to the device: wrappers capture parameters where they live;
2. SyncBatchNorm conversion: it replaces BatchNorm modules, so it must happen before
   DDP registers its hooks on the parameters (DDP would not see the new modules);
3. the data-parallel wrapper (DDP), which broadcasts rank 0's weights and buffers so
   every rank starts from identical values;
4. torch.compile (--compile), around DDP rather than inside it, so that dynamo sees the
   buckets and splits its graph at them.

Model partitioning (split, pipeline) cuts the model into stages first (partition.py) and
places each stage; fsdp shards every block and then the root.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.dist.runtime import Runtime


def memory_format_for(
    model: nn.Module, requested: str, device: torch.device
) -> torch.memory_format:
    """auto: channels_last for convolutional models (NHWC suits cuDNN's tensor-core
    kernels and oneDNN's CPU convolutions), contiguous for the rest. Measured with
    `paratrain bench --batch-size 16 --memory-format ...` on a 2-core CPU, ResNet-18,
    bf16: 149.6 vs 107.5 images/s at 128 px, 319.1 vs 264.0 at 64 px (channels_last vs
    contiguous)."""
    if requested == "channels_last":
        return torch.channels_last
    # convolutional: most weights in Conv2d layers (a ViT's one patch-embedding conv is not)
    in_conv = sum(p.numel() for m in model.modules() if isinstance(m, nn.Conv2d)
                  for p in m.parameters(recurse=False))  # fmt: skip
    convolutional = in_conv > 0.5 * sum(p.numel() for p in model.parameters())
    if requested == "auto" and convolutional:
        return torch.channels_last
    return torch.contiguous_format


class ModelParts(list):
    """The model as a list of modules: one for data parallelism, one per stage otherwise.

    The loop, checkpointing and evaluation only talk to this list, so every strategy
    shares them.
    """

    memory_format = torch.contiguous_format  # what inputs are converted to
    devices: list[torch.device] | None = None  # one per part when parts sit on devices
    input_device: torch.device | None = None  # where images go (set by parallelize)
    output_device: torch.device | None = None  # where logits come out, and labels go
    replicas: int | None = None  # data-parallel copies of the model (None: the world size)
    replica: int | None = None  # which copy this process belongs to (None: its rank)
    fixed_batch = False  # True where every training batch must have the full size
    collective_state = False  # True where gathering the state needs every rank

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        out = inputs
        for index, part in enumerate(self):
            if self.devices is not None:
                out = out.to(self.devices[index], non_blocking=True)
            out = part(out)
        return out

    def forward_backward(
        self, images: torch.Tensor, targets: torch.Tensor, criterion, precision, divisor: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One micro-batch's forward and backward; its loss and logits (None where this
        process does not produce them). The loss's gradient is divided by ``divisor``."""
        from paratrain.engine.evaluate import logits_of

        with precision.autocast():
            logits = logits_of(self(images))
            loss = criterion(logits, targets)
        precision.backward(loss / divisor)
        return loss.detach(), logits.detach()

    def after_backward(self) -> None:
        """Called once the step's gradients are complete, before the optimizer step."""

    def agree_buffers(self) -> None:
        """Before evaluating and saving: every copy of the model takes the first copy's
        buffers (BatchNorm statistics), so the sharded evaluation and the checkpoint see
        one model. DDP does this at every forward itself."""

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Indexed like a single-device optimizer over the whole model's parameters."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        from paratrain.parallel.unified import load_optimizer, own_implementation

        load_optimizer(optimizer, own_implementation(state, optimizer))

    @property
    def training(self) -> bool:
        return all(part.training for part in self)

    def train(self, mode: bool = True) -> ModelParts:
        for part in self:
            part.train(mode)
        return self

    def eval(self) -> ModelParts:
        return self.train(False)

    def no_sync(self) -> contextlib.ExitStack:
        """Gradients stay local (DDP's no_sync) until the step that leaves this context."""
        stack = contextlib.ExitStack()
        for part in self:
            ddp = getattr(part, "_orig_mod", part)  # under torch.compile
            if isinstance(ddp, nn.parallel.DistributedDataParallel):
                stack.enter_context(ddp.no_sync())
        return stack

    def parameters(self) -> Iterator[nn.Parameter]:
        for part in self:
            yield from part.parameters()

    def unwrapped(self) -> list[nn.Module]:
        return [unwrap(part) for part in self]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """One unified, unwrapped state dict (no ``module.`` or ``_orig_mod.`` prefixes)."""
        state: dict[str, torch.Tensor] = {}
        for part in self.unwrapped():
            state.update({k: v.detach().cpu() for k, v in part.state_dict().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for part in self.unwrapped():
            own = part.state_dict().keys()
            part.load_state_dict({k: v for k, v in state.items() if k in own}, strict=True)


def unwrap(module: nn.Module) -> nn.Module:
    """Peel DDP/DataParallel (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    while True:
        if isinstance(module, nn.parallel.DistributedDataParallel | nn.DataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod"):
            module = module._orig_mod
        else:
            return module


def parallelize(
    model: nn.Module, cfg: TrainConfig, runtime: Runtime, uses_no_sync: bool | None = None
) -> ModelParts:
    """``uses_no_sync``: whether the caller will run steps under ``ModelParts.no_sync``
    (default: when accumulating gradients); DDP's static graph is used only when not."""
    if cfg.strategy == "dp":
        from paratrain.parallel import dp

        return _placed(dp.apply(model, runtime), runtime)
    fmt = memory_format_for(model, cfg.memory_format, runtime.device)
    if runtime.device.type == "cpu":  # before any wrapper: the modules themselves change
        from paratrain.engine import small_maps

        small_maps.apply(model)
    if cfg.sync_bn and runtime.world_size > 1:  # ddp and fsdp (the config refuses the rest)
        from paratrain.parallel import sync_batchnorm

        model = sync_batchnorm.apply(model, runtime)
    if cfg.strategy in ("fsdp", "pipeline"):
        # FSDP2 shards contiguous parameters only; the pipeline's receive buffers for
        # gradients take channels_last strides that gloo and NCCL refuse (torch 2.14)
        fmt = torch.contiguous_format
    if cfg.strategy in ("split", "pipeline", "fsdp"):
        import importlib

        strategy = importlib.import_module(f"paratrain.parallel.{cfg.strategy}")
        parts = strategy.apply(model.to(memory_format=fmt), cfg, runtime, fmt)
        parts.memory_format = fmt
        return _placed(parts, runtime)
    model = model.to(runtime.device, memory_format=fmt)
    parts = _wrap(model, cfg, runtime, cfg.grad_accum > 1 if uses_no_sync is None else uses_no_sync)
    if cfg.compile:
        # compiled around DDP (not inside it): dynamo's DDPOptimizer then splits the
        # graph at DDP's bucket boundaries, so gradient all-reduce still overlaps backward
        _quiet_expected_compile_notices()
        parts = ModelParts([torch.compile(part) for part in parts])
    parts.memory_format = fmt
    return _placed(parts, runtime)


def _placed(parts: ModelParts, runtime: Runtime) -> ModelParts:
    """Where inputs go and labels meet the logits: the first and last part's devices, or
    the runtime's; without model copies of its own, every process is a replica."""
    if parts.replicas is None:
        parts.replicas, parts.replica = runtime.world_size, runtime.rank
    devices = parts.devices or [runtime.device]
    parts.input_device, parts.output_device = devices[0], devices[-1]
    return parts


def _quiet_expected_compile_notices() -> None:
    """DDP's forward broadcasts buffers and records a profiler range outside the graph;
    dynamo says so on every rank at every compile, which tells a user nothing to do."""
    import logging
    import warnings

    class NotThese(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not str(record.msg).startswith(("Profiler record function", "No CUDA runtime"))

    warnings.filterwarnings("ignore", message=r"Dynamo does not know how to trace the builtin")
    for name in ("torch._dynamo.variables.ctx_manager", "torch.utils.cpp_extension"):
        logging.getLogger(name).addFilter(NotThese())


def _wrap(model: nn.Module, cfg: TrainConfig, runtime: Runtime, uses_no_sync: bool) -> ModelParts:
    from paratrain.parallel import ddp

    if runtime.world_size > 1:
        return ddp.apply(model, cfg, runtime, static_graph=not uses_no_sync)
    return ModelParts([model])
