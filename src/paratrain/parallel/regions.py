"""A model's repeated blocks, and what is applied block by block: activation
checkpointing (--activation-checkpointing) and regional compilation (--compile with
--compile-scope blocks), as torchtitan applies both per transformer block.

A *block* is a module with submodules of its own that sits in a ``Sequential`` or
``ModuleList`` beside another of its class: ResNet's BasicBlock/Bottleneck, ViT's
EncoderBlock, ConvNeXt's CNBlock, EfficientNet's MBConv, timm's blocks. The outermost
such modules are taken (a block's own inner blocks are part of it). Both levers leave
the module tree and every parameter's name as they were: checkpointing replaces the
block's ``forward`` on the instance, compiling uses ``nn.Module.compile`` (in place),
so state dicts, optimizer groups and checkpoints are unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_activations", "compile_blocks", "repeated_blocks"]


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's outermost repeated blocks with their qualified names, in order."""
    found: list[tuple[str, nn.Module]] = []
    taken: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in taken):
            continue
        if not isinstance(module, nn.Sequential | nn.ModuleList):
            continue
        children = list(module.named_children())
        kinds = [type(child) for _, child in children]
        for child_name, child in children:
            repeated = kinds.count(type(child)) > 1
            if repeated and _is_block(child):
                qualified = f"{name}.{child_name}" if name else child_name
                found.append((qualified, child))
                taken.append(qualified)
    return found


def _is_block(module: nn.Module) -> bool:
    """A module of its own kind with submodules (not a plain container of layers)."""
    return type(module) not in (nn.Sequential, nn.ModuleList) and any(
        True for _ in module.children()
    )


def checkpoint_activations(blocks: list[tuple[str, nn.Module]]) -> None:
    """Each block keeps only its input for backward and runs its forward again there
    (non-reentrant checkpointing). The second forward leaves BatchNorm's running
    statistics alone, so they move once a step as without checkpointing."""
    for _, block in blocks:
        forward = block.forward
        norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

        def checkpointed(*args: Any, _forward=forward, _norms=norms, **kwargs: Any) -> Any:
            return checkpoint(
                _forward,
                *args,
                use_reentrant=False,
                context_fn=lambda: (contextlib.nullcontext(), _statistics_kept(_norms)),
                **kwargs,
            )

        block.forward = checkpointed


@contextlib.contextmanager
def _statistics_kept(norms: list[nn.modules.batchnorm._BatchNorm]) -> Iterator[None]:
    """BatchNorm layers that normalise as in training but leave their running mean,
    variance and count as they are (the recomputed forward of a checkpointed block)."""
    kept = [(m, m.momentum, m.num_batches_tracked) for m in norms]
    for m in norms:
        m.momentum = 0.0  # running = (1 - 0) * running + 0 * batch
        if m.num_batches_tracked is not None:
            m.num_batches_tracked = m.num_batches_tracked.clone()
    try:
        yield
    finally:
        for m, momentum, count in kept:
            m.momentum = momentum
            m.num_batches_tracked = count


def compile_blocks(blocks: list[tuple[str, nn.Module]]) -> None:
    """Each block compiled in place: one block kind compiles once and is reused by its
    repeats (shapes permitting), so start-up is a fraction of the whole model's."""
    for _, block in blocks:
        block.compile()
