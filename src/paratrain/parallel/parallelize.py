"""parallelize(): a model in, its ModelParts for the chosen strategy out.

The steps run in one fixed order, each depending on the one before (torchtitan's
``parallelize_llama`` shape):

1. CPU only: small-map convolutions become matrix products (small_maps) — it rewrites
   modules, so it comes before any wrapper holds them;
2. SyncBatchNorm conversion (where the strategy takes --sync-bn): it replaces BatchNorm
   modules, so it comes before DDP registers its hooks on the parameters or FSDP groups
   them;
3. block by block (parallel/regions): activation checkpointing, then regional
   compilation (``--compile-scope blocks``), both in place and before any wrapper, as
   torchtitan orders them (checkpointing, compile, then FSDP);
4. the strategy's own wrap: placement, the data-parallel wrapper (DDP broadcasts rank
   0's weights and buffers, so every rank starts from identical values), sharding or
   staging;
5. torch.compile of the whole model (``--compile-scope model``), around DDP rather
   than inside it, so that dynamo sees DDP's buckets and splits its graph at them.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.distributed.runtime import Runtime
from paratrain.parallel import optim_state
from paratrain.parallel.base import get
from paratrain.parallel.parts import ModelParts

__all__ = ["build_parts", "parallelize"]


def build_parts(cfg: TrainConfig, classes: int, runtime: Runtime) -> ModelParts:
    """The configured model, built as its strategy builds it (identical on every rank;
    meta-device where the strategy loads weights in shards), then parallelized."""
    from paratrain.models.registry import build_model

    strategy = get(cfg.strategy)
    model = strategy.build(lambda device: build_model(cfg, classes, device), runtime)
    return parallelize(model, cfg, runtime)


def build_teacher(cfg: TrainConfig, classes: int, runtime: Runtime) -> nn.Module | None:
    """--teacher with its weights, placed by the strategy (a copy on every rank, or
    sharded as the student is); None without one. Its weights not fitting the teacher
    and the data's classes fail on every rank alike."""
    if cfg.teacher is None:
        return None
    from paratrain.errors import AgreedUserError, UserError
    from paratrain.models.registry import build_teacher as built

    try:
        teacher = built(cfg, classes)
    except UserError as exc:
        raise AgreedUserError(str(exc)) from None
    return get(cfg.strategy).place_teacher(teacher, cfg, runtime)


def parallelize(model: nn.Module, cfg: TrainConfig, runtime: Runtime) -> ModelParts:
    """The model placed, wrapped, sharded or staged as ``cfg.strategy`` says."""
    if runtime.device.type == "cpu":
        from paratrain.models import small_maps

        small_maps.apply(model)
    strategy = get(cfg.strategy)
    if cfg.sync_bn and runtime.world_size > 1:  # where the strategy takes it (checked)
        from paratrain.parallel import sync_batchnorm

        model = sync_batchnorm.apply(model, runtime)
    grouping = optim_state.grouping(cfg, model)  # from the whole model, before it is split
    _by_block(model, cfg, compile_blocks=cfg.compile and cfg.compile_scope == "blocks")
    parts = strategy.wrap(model, cfg, runtime)
    parts.grouping = grouping
    if cfg.compile and cfg.compile_scope == "model":
        # compiled around DDP (not inside it): dynamo's DDPOptimizer then splits the
        # graph at DDP's bucket boundaries, so gradient all-reduce still overlaps backward
        _quiet_expected_compile_notices()
        parts = parts.with_modules(cast(nn.Module, torch.compile(part)) for part in parts)
    return parts


def _by_block(model: nn.Module, cfg: TrainConfig, compile_blocks: bool) -> None:
    """--activation-checkpointing and regional compilation, each repeated block in
    place; a model without repeated blocks is compiled whole, in place."""
    if not (cfg.activation_checkpointing or compile_blocks):
        return
    from paratrain.parallel import regions

    blocks = regions.repeated_blocks(model)
    if cfg.activation_checkpointing:
        regions.checkpoint_activations(blocks)
    if compile_blocks:
        _quiet_expected_compile_notices()
        regions.compile_blocks(blocks) if blocks else model.compile()


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
