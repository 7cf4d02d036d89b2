"""--strategy fsdp: FSDP2 (``fully_shard``), parameters, gradients and optimizer state
sharded across every process.

Each block (every module directly inside a Sequential, ModuleList or ModuleDict: a ResNet
block, a ViT encoder layer) is its own unit: its parameters are all-gathered just before
its forward and backward and freed after, its gradients reduce-scattered so each process
keeps 1/W of them, and the optimizer only ever sees its own shard. The root wraps what
is left (stem, head). Checkpoints gather the full state on rank 0 (torch's
distributed-checkpoint state-dict helpers), in the single-device layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.distributed.runtime import Runtime
from paratrain.errors import UserError
from paratrain.parallel import unified
from paratrain.parallel.parts import ModelParts

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def blocks(model: nn.Module) -> list[nn.Module]:
    """Modules directly inside a container, holding parameters, outermost first; a
    container inside a container is searched instead of taken."""
    found: list[nn.Module] = []

    def walk(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(module, CONTAINERS) and not isinstance(child, CONTAINERS):
                if any(True for _ in child.parameters()):
                    found.append(child)
                continue
            walk(child)

    walk(model)
    return found


class FSDPParts(ModelParts):
    collective_state = True  # each rank holds a shard

    def __init__(self, model: nn.Module, full_names: list[str], runtime: Runtime):
        super().__init__(
            [model], devices=[runtime.device], replicas=runtime.world_size, replica=runtime.rank
        )  # contiguous: FSDP2 shards contiguous parameters only
        self.full_names = full_names

    def agree_buffers(self) -> None:
        """FSDP shards parameters, not buffers: each process's BatchNorm statistics follow
        its own data. Rank 0's are taken, as DDP's broadcast does."""
        import torch.distributed as dist

        for buffer in self[0].buffers():
            dist.broadcast(buffer, src=0)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: the micro-steps before the last keep whole gradients
        locally; the last reduce-scatters their sum once."""
        self[0].set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self[0].set_requires_gradient_sync(True)

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on rank 0 ({} elsewhere): a collective."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        self._resharded()
        return get_model_state_dict(self[0], options=self._options())

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """A full state dict into the sharded model: each rank keeps its shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        set_model_state_dict(self[0], state, options=StateDictOptions(full_state_dict=True))

    def sharded_state(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, torch.Tensor], list[dict]]:
        """Each rank's shards: DTensors that DCP writes (and reads back) by their
        place in the whole tensor, so another world size reshards on load."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        self._resharded()
        named = get_optimizer_state_dict(self[0], optimizer)
        return unified.flatten(get_model_state_dict(self[0]), named), named["param_groups"]

    def _resharded(self) -> None:
        """The root module stays unsharded after a forward without backward (evaluation);
        its parameters are then not the optimizer's. Shard them again first."""
        for module in self[0].modules():
            if hasattr(module, "reshard"):
                module.reshard()

    def load_sharded_state(
        self, optimizer: torch.optim.Optimizer, flat: dict[str, torch.Tensor], groups: list
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        model, named = unified.unflatten(flat, groups)
        # copied into the live shards: set_model_state_dict may assign new Parameter
        # objects, which the optimizer would not know (measured: the next save failed)
        own = self[0].state_dict()
        with torch.no_grad():
            for name, value in model.items():
                if own[name] is not value:
                    own[name].copy_(value)
        named = unified.own_implementation(named, optimizer)
        set_optimizer_state_dict(self[0], optimizer, named)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """The whole optimizer state on rank 0, in the single-device layout (a collective)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        self._resharded()
        named = get_optimizer_state_dict(self[0], optimizer, options=self._options())
        if not named:
            return {}
        return unified.by_index(named, self.full_names)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """A single-device-layout optimizer state into the sharded optimizer."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(
            self[0],
            optimizer,
            unified.by_name(unified.own_implementation(state, optimizer), self.full_names),
            options=StateDictOptions(full_state_dict=True),
        )


def apply(model: nn.Module, cfg: TrainConfig, runtime: Runtime) -> FSDPParts:
    """Every block sharded over every process, then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if runtime.world_size < 2:
        raise UserError(
            "--strategy fsdp shards the model across processes; start 2 or more "
            "(--nproc N, torchrun or srun)"
        )
    full_names = unified.trainable_names(model, unified.splits_decay(cfg))
    model = model.to(runtime.device)
    mesh = init_device_mesh(runtime.device.type, (runtime.world_size,))
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return FSDPParts(model, full_names, runtime)
