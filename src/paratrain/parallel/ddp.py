"""--strategy ddp: DistributedDataParallel, one process per device, gradients averaged
every step while backward runs."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paratrain.config import TrainConfig
from paratrain.distributed.runtime import Runtime
from paratrain.errors import AgreedUserError, UserError
from paratrain.parallel.base import DeviceMemory, MemoryProfile, Strategy, whole_model_memory
from paratrain.parallel.parts import ModelParts, memory_format_for

# PowerSGD's hook starts collectives from future callbacks; gloo cannot keep those in
# the same order on every rank (measured: a size mismatch and SIGABRT at the first
# compressed step), NCCL's streams can.
POWERSGD_NEEDS_NCCL = (
    "--grad-compression powersgd needs the nccl backend (CUDA); with gloo use fp16 or bf16"
)


class DDP(Strategy):
    name = "ddp"
    why = (
        "the whole model on every device: no parameter traffic, and the gradient "
        "all-reduce overlaps the backward pass"
    )
    speed_order = 0

    def check_machine(self, cfg: TrainConfig, world: int) -> None:
        from paratrain.distributed.runtime import runs_on_cuda

        if cfg.grad_compression == "powersgd" and not runs_on_cuda(cfg.device):
            raise UserError(POWERSGD_NEEDS_NCCL)

    def memory(self, profile: MemoryProfile) -> DeviceMemory:
        return whole_model_memory(self.name, profile, f"batch {profile.batch} per device")

    def wrap(self, model: nn.Module, cfg: TrainConfig, runtime: Runtime) -> ModelParts:
        """The model on this process's device; wrapped in DDP when there are several.

        Every torchvision classifier uses the same parameters every step (auxiliary
        heads are switched off), so DDP may trace its graph once (``static_graph``) and
        skip the per-step search for unused parameters. Not when steps run under
        ``no_sync`` (``--grad-accum`` > 1, and bench's communication split, which says so
        the same way): torch 2.14.1 fails an internal assert (``expect_autograd_hooks_``,
        reducer.cpp) on the first backward, measured here."""
        fmt = memory_format_for(model, cfg.memory_format, runtime.device)
        model = model.to(runtime.device).to(memory_format=fmt)
        if runtime.world_size > 1:
            model = data_parallel(model, cfg, runtime)
        layout = self.layout(cfg, runtime.world_size, runtime.rank)
        return ModelParts([model], devices=[runtime.device], layout=layout, memory_format=fmt)


def data_parallel(
    model: nn.Module, cfg: TrainConfig, runtime: Runtime, group: dist.ProcessGroup | None = None
) -> DistributedDataParallel:
    """``model`` in DDP over ``group`` (default: every rank), its gradient buckets the
    gradients themselves, compressed as --grad-compression says.

    A pipeline stage's copies (``group`` given) search for unused parameters each step:
    the schedule runs every backward but the last under ``no_sync``, and torch 2.14.1's
    reducer otherwise counts the first step's gradients once per micro-batch (an internal
    assert on the next forward), or with ``static_graph`` never averages the last stage
    (both reproduced in plain torch by tests/upstream/test_upstream.py)."""
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    staged = group is not None
    wrapped = DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=group,
        # DDP's buckets become the .grad tensors: one copy of the gradients, not two.
        gradient_as_bucket_view=True,
        # BatchNorm statistics are agreed before evaluating (ModelParts.agree_buffers),
        # not broadcast at each forward: rank 0's evolve the same either way, and an
        # evaluation forward must not be a collective (ranks' shards differ in batches)
        forward_sync_buffers=False,
        bucket_cap_mb=cfg.bucket_cap_mb,
        static_graph=cfg.grad_accum == 1 and not staged,
        find_unused_parameters=staged,
    )
    register_compression(wrapped, cfg.grad_compression)
    return wrapped


def register_compression(wrapped: DistributedDataParallel, kind: str) -> None:
    """--grad-compression: a DDP communication hook; the average stays an average."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if kind == "fp16":
        wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "bf16":
        wrapped.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif kind == "powersgd":
        if wrapped.process_group is not None and dist.get_backend() != "nccl":
            raise AgreedUserError(POWERSGD_NEEDS_NCCL)
        # rank-1 approximation with error feedback; the first steps are plain all-reduce
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


STRATEGY = DDP()
