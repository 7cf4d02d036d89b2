"""--strategy pipeline --stages P --microbatches M --schedule gpipe|1f1b.

Each process holds one stage of the model; every batch is cut into M micro-batches that
flow through the stages with torch.distributed.pipelining's schedules, so that stages
work on different micro-batches at once. With W = P x D processes there are D copies
(replicas) of the pipeline: rank r is stage r % P of replica r // P, so one replica's
stages are neighbours (on one machine with --nproc). With D > 1 each stage's D copies are
wrapped in DistributedDataParallel over their own group: the schedule runs every
micro-batch but the last under DDP's no_sync, and the last one's backward all-reduces
the gradients bucket by bucket while the rest of backward runs — no all-reduce by hand
after it. The wrapper searches for unused parameters (``find_unused_parameters``):
without it torch 2.14.1's DDP fails or averages nothing under the pipeline schedules
(tests/upstream/test_upstream.py).

Every stage of a replica reads the same batches (the first needs the images, the last
the labels); the data is sharded over replicas, not processes. The loss, logits and
evaluation counts come from the last stage only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import TrainConfig
from paratrain.distributed import comm
from paratrain.distributed.runtime import Runtime
from paratrain.errors import AgreedUserError, UserError
from paratrain.log import get_logger
from paratrain.parallel import optim_state, partition
from paratrain.parallel.base import DeviceMemory, Layout, MemoryProfile, Strategy, staged_memory
from paratrain.parallel.parts import ModelParts, StepPrecision


class _Loss:
    """The schedule's loss function; the loop sets the criterion and divisor per step.
    Each micro-batch's mean loss is divided by the micro-batch count here rather than
    by the schedule afterwards (its ``scale_grads`` divides every gradient the
    parameters hold, so under gradient accumulation it would divide the earlier
    micro-steps' share again)."""

    criterion: nn.Module | None = None
    divisor: float = 1

    def __init__(self, microbatches: int):
        self.microbatches = microbatches

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self.criterion is not None  # set by forward_backward before the schedule runs
        loss: torch.Tensor = self.criterion(output, target)
        return loss / (self.divisor * self.microbatches)


class PipelineParts(ModelParts):
    fixed_batch = True  # the stages' buffers are sized by the first micro-batches
    collective_state = True  # each rank holds one stage

    def __init__(
        self,
        module,
        schedule,
        loss,
        layout: Layout,
        dp_group,
        full_names,
        runtime: Runtime,
        split: bool | optim_state.Grouping = False,
    ):
        # contiguous: the receive buffers for gradients would take channels_last strides,
        # which gloo and NCCL refuse (torch 2.14)
        super().__init__([module], devices=[runtime.device], layout=layout)
        self.schedule, self.loss = schedule, loss
        self.stage, self.stages = layout.stage, layout.stages
        self.dp_group, self.full_names = dp_group, full_names
        self.local_names = optim_state.trainable_names(module, split)
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """Forward only (evaluation): the logits on the last stage, None before it."""
        if self.first:
            return self.schedule.eval(inputs)
        # the schedule has a loss function, so its last stage asks for targets it ignores
        # (and for a criterion, unset before the first training step)
        if self.loss.criterion is None:
            self.loss.criterion = nn.CrossEntropyLoss()
        dummy = torch.zeros(inputs.shape[0], dtype=torch.long, device=inputs.device)
        return self.schedule.eval(target=dummy if self.last else None)

    def forward_backward(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        precision: StepPrecision,
        divisor: float,
        lap: Callable[[str], None] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One micro-batched schedule step: the first stage feeds images, the last
        computes the loss and returns it with the logits; the others return nothing.
        Forward and backward interleave, so ``lap`` is not called: it is all backward."""
        self.loss.criterion, self.loss.divisor = criterion, divisor
        losses: list[torch.Tensor] = []
        with precision.autocast():
            if self.first:
                self.schedule.step(images)
                return None, None
            if not self.last:
                self.schedule.step()
                return None, None
            logits = self.schedule.step(target=targets, losses=losses)
        scale = divisor * self.loss.microbatches
        loss = torch.stack([x.detach().float() for x in losses]).mean() * scale
        return loss, logits.detach()

    def agree_buffers(self) -> None:
        """Each stage's copies take replica 0's buffers (BatchNorm statistics)."""
        if self.replicas == 1:
            return
        for buffer in self[0].buffers():
            dist.broadcast(buffer, src=self.stage, group=self.dp_group)  # replica 0's rank

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Rank 0 gets the whole model's state dict (replica 0's stages); others {}."""
        own = super().state_dict() if self.replica == 0 else {}
        merged: dict[str, torch.Tensor] = {}
        for part in _gather_to_main(own):
            merged.update(part)
        return merged

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """The whole model's optimizer state on rank 0, merged from replica 0's stages
        (a collective)."""
        own = None
        if self.replica == 0:
            own = optim_state.by_name(optimizer.state_dict(), self.local_names)
        stages = [part for part in _gather_to_main(own) if part is not None]
        if not comm.is_main():
            return {}
        merged = optim_state.merge_named(stages, self.full_names)
        return optim_state.by_index(merged, self.full_names)

    def sharded_state(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, torch.Tensor], list[dict]]:
        """This stage's tensors, under the whole model's names: a stage's keys are its
        own, and replicas of a stage hold the same keys (DCP writes them once)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        named = cast(dict[str, Any], get_optimizer_state_dict(self[0], optimizer))
        model = {k: v.detach() for k, v in self[0].state_dict().items()}
        return optim_state.flatten(model, named), named["param_groups"]

    def load_sharded_state(
        self, optimizer: torch.optim.Optimizer, flat: dict[str, torch.Tensor], groups: list
    ) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        model, named = optim_state.unflatten(flat, groups)
        own = self[0].state_dict()  # copied into the live tensors
        with torch.no_grad():
            for name, value in model.items():
                if own[name] is not value:
                    own[name].copy_(value)
        mine = set(self.local_names)
        named = {
            "state": named["state"],
            "param_groups": [  # the groups this stage holds parameters of
                {**g, "params": [n for n in g["params"] if n in mine]}
                for g in named["param_groups"]
                if any(n in mine for n in g["params"])
            ],
        }
        named = optim_state.own_implementation(named, optimizer)
        # strict=False: a parameter the optimizer had not stepped when saved (a backbone
        # frozen by --freeze-epochs) has no state to load, as in the run that saved it
        set_optimizer_state_dict(self[0], optimizer, named, options=StateDictOptions(strict=False))

    def gather_groups(self, groups: list[dict]) -> list[dict]:
        """The stages' groups merged in stage order (replica 0's): the whole model's."""
        stages = _gather_to_main(groups if self.replica == 0 else None)
        if not comm.is_main():
            return []
        parts = [g for g in stages if g is not None]
        return optim_state.merge_groups(parts, self.full_names)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """This stage's share of a whole-model optimizer state."""
        named = optim_state.by_name(
            optim_state.own_implementation(state, optimizer), self.full_names
        )
        optim_state.load_optimizer(optimizer, optim_state.by_index(named, self.local_names))


