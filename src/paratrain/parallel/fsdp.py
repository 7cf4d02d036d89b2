"""--strategy fsdp: FSDP2 (``fully_shard``), parameters, gradients and optimizer state
sharded across every process.

Each block (every module directly inside a Sequential, ModuleList or ModuleDict: a ResNet
block, a ViT encoder layer) is its own unit: its parameters are all-gathered just before
its forward and backward and freed after, its gradients reduce-scattered so each process
keeps 1/W of them, and the optimizer only ever sees its own shard. The root wraps what
is left (stem, head).

Built the torch way: every rank but 0 builds the model on the meta device (no memory),
rank 0 builds it on the CPU with its weights; all shard it, materialise their shards on
the device (``to_empty``) and take rank 0's values by broadcast, so no process ever
holds the whole model on the device. Under bf16 the blocks' parameters are gathered and
computed in bf16, their gradients reduced in fp32 (``MixedPrecisionPolicy``); BatchNorm
layers stay fp32 (their running statistics are fp32, and the CPU kernel takes no mixed
pair). Checkpoints are each rank's shards (parallel/sharded.py, torch.distributed.checkpoint).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from paratrain.config import TrainConfig
from paratrain.distributed.runtime import Runtime
from paratrain.parallel import optim_state
from paratrain.parallel.base import DeviceMemory, Layout, MemoryProfile, Strategy
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
    collective_forward = True  # each unit's forward all-gathers its parameters
    fused_optimizer = False  # torch 2.14 has no sharding rule for fused SGD over DTensors

    def __init__(self, model: nn.Module, full_names: list[str], runtime: Runtime, layout: Layout):
        # contiguous: FSDP2 shards contiguous parameters only
        super().__init__([model], devices=[runtime.device], layout=layout)
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
        return cast(dict[str, torch.Tensor], get_model_state_dict(self[0], options=self._options()))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """A full state dict into the sharded model: each rank keeps its shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        set_model_state_dict(
            self[0], cast(dict[str, Any], state), options=StateDictOptions(full_state_dict=True)
        )

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
        named = cast(dict[str, Any], get_optimizer_state_dict(self[0], optimizer))
        model = cast(dict[str, Any], get_model_state_dict(self[0]))
        return optim_state.flatten(model, named), named["param_groups"]

    def _resharded(self) -> None:
        """The root module stays unsharded after a forward without backward (evaluation);
        its parameters are then not the optimizer's. Shard them again first."""
        for module in self[0].modules():
            if hasattr(module, "reshard"):
                module.reshard()

    def load_sharded_state(
        self, optimizer: torch.optim.Optimizer, flat: dict[str, torch.Tensor], groups: list
    ) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        model, named = optim_state.unflatten(flat, groups)
        # copied into the live shards: set_model_state_dict may assign new Parameter
        # objects, which the optimizer would not know (measured: the next save failed)
        own = self[0].state_dict()
        with torch.no_grad():
            for name, value in model.items():
                if own[name] is not value:
                    own[name].copy_(value)
        named = optim_state.own_implementation(named, optimizer)
        # strict=False: a parameter the optimizer had not stepped when saved (a backbone
        # frozen by --freeze-epochs) has no state to load, as in the run that saved it
        set_optimizer_state_dict(self[0], optimizer, named, options=StateDictOptions(strict=False))

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """The whole optimizer state on rank 0, in the single-device layout (a collective)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        self._resharded()
        named = get_optimizer_state_dict(self[0], optimizer, options=self._options())
        if not named:
            return {}
        return optim_state.by_index(named, self.full_names)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """A single-device-layout optimizer state into the sharded optimizer."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        set_optimizer_state_dict(
            self[0],
            optimizer,
            optim_state.by_name(optim_state.own_implementation(state, optimizer), self.full_names),
            options=StateDictOptions(full_state_dict=True),
        )


