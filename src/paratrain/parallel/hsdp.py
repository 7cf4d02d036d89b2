"""--strategy hsdp: hybrid sharding, FSDP2 over a 2-D device mesh.

Inside a node every rank holds 1/L of each parameter, gradient and optimizer state (L:
the node's processes), as under fsdp, with the all-gathers and reduce-scatters on the
node's own fast link; across nodes the shards are replicated, and each shard's gradient
is averaged between the nodes' copies of it (an all-reduce of 1/L of the gradients per
node, not of all of them). What multi-node users of large models run: memory of fsdp
within a node, traffic between nodes close to ddp's.

Everything else — meta-device build, precision, checkpoints through
torch.distributed.checkpoint — is fsdp's (an hsdp checkpoint loads into fsdp or ddp and
back, resharded).
"""

from __future__ import annotations

from paratrain.config import TrainConfig
from paratrain.distributed.runtime import Runtime
from paratrain.errors import UserError
from paratrain.parallel.base import Layout, MemoryProfile
from paratrain.parallel.fsdp import FSDP


class HSDP(FSDP):
    name = "hsdp"
    why = (
        "parameters sharded within each node and replicated across nodes: fsdp's memory "
        "in a node, and between nodes an all-reduce of each node's shard only"
    )
    speed_order = 2

    def layout(self, cfg: TrainConfig, world: int, rank: int = 0, per_node: int = 0) -> Layout:
        shard = per_node or world
        if world % shard:
            raise UserError(
                f"--strategy hsdp: {world} processes are not whole nodes of {shard} "
                "(every node must start the same number)"
            )
        return Layout(world, rank, replicate=world // shard, shard=shard)

    def memory(self, profile: MemoryProfile) -> None:
        """On the devices `paratrain plan` counts (one node) it is fsdp."""
        return None

    def mesh(self, runtime: Runtime, layout: Layout):
        """Replicas across nodes (outer), shards within a node (inner: neighbouring ranks)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(
            runtime.device.type,
            (layout.replicate, layout.shard),
            mesh_dim_names=("replicate", "shard"),
        )


STRATEGY = HSDP()
