"""--strategy dp: torch.nn.DataParallel, one process over every visible GPU (legacy).

Each step DataParallel copies the model from the first GPU to the others, splits the batch,
runs the replicas in threads of this one process and gathers the outputs and gradients
on the first GPU. DistributedDataParallel (one process per GPU) avoids all three costs:
no replication per step, no GIL shared by the devices, and gradient all-reduce that
overlaps the backward pass. DataParallel is here for comparison and for code that needs
one process.
"""

from __future__ import annotations

import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.distributed.runtime import Runtime
from paratrain.errors import UserError
from paratrain.log import get_logger
from paratrain.parallel.base import Strategy
from paratrain.parallel.parts import ModelParts


def check_available(world_size: int) -> int:
    """The number of GPUs DataParallel would use, or a UserError saying why it cannot."""
    if world_size > 1:
        raise UserError(
            "--strategy dp runs in a single process; it cannot be started by torchrun, "
            "srun or --nproc (use --strategy ddp there)"
        )
    if not torch.cuda.is_available():
        raise UserError(
            "--strategy dp needs CUDA devices (DataParallel splits each batch over GPUs); "
            "on CPU use --nproc N, which runs DistributedDataParallel over N processes"
        )
    return torch.cuda.device_count()


class DataParallelStrategy(Strategy):
    name = "dp"
    why = "one process over every GPU, the model copied to each every step (legacy)"
    one_process = True
    one_process_hint = "it drives every GPU from one process; --strategy ddp runs one per GPU"
    takes = frozenset({"ema", "compile", "fp16"})
    compiles_blocks = False  # replicate() copies each module's compiled forward, bound to the first

    def check_machine(self, cfg: TrainConfig, world: int) -> None:
        check_available(world)

    def norm_batch(self, cfg: TrainConfig, world: int, gpus: int = 0) -> int:
        """DataParallel's smallest chunk: torch's scatter cuts chunks of ceil(batch /
        gpus), so the last may be smaller."""
        images = super().norm_batch(cfg, world, gpus)
        if gpus > 1 and cfg.batch_size != "auto":
            chunk = -(-images // gpus)
            images = images % chunk or chunk
        return images

    def wrap(self, model: nn.Module, cfg: TrainConfig, runtime: Runtime) -> ModelParts:
        """The model on the first GPU, wrapped to split every batch over all of them."""
        devices = check_available(runtime.world_size)
        get_logger().info(
            f"DataParallel over {devices} GPU(s) in one process; --batch-size is split across "
            "them. DistributedDataParallel (--nproc N) is preferred: no model copy per step, "
            "no shared GIL, gradient communication overlapped with the backward pass"
        )
        first = torch.device("cuda", 0)
        model = model.to(first)
        return ModelParts(
            [nn.DataParallel(model, device_ids=list(range(devices)))], devices=[first]
        )


STRATEGY = DataParallelStrategy()
