"""One optimizer step, the one every caller takes: the training loop, the learning-rate
range test, the batch-size probe and `paratrain bench` (and through it the GPU check).

A step is an explicit inner loop over its micro-batches (nanoGPT's shape): forward and
backward of each, gradients kept local until the last (DDP's ``no_sync``); then, where a
:class:`StepControl` takes part, every rank agrees on the step (a non-finite loss, a stop
request); then clipping, the optimizer and the EMA. Nothing reads a value back from the
device: the sums of loss, correct predictions and images stay where the model computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from paratrain.data.device_batches import to_model
from paratrain.data.samplers import StepPlan
from paratrain.engine.run.control import StepControl
from paratrain.engine.run.recipe import Recipe
from paratrain.engine.run.state import Progress
from paratrain.parallel.parts import ModelParts

Lap = Callable[[str], None]  # called as each phase of a step ends (bench times them)


@dataclass
class Stepper:
    """What a step needs: the model's parts, the optimizer, the recipe around them, and
    (in a training run) the control that makes every rank decide alike."""

    parts: ModelParts
    optimizer: torch.optim.Optimizer
    recipe: Recipe
    control: StepControl | None = None


@dataclass
class StepResult:
    sums: torch.Tensor  # (loss x n, correct, n) of the step's images, on the device
    images: int  # this process's images
    skipped: bool | torch.Tensor  # a device flag under a sync-free skip
    trained: int = 0  # the step's images over every model copy


def train_step(
    stepper: Stepper,
    micro_batches: Iterable,
    count: int,
    progress: Progress | None = None,
    *,
    sync: bool = True,
    lap: Lap | None = None,
    plan: StepPlan | None = None,
) -> StepResult:
    """One optimizer step over ``count`` micro-batches. ``sync``: the last micro-batch
    averages the gradients over the replicas (False: every one keeps them local, which
    bench uses to time a step without communication). ``progress``: where training
    stands, for the control's messages. ``plan``: how the micro-batches weigh (--order
    global); None: each micro-batch's mean loss over ``count`` alike."""
    parts, recipe, optimizer, control = (
        stepper.parts,
        stepper.recipe,
        stepper.optimizer,
        stepper.control,
    )
    if control is not None:
        control.begin_step(parts.buffers())
    sums, images_seen = _micro_steps(stepper, micro_batches, count, sync, lap, plan)
    if recipe.freezing is not None:  # --freeze-epochs: the backbone's gradients dropped
        recipe.freezing.drop_grads()
    if lap is not None:
        lap("backward")
    skipped: bool | torch.Tensor = False
    if control is not None:
        skipped = control.judge(sums[0], progress or Progress())
    if skipped is not True:
        sums = _update(stepper, sums, skipped)
    if control is not None:
        control.end_step(skipped)
    optimizer.zero_grad(set_to_none=True)
    if lap is not None:
        lap("optimizer")
    trained = plan.images if plan is not None else images_seen * parts.replicas
    return StepResult(sums, images_seen, skipped, trained)


def _micro_steps(
    stepper: Stepper,
    micro_batches: Iterable,
    count: int,
    sync: bool,
    lap: Lap | None,
    plan: StepPlan | None,
) -> tuple[torch.Tensor, int]:
    """Forward and backward over the step's micro-batches (the last one averaging the
    gradients, where ``sync``): the loss, correct and image sums where the model
    computes, and the images this process saw (a stand-in of ``plan`` not counted)."""
    parts, recipe = stepper.parts, stepper.recipe
    sums = torch.zeros(3, dtype=torch.float64, device=parts.output_device)
    images_seen = 0
    for micro, (images, labels) in enumerate(micro_batches):
        images = to_model(images, parts.input_device, parts.memory_format)  # may augment there
        labels = labels.to(parts.output_device, non_blocking=True)
        if lap is not None:
            lap("data")
        targets = recipe.task.targets(labels)  # several labels an image: their 0/1 rows
        if recipe.mixer is not None:  # train accuracy is then against the unmixed labels
            images, targets = recipe.mixer(images, targets)
        local = micro < count - 1 or not sync
        with parts.no_sync() if local else contextlib.nullcontext():
            criterion = recipe.criterion_for(images)  # with --teacher, its logits first
            divisor = recipe.grad_accum if plan is None else plan.divisors[micro]
            loss, logits = parts.forward_backward(
                images, targets, criterion, recipe.precision, divisor, lap
            )
        n = labels.numel() if plan is None else plan.real[micro]
        images_seen += n
        if loss is not None and logits is not None and n:  # a pipeline's last stage alone
            # has them; on the device, with scalars from the host: nothing waits
            sums[0] += loss.double() * n
            sums[1] += recipe.task.correct(logits, labels)
            sums[2] += n
    parts.after_backward()
    return sums, images_seen


def _update(stepper: Stepper, sums: torch.Tensor, skipped: bool | torch.Tensor) -> torch.Tensor:
    """Clip, step the optimizer (skipped on the device where ``skipped`` is a flag there)
    and the EMA; the step's sums, zero where the flag skipped it."""
    parts, recipe, optimizer = stepper.parts, stepper.recipe, stepper.optimizer
    if recipe.clip_grad is not None:
        recipe.precision.unscale(optimizer)
        grads = [p for p in parts.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(grads, recipe.clip_grad)
    flag = skipped if isinstance(skipped, torch.Tensor) else None
    recipe.precision.step(optimizer, found_inf=flag)
    if recipe.ema is not None:
        recipe.ema.update()
    if flag is not None:
        sums = torch.where(flag > 0, 0.0, sums)
    return sums
