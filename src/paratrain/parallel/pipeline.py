"""--strategy pipeline --stages P --microbatches M --schedule gpipe|1f1b.

Each process holds one stage of the model; every batch is cut into M micro-batches that
flow through the stages with torch.distributed.pipelining's schedules, so that stages
work on different micro-batches at once. With W = P x D processes there are D copies
(replicas) of the pipeline: rank r is stage r % P of replica r // P, so one replica's
stages are neighbours (on one machine with --nproc); each stage's gradients are averaged
over its D replicas after the schedule's backward, before the optimizer step.

Every stage of a replica reads the same batches (the first needs the images, the last
the labels); the data is sharded over replicas, not processes. The loss, logits and
evaluation counts come from the last stage only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from paratrain.config import TrainConfig
from paratrain.config.train import check_pipeline_world
from paratrain.distributed import comm
from paratrain.distributed.runtime import Runtime
from paratrain.errors import AgreedUserError, UserError
from paratrain.log import get_logger
from paratrain.parallel import partition, unified
from paratrain.parallel.parts import ModelParts, StepPrecision


class _Loss:
    """The schedule's loss function; the loop sets the criterion and divisor per step.
    Each micro-batch's mean loss is divided by the micro-batch count here rather than
    by the schedule afterwards (its ``scale_grads`` divides every gradient the
    parameters hold, so under gradient accumulation it would divide the earlier
    micro-steps' share again)."""

    criterion: nn.Module | None = None
    divisor: int = 1

    def __init__(self, microbatches: int):
        self.microbatches = microbatches

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.criterion(output, target) / (self.divisor * self.microbatches)


class PipelineParts(ModelParts):
    fixed_batch = True  # the stages' buffers are sized by the first micro-batches
    collective_state = True  # each rank holds one stage

    def __init__(
        self,
        module,
        schedule,
        loss,
        stage,
        stages,
        dp_group,
        full_names,
        runtime: Runtime,
        split: bool = False,
    ):
        # contiguous: the receive buffers for gradients would take channels_last strides,
        # which gloo and NCCL refuse (torch 2.14)
        super().__init__(
            [module],
            devices=[runtime.device],
            replicas=runtime.world_size // stages,
            replica=runtime.rank // stages,
        )
        self.schedule, self.loss, self.stage, self.stages = schedule, loss, stage, stages
        self.dp_group, self.full_names = dp_group, full_names
        self.local_names = unified.trainable_names(module, split)
        self.first, self.last = stage == 0, stage == stages - 1

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """Forward only (evaluation): the logits on the last stage, None before it."""
        if self.first:
            return self.schedule.eval(inputs)
        # the schedule has a loss function, so its last stage asks for targets it ignores
        dummy = torch.zeros(inputs.shape[0], dtype=torch.long, device=inputs.device)
        return self.schedule.eval(target=dummy if self.last else None)

    def forward_backward(
        self,
        images: torch.Tensor,
        targets: torch.Tensor,
        criterion: nn.Module,
        precision: StepPrecision,
        divisor: int,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One micro-batched schedule step: the first stage feeds images, the last computes the loss and returns it with the logits; the others return nothing."""
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

    def after_backward(self) -> None:
        """Average this stage's gradients over its replicas, in one flat all-reduce."""
        if self.replicas == 1:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.replicas
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()

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
        """The whole model's optimizer state on rank 0, merged from replica 0's stages (a collective)."""
        own = (
            unified.by_name(optimizer.state_dict(), self.local_names) if self.replica == 0 else None
        )
        stages = [part for part in _gather_to_main(own) if part is not None]
        if not comm.is_main():
            return {}
        return unified.by_index(unified.merge_named(stages, self.full_names), self.full_names)

    def sharded_state(
        self, optimizer: torch.optim.Optimizer
    ) -> tuple[dict[str, torch.Tensor], list[dict]]:
        """This stage's tensors, under the whole model's names: a stage's keys are its
        own, and replicas of a stage hold the same keys (DCP writes them once)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        named = get_optimizer_state_dict(self[0], optimizer)
        model = {k: v.detach() for k, v in self[0].state_dict().items()}
        return unified.flatten(model, named), named["param_groups"]

    def load_sharded_state(
        self, optimizer: torch.optim.Optimizer, flat: dict[str, torch.Tensor], groups: list
    ) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        model, named = unified.unflatten(flat, groups)
        self[0].load_state_dict(model, strict=True)
        mine = set(self.local_names)
        named = {
            "state": named["state"],
            "param_groups": [
                {**g, "params": [n for n in g["params"] if n in mine]}
                for g in named["param_groups"]
            ],
        }
        named = unified.own_implementation(named, optimizer)
        set_optimizer_state_dict(self[0], optimizer, named)

    def gather_groups(self, groups: list[dict]) -> list[dict]:
        """The stages' groups merged in stage order (replica 0's): the whole model's."""
        stages = _gather_to_main(groups if self.replica == 0 else None)
        if not comm.is_main():
            return []
        parts = [g for g in stages if g is not None]
        merged = [dict(group) for group in parts[0]]
        for i, group in enumerate(merged):
            group["params"] = [name for part in parts for name in part[i]["params"]]
        return merged

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """This stage's share of a whole-model optimizer state."""
        named = unified.by_name(unified.own_implementation(state, optimizer), self.full_names)
        unified.load_optimizer(optimizer, unified.by_index(named, self.local_names))


def _gather_to_main(obj) -> list:
    gathered = [None] * dist.get_world_size() if comm.is_main() else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered or []


def apply(model: nn.Module, cfg: TrainConfig, runtime: Runtime) -> PipelineParts:
    """This process's stage of the model, in a schedule over micro-batches."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stages, world = cfg.stages, runtime.world_size
    try:  # every rank alike: told once
        check_pipeline_world(world, stages)
    except UserError as exc:
        raise AgreedUserError(str(exc)) from None
    replicas = world // stages
    stage, replica = runtime.rank % stages, runtime.rank // stages
    # every rank creates every group, in the same order (new_group is collective)
    pipe_groups = [dist.new_group([r * stages + s for s in range(stages)]) for r in range(replicas)]
    dp_groups = [dist.new_group([r * stages + s for r in range(replicas)]) for s in range(stages)]
    full_names = unified.trainable_names(model, unified.splits_decay(cfg))
    try:  # the same model and flags on every rank: the same error, told once
        traced = partition.trace(model, cfg.model)
        starts = partition.user_starts(traced, stages, cfg.split_point_list(), cfg.model)
    except UserError as exc:
        raise AgreedUserError(str(exc)) from None
    # rank 0 measures and decides; timings differ between processes, the cut must not
    if runtime.is_main:
        micro = cfg.batch_size // cfg.microbatches  # what a stage computes at once
        partition.measure(
            traced, partition.sample_images(cfg.train_size, micro, torch.contiguous_format)
        )
        if starts is None:  # the whole batch's activations: GPipe's case, 1F1B's bound
            slots = partition.optimizer_slots(cfg.opt, cfg.momentum)
            limit = partition.device_memory(runtime.device)
            starts = partition.choose_starts(traced, stages, cfg.batch_size, slots, limit)
        where = [
            f"rank {s}" + (f" (and {replicas - 1} replica(s))" if replicas > 1 else "")
            for s in range(stages)
        ]
        plans = partition.describe(traced, starts)
        get_logger().info(partition.format_plan(plans, where, max(2, micro)))
    starts = comm.broadcast_object(starts)
    module = partition.build_stages(traced, starts, contiguous_outputs=True)[stage]
    module = module.to(runtime.device)
    pipe_stage = PipelineStage(module, stage, stages, runtime.device, group=pipe_groups[replica])
    loss = _Loss(cfg.microbatches)
    kind = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
    schedule = kind(pipe_stage, n_microbatches=cfg.microbatches, loss_fn=loss, scale_grads=False)
    return PipelineParts(
        module,
        schedule,
        loss,
        stage,
        stages,
        dp_groups[stage],
        full_names,
        runtime,
        unified.splits_decay(cfg),
    )
