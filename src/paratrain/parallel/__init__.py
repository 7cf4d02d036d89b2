"""parallelize(): a model in, its ModelParts for the chosen strategy out.

Every strategy module exposes ``apply(model, cfg, runtime) -> ModelParts``, listed by
name in ``STRATEGIES``; each checks the settings only it cares about. The steps around
it run in one fixed order, each depending on the one before:

1. CPU only: small-map convolutions become matrix products (small_maps) — it rewrites
   modules, so it comes before any wrapper holds them;
2. SyncBatchNorm conversion (ddp, fsdp): it replaces BatchNorm modules, so it comes
   before DDP registers its hooks on the parameters or FSDP groups them;
3. the strategy: placement, the data-parallel wrapper (DDP broadcasts rank 0's weights
   and buffers, so every rank starts from identical values), sharding or staging;
4. torch.compile (--compile, ddp only), around DDP rather than inside it, so that
   dynamo sees DDP's buckets and splits its graph at them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.distributed.runtime import Runtime
from paratrain.parallel import ddp, dp, fsdp, pipeline, split
from paratrain.parallel.parts import ModelParts, memory_format_for, unwrap

__all__ = ["STRATEGIES", "ModelParts", "memory_format_for", "parallelize", "unwrap"]

Strategy = Callable[[nn.Module, TrainConfig, Runtime], ModelParts]

STRATEGIES: dict[str, Strategy] = {
    "ddp": ddp.apply,
    "dp": dp.apply,
    "fsdp": fsdp.apply,
    "split": split.apply,
    "pipeline": pipeline.apply,
}


def parallelize(model: nn.Module, cfg: TrainConfig, runtime: Runtime) -> ModelParts:
    """The model placed, wrapped, sharded or staged as ``cfg.strategy`` says."""
    if runtime.device.type == "cpu":
        from paratrain.models import small_maps

        small_maps.apply(model)
    if cfg.sync_bn and runtime.world_size > 1:  # ddp and fsdp (the config refuses the rest)
        from paratrain.parallel import sync_batchnorm

        model = sync_batchnorm.apply(model, runtime)
    parts = STRATEGIES[cfg.strategy](model, cfg, runtime)
    if cfg.compile:
        # compiled around DDP (not inside it): dynamo's DDPOptimizer then splits the
        # graph at DDP's bucket boundaries, so gradient all-reduce still overlaps backward
        _quiet_expected_compile_notices()
        parts = parts.with_modules(torch.compile(part) for part in parts)
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