class FSDP(Strategy):
    name = "fsdp"
    why = (
        "parameters, gradients and optimizer state sharded N ways; each block's "
        "parameters are all-gathered for its forward and backward (about 1.5x DDP's traffic)"
    )
    min_world = 2
    spreads = "shards the model across processes"
    # its checkpoint is read resharded by any strategy: ddp trains on in one process
    fewer_hint = "in one process use --strategy ddp"
    min_devices = 2
    speed_order = 1
    takes = frozenset({"sync_bn", "teacher", "activation_checkpointing"})
    torch_apis = ("DTensor", "fully_shard", "init_device_mesh")

    def layout(self, cfg: TrainConfig, world: int, rank: int = 0, per_node: int = 0) -> Layout:
        return Layout(world, rank, shard=world)

    def memory(self, profile: MemoryProfile) -> DeviceMemory | None:
        """1/N of every tensor, plus the two largest blocks gathered whole (one
        computing, one prefetched)."""
        devices = profile.devices
        gathered = sum(sorted((_bytes(b) for b in blocks(profile.model)), reverse=True)[:2])
        return DeviceMemory(
            self.name,
            profile.parameters // devices + gathered,
            profile.trainable // devices,
            profile.slots * profile.trainable // devices,
            int(profile.saved + profile.workspace),
            f"1/{devices} of each tensor, plus the two largest blocks gathered whole "
            "(one computing, one prefetched)",
            scratch=profile.scratch,
        )

    def build(
        self, make: Callable[[torch.device | None], nn.Module], runtime: Runtime
    ) -> nn.Module:
        """Rank 0 builds the model with its weights on the CPU; the others on the meta
        device, where it takes no memory (wrap() gives them rank 0's values)."""
        return make(None if runtime.rank == 0 else torch.device("meta"))

    def mesh(self, runtime: Runtime, layout: Layout):
        """One dimension: every rank shards every parameter."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(runtime.device.type, (runtime.world_size,))

    def wrap(self, model: nn.Module, cfg: TrainConfig, runtime: Runtime) -> FSDPParts:
        """Every block sharded over the mesh, then the root; then the shards made real
        on the device and filled from rank 0's model."""
        from torch.distributed.fsdp import fully_shard

        layout = self.layout(cfg, runtime.world_size, runtime.rank, runtime.env.local_world_size)
        full_names = optim_state.trainable_names(model, optim_state.grouping(cfg, model))
        full = model.state_dict() if runtime.rank == 0 else {}  # rank 0's values, kept
        mesh = self.mesh(runtime, layout)
        precision = Policies(model, cfg, runtime)
        for block in blocks(model):
            precision.norms_apart(block, mesh)
            fully_shard(block, mesh=mesh, mp_policy=precision.of(block))
        precision.norms_apart(model, mesh)
        fully_shard(model, mesh=mesh, mp_policy=precision.of(model))
        _materialise(model, full, runtime)
        return FSDPParts(model, full_names, runtime, layout)

    def place_teacher(self, teacher: nn.Module, cfg: TrainConfig, runtime: Runtime) -> nn.Module:
        """The teacher sharded as the student is, block by block over the same ranks: each
        rank keeps 1/N of it and gathers a block for its forward (every rank loaded the
        same weights, so each shard is its share of them)."""
        from torch.distributed.fsdp import fully_shard

        teacher = teacher.to(runtime.device)
        mesh = self.mesh(runtime, self.layout(cfg, runtime.world_size, runtime.rank,
                                              runtime.env.local_world_size))  # fmt: skip
        for block in blocks(teacher):
            fully_shard(block, mesh=mesh)
        fully_shard(teacher, mesh=mesh)
        return teacher

    def teacher_bytes(self, teacher: int, devices: int) -> int | None:
        return -(-teacher // devices)


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


class Policies:
    """Which precision each unit is gathered and computed in. Under bf16: the blocks'
    parameters are gathered in bf16 and their gradients reduced in fp32, except a block
    holding a convolution that strides over a 1-pixel input on a CPU (models/cpu_bf16),
    and BatchNorm layers, which become units of their own in fp32 (their running
    statistics are fp32, and CPU batch norm refuses bf16 weights with fp32 statistics).
    Under fp32 every unit is fp32 and nothing is split off."""

    def __init__(self, model: nn.Module, cfg: TrainConfig, runtime: Runtime):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from paratrain.distributed.runtime import resolve_precision

        self.fp32 = MixedPrecisionPolicy()
        self.bf16 = None
        self.kept_fp32: set[nn.Module] = set()
        if resolve_precision(cfg.precision, runtime.device) != "bf16-mixed":
            return
        self.bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if runtime.device.type == "cpu":
            from paratrain.models import cpu_bf16

            if cpu_bf16.affected():
                names = cpu_bf16.convolutions_over_one_pixel(model, cfg.train_size)
                self.kept_fp32 = {model.get_submodule(name) for name in names}

    def of(self, unit: nn.Module):
        """The policy of one unit (a block, or the root)."""
        if self.bf16 is None or any(m in self.kept_fp32 for m in _own_modules(unit)):
            return self.fp32
        return self.bf16

    def norms_apart(self, module: nn.Module, mesh) -> None:
        """Under bf16, the BatchNorm layers inside ``module`` not yet sharded become
        fp32 units of their own."""
        from torch.distributed.fsdp import fully_shard

        if self.bf16 is None:
            return
        for child in module.modules():
            if (
                isinstance(child, nn.modules.batchnorm._BatchNorm)
                and not hasattr(child, "reshard")  # not a unit yet
                and any(True for _ in child.parameters())
            ):
                fully_shard(child, mesh=mesh, mp_policy=self.fp32)


def _own_modules(unit: nn.Module) -> Iterator[nn.Module]:
    """The modules a unit computes with, without the units inside it (already sharded)."""
    yield unit
    for child in unit.children():
        if not hasattr(child, "reshard"):
            yield from _own_modules(child)


def _materialise(model: nn.Module, full: dict, runtime: Runtime) -> None:
    """The shards made real on this rank's device and filled with rank 0's values,
    broadcast: parameters and buffers of the state dict by torch's helper, buffers
    outside it (non-persistent) one by one."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    persistent = set(model.state_dict())
    model.to_empty(device=runtime.device)
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    for name, buffer in model.named_buffers():
        if name not in persistent:
            dist.broadcast(buffer, src=0)


STRATEGY = FSDP()