def _gather_to_main(obj) -> list:
    gathered = [None] * dist.get_world_size() if comm.is_main() else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered or []


class Pipeline(Strategy):
    name = "pipeline"
    why = (
        "one stage per device, micro-batches in flight; the pipeline's fill and drain "
        "leave each device idle (P-1)/(M+P-1) of the time"
    )
    min_world = 2
    spreads = "runs its stages in processes of their own"
    min_devices = 2
    speed_order = 2
    takes = frozenset()
    torch_apis = ("pipeline schedules",)

    def check_own(self, cfg: TrainConfig, world: int | None) -> None:
        if cfg.progressive:
            raise UserError(
                "--progressive: pipeline stages exchange activations of one fixed shape; "
                "train at one --image-size, or use --strategy ddp or fsdp"
            )
        if cfg.schedule == "1f1b" and cfg.microbatches < cfg.stages:
            raise UserError(
                f"--schedule 1f1b needs at least as many micro-batches as stages "
                f"(--microbatches {cfg.microbatches}, --stages {cfg.stages})"
            )
        if cfg.batch_size != "auto" and cfg.batch_size % cfg.microbatches:
            raise UserError(
                f"--batch-size {cfg.batch_size} must divide into --microbatches "
                f"{cfg.microbatches} equal micro-batches"
            )
        if world is not None and world > 1 and world % cfg.stages:
            raise UserError(
                f"--strategy pipeline: {world} process(es) do not divide into {cfg.stages} "
                f"stages (world size = stages x replicas; e.g. --nproc {cfg.stages} or "
                f"{2 * cfg.stages})"
            )

    def layout(self, cfg: TrainConfig, world: int, rank: int = 0, per_node: int = 0) -> Layout:
        stages = cfg.stages if world % cfg.stages == 0 else world  # refused by check_settings
        return Layout(world, rank, replicate=world // stages, stages=stages)

    def norm_batch(self, cfg: TrainConfig, world: int, gpus: int = 0) -> int:
        """A stage's BatchNorm sees one micro-batch at a time."""
        if cfg.batch_size == "auto":
            return 2
        return cfg.batch_size // cfg.microbatches

    def memory(self, profile: MemoryProfile) -> DeviceMemory:
        return staged_memory(self.name, profile, pipelined=True)

    @staticmethod
    def _cut(traced, starts, cfg: TrainConfig, runtime: Runtime, stages: int, replicas: int):
        """Rank 0: each unit timed and weighed, the cut chosen where not given (the
        whole batch's activations: GPipe's case, 1F1B's bound), and said."""
        micro = cfg.batch // cfg.microbatches  # what a stage computes at once
        partition.measure(
            traced, partition.sample_images(cfg.train_size, micro, torch.contiguous_format)
        )
        if starts is None:
            slots = partition.optimizer_slots(cfg.opt, cfg.momentum)
            limit = partition.device_memory(runtime.device)
            starts = partition.choose_starts(traced, stages, cfg.batch, slots, limit)
        where = [
            f"rank {s}" + (f" (and {replicas - 1} replica(s))" if replicas > 1 else "")
            for s in range(stages)
        ]
        plans = partition.describe(traced, starts)
        get_logger().info(partition.format_plan(plans, where, max(2, micro)))
        return starts

    def wrap(self, model: nn.Module, cfg: TrainConfig, runtime: Runtime) -> PipelineParts:
        """This process's stage of the model, in a schedule over micro-batches."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        try:  # every rank alike: told once
            self.check_settings(cfg, runtime.world_size)
        except UserError as exc:
            raise AgreedUserError(str(exc)) from None
        from torch.distributed.device_mesh import init_device_mesh

        layout = self.layout(cfg, runtime.world_size, runtime.rank)
        stages, replicas = layout.stages, layout.dp_size
        # ranks as (copy, stage), stages innermost: the layout's order; every rank builds
        # every group of the mesh alike (creating one is collective)
        mesh = init_device_mesh(
            runtime.device.type, (replicas, stages), mesh_dim_names=("dp", "pp")
        )
        grouping = optim_state.grouping(cfg, model)
        full_names = optim_state.trainable_names(model, grouping)
        try:  # the same model and flags on every rank: the same error, told once
            traced = partition.trace(model, cfg.model)
            starts = partition.user_starts(traced, stages, cfg.split_point_list(), cfg.model)
        except UserError as exc:
            raise AgreedUserError(str(exc)) from None
        # rank 0 measures and decides; timings differ between processes, the cut must not
        if runtime.is_main:
            starts = self._cut(traced, starts, cfg, runtime, stages, replicas)
        agreed = comm.broadcast_object(starts)
        assert agreed is not None  # rank 0 chose them
        module = partition.build_stages(traced, agreed, contiguous_outputs=True)[layout.stage]
        module = module.to(runtime.device)
        runs: nn.Module = module
        if replicas > 1:  # the stage's copies average its gradients while backward runs
            from paratrain.parallel.ddp import data_parallel

            runs = data_parallel(module, cfg, runtime, mesh.get_group("dp"))
        pipe_stage = PipelineStage(
            runs, layout.stage, stages, runtime.device, group=mesh.get_group("pp")
        )
        loss = _Loss(cfg.microbatches)
        kind = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
        schedule = kind(
            pipe_stage, n_microbatches=cfg.microbatches, loss_fn=loss, scale_grads=False
        )
        return PipelineParts(
            module,
            schedule,
            loss,
            layout,
            mesh.get_group("dp"),
            full_names,
            runtime,
            grouping,
        )


STRATEGY = Pipeline()
