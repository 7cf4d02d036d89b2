"""The Strategy interface and the Layout value: everything the rest of paratrain asks of
a way to spread a model over processes and devices.

A strategy answers, for its own name only: which settings it takes and their rules,
what it needs of the machine, which rank reads which batch (its :class:`Layout`), how
much memory a device needs (for `paratrain plan` and `--strategy auto`), how it builds
and wraps the model (:class:`ModelParts`), and whether its checkpoints are written whole
or each rank its shards. Nothing outside ``parallel/`` asks for a strategy by name.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from paratrain.errors import UserError
from paratrain.parallel import STRATEGIES
from paratrain.parallel.layout import Layout

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

    from paratrain.config import TrainConfig
    from paratrain.distributed.runtime import Runtime
    from paratrain.parallel.partition import Traced, Unit
    from paratrain.parallel.parts import ModelParts


@dataclass
class DeviceMemory:
    """What one device needs to train, by kind, for one strategy (`paratrain plan`)."""

    strategy: str
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    detail: str = ""
    teacher: int = 0  # --teacher's weights on this device (its forward saves nothing)
    average: int = 0  # the EMA weights' copy (--ema-decay), where the strategy keeps one
    cast: int = 0  # autocast's half-size copies of the weights, kept from forward to backward
    scratch: int = 0  # a CPU backward's reordered weight and per-thread partial gradients

    @property
    def fixed(self) -> int:
        """Bytes per device whatever the batch: weights, gradients, optimizer state, the
        teacher's and the average's weights, autocast's copies, the kernels' scratch."""
        weights = self.parameters + self.teacher + self.average + self.cast
        return weights + self.gradients + self.optimizer + self.scratch

    @property
    def total(self) -> int:
        """Bytes per device in all."""
        return self.fixed + self.activations


@dataclass
class MemoryProfile:
    """One profiled training step of a model, unit by unit (parallel/partition), the
    numbers every strategy's estimate reads: fp32 parameters, their gradients and
    ``slots`` optimizer tensors each, and what autograd saves at ``batch`` images."""

    model: nn.Module
    traced: Traced
    starts: list[int]  # balanced stage starts over ``devices``
    batch: int
    profiled_batch: int
    devices: int
    slots: int
    microbatches: int = 4
    schedule: str = "1f1b"
    blocks: list[int] = field(default_factory=list)  # parameter bytes of each block
    checkpointing: bool = False  # --activation-checkpointing: only its takers are offered
    checkpointed: frozenset[str] = frozenset()  # units whose activations are recomputed
    threads: int = 0  # CPU threads a process computes with (0: on a GPU)
    compute_bytes: int = 4  # a weight's element in the forward (2 under bf16/fp16 autocast)

    @property
    def units(self) -> list[Unit]:
        return self.traced.units

    @property
    def scale(self) -> float:
        return self.batch / self.profiled_batch

    @property
    def parameters(self) -> int:
        return sum(u.parameter_bytes for u in self.units)

    @property
    def trainable(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)

    def _held(self) -> list[int]:
        """What autograd holds, at the profiled batch, while backward is at each unit:
        backward goes through the units last first, each giving back what it kept, so at
        unit k everything the units before it keep is still held, with k's own
        activations (recomputed, where k is checkpointed: such a unit keeps its input
        only). A tensor two units both keep (one's output, the next's input) is counted
        once."""
        held, peaks = 0, []
        keeps_output = False  # the unit before keeps its output, this unit's input
        for unit in self.units:
            again = unit.name in self.checkpointed
            kept = unit.input_bytes if again else unit.activation_bytes
            shared = unit.input_bytes if keeps_output and (again or unit.saves_input) else 0
            own = unit.activation_bytes + (
                unit.input_bytes if again and not unit.saves_input else 0
            )
            peaks.append(held + own - shared)
            held += kept - shared
            keeps_output = unit.saves_output and not again
        return peaks

    @property
    def saved(self) -> float:
        """The most autograd holds at once, at ``batch`` (:meth:`_held`)."""
        return max(self._held(), default=0) * self.scale

    @property
    def freed_gradients(self) -> float:
        """By how much less than all of the gradients and the most autograd holds
        (``trainable + saved``) a process's backward peaks when its gradients are freed
        every step (one process: ``zero_grad(set_to_none=True)``, no DDP buckets): at
        unit k it holds what :meth:`_held` says and the gradients of k and the units
        after it, which backward has made; not yet those of the units before."""
        held = [h * self.scale for h in self._held()]  # walked once, for both terms
        trainable, after, made = self.trainable, 0, []
        for unit in reversed(self.units):
            after += unit.parameter_bytes
            made.append(min(after, trainable))  # frozen weights get none
        peak = max(h + grads for h, grads in zip(held, made[::-1], strict=True))
        return trainable + max(held, default=0) - peak

    @property
    def scratch(self) -> int:
        """What a convolution's backward on a CPU holds beyond the tensors (oneDNN): its
        weight reordered for the backward-data kernel, in the dtype it computes in, and
        for each thread after the first that thread's own partial weight gradient (the
        images are split over the threads, then the partials summed); the largest
        weight's. Measured on a 2-core EPYC without AVX-512: ResNet-18 at 64 px peaks
        18 MiB above what it holds after layer4.0.conv2's backward (a 512x512x3x3 weight:
        9 MiB), and 9.2 MiB less at 1 thread than at 2. None on a GPU (threads 0)."""
        if self.threads < 1:
            return 0
        largest = max((p.numel() for p in self.model.parameters()), default=0)
        return largest * (self.compute_bytes + 4 * (self.threads - 1))

    @property
    def cast(self) -> int:
        """Autocast's weight copies held at once: every unit's, but of the checkpointed
        ones only the unit being recomputed."""
        kept = [u.weight_copy_bytes for u in self.units if u.name not in self.checkpointed]
        again = [u.weight_copy_bytes for u in self.units if u.name in self.checkpointed]
        return sum(kept) + max(again, default=0)

    @property
    def workspace(self) -> float:
        """Backward's gradient through the largest unit, at ``batch``."""
        return max(u.activation_bytes for u in self.units) * self.scale


# the options a strategy may take or refuse, with their flags, for the one-line refusal
FEATURES = {
    "ema": ("--ema-decay", lambda cfg: isinstance(cfg.ema_decay, float) and cfg.ema_decay > 0),
    "compile": ("--compile", lambda cfg: cfg.compile),
    "activation_checkpointing": (
        "--activation-checkpointing",
        lambda cfg: cfg.activation_checkpointing,
    ),
    "grad_compression": ("--grad-compression", lambda cfg: cfg.grad_compression != "none"),
    "sync_bn": ("--sync-bn", lambda cfg: cfg.sync_bn),
    "fp16": ("--precision 16-mixed", lambda cfg: cfg.precision == "16-mixed"),
    "teacher": ("--teacher", lambda cfg: cfg.teacher is not None),
}


class Strategy:
    """One way to spread a model over processes and devices; each ``parallel/<name>.py``
    holds one instance, ``STRATEGY``, found by name through ``parallel.STRATEGIES``."""

    name: ClassVar[str]
    why: ClassVar[str] = ""  # what it costs and saves: `plan` and `--strategy auto` say it
    one_process: ClassVar[bool] = False  # drives every device from a single process
    one_process_hint: ClassVar[str] = ""  # what --nproc does instead, for the refusal
    min_world: ClassVar[int] = 1
    spreads: ClassVar[str] = "spreads the model across processes"  # why min_world
    fewer_hint: ClassVar[str] = ""  # the way to run it below min_world, for the refusal
    min_devices: ClassVar[int] = 1  # the devices its layout needs (plan: 2 to partition)
    speed_order: ClassVar[int] = 100  # --strategy auto takes the lowest that fits
    takes: ClassVar[frozenset[str]] = frozenset(FEATURES)
    compiles_blocks: ClassVar[bool] = True  # --compile-scope blocks (modules compiled in place)
    torch_apis: ClassVar[tuple[str, ...]] = ()  # newer torch it calls (torch_api.FEATURES)

    # ---------------------------------------------------------------- settings, machine

    def check_settings(self, cfg: TrainConfig, world: int | None) -> None:
        """The settings this strategy takes and their rules, each refusal one line;
        ``world``: the processes of the job where known (None: decided later)."""
        from paratrain.torch_api import need

        need(self.torch_apis, f"--strategy {self.name}")
        for feature, (flag, on) in FEATURES.items():
            if feature not in self.takes and on(cfg):
                others = ", ".join(self._takers(feature))
                raise UserError(f"{flag} works with --strategy {others}, not {self.name}")
        self._check_compile_scope(cfg)
        self.check_own(cfg, world)
        if self.one_process and (world or 1) > 1:
            raise UserError(
                f"--strategy {self.name} runs in a single process; leave out --nproc, torchrun "
                f"and srun ({self.one_process_hint})"
            )
        if world is not None and world < self.min_world:
            raise UserError(
                f"--strategy {self.name} {self.spreads}; start {self.min_world} or more "
                f"(--nproc N, torchrun or srun){self._fewer(cfg)}"
            )

    def _fewer(self, cfg: TrainConfig) -> str:
        """The way to run below ``min_world``, where there is one (and for a resume,
        that it takes this run's checkpoint)."""
        if not self.fewer_hint:
            return ""
        resumed = " (it resumes this run's checkpoint, resharded)" if cfg.resume else ""
        return f", or {self.fewer_hint}{resumed}"

    def check_own(self, cfg: TrainConfig, world: int | None) -> None:
        """The rules of the settings only this strategy reads (--stages, --devices ...)."""

    def _check_compile_scope(self, cfg: TrainConfig) -> None:
        if cfg.compile and cfg.compile_scope == "blocks" and not self.compiles_blocks:
            raise UserError(
                f"--compile-scope blocks does not work with --strategy {self.name} (its "
                "modules are copied every step, their compiled forwards with them); use "
                "--compile-scope model"
            )

    @property
    def keeps_average(self) -> bool:
        """Whether it keeps an average of the weights (--ema-decay; auto turns one on
        where it does)."""
        return "ema" in self.takes

    def _takers(self, feature: str) -> list[str]:
        return [name for name in STRATEGIES if feature in get(name).takes]

    def check_machine(self, cfg: TrainConfig, world: int) -> None:
        """What this machine must have for it (devices), refused once before any process
        starts."""

    # ---------------------------------------------------------------- layout

    def layout(self, cfg: TrainConfig, world: int, rank: int = 0, per_node: int = 0) -> Layout:
        """Which rank reads which batch: by default every rank a whole copy."""
        return Layout(world, rank, replicate=world)

    def norm_batch(self, cfg: TrainConfig, world: int, gpus: int = 0) -> int:
        """The fewest images one BatchNorm layer sees at once in training (2 while
        --batch-size is still auto): the per-process batch, or with --sync-bn every
        data-parallel rank's together."""
        if cfg.batch_size == "auto":
            return 2
        images = cfg.batch_size
        if cfg.sync_bn and "sync_bn" in self.takes:
            images *= self.layout(cfg, world).dp_size
        return images

    # ---------------------------------------------------------------- memory

    def memory(self, profile: MemoryProfile) -> DeviceMemory | None:
        """What the fullest device needs; None where `paratrain plan` leaves it out."""
        return None

    def planned(self, profile: MemoryProfile) -> DeviceMemory | None:
        """``memory``, where this strategy takes what the profile was made for."""
        if profile.checkpointing and "activation_checkpointing" not in self.takes:
            return None
        return self.memory(profile)

    # ---------------------------------------------------------------- the model

    def build(
        self, make: Callable[[torch.device | None], nn.Module], runtime: Runtime
    ) -> nn.Module:
        """The model every rank starts from, identical on every rank: ``make(None)``
        builds it on the CPU with its weights (seeded alike); a strategy that loads the
        weights in shards may build on the meta device instead."""
        return make(None)

    def wrap(self, model: nn.Module, cfg: TrainConfig, runtime: Runtime) -> ModelParts:
        """The model placed, wrapped, sharded or staged."""
        raise NotImplementedError

    def place_teacher(self, teacher: nn.Module, cfg: TrainConfig, runtime: Runtime) -> nn.Module:
        """--teacher placed where the student's inputs are: a whole copy on this rank's
        device (a strategy that shards its model shards the teacher too)."""
        return teacher.to(runtime.device)

    def teacher_bytes(self, teacher: int, devices: int) -> int | None:
        """What the teacher's ``teacher`` parameter bytes take on one device; None where
        this strategy takes no teacher."""
        return teacher if "teacher" in self.takes else None


def whole_model_memory(name: str, profile: MemoryProfile, detail: str) -> DeviceMemory:
    """Every device holds the whole model and a whole batch (ddp's layout). On one
    device there is no DDP, whose buckets hold the gradients all step: they are freed
    each step and made again during backward, as activations are given back."""
    freed = profile.freed_gradients if profile.devices == 1 else 0.0
    return DeviceMemory(
        name,
        profile.parameters,
        profile.trainable,
        profile.slots * profile.trainable,
        int(profile.saved + profile.workspace - freed),
        detail,
        cast=profile.cast,
        scratch=profile.scratch,
    )


def staged_memory(name: str, profile: MemoryProfile, pipelined: bool) -> DeviceMemory:
    """The fullest stage of a model cut over the devices: its weights, its gradients
    and optimizer state, and its activations — all of the batch for split and GPipe, at
    most P - s micro-batches in flight on stage s under 1F1B."""
    from paratrain.parallel.partition import stage_units

    stages = stage_units(profile.traced, profile.starts)
    worst: DeviceMemory | None = None
    for index, stage in enumerate(stages):
        weights = sum(u.parameter_bytes for u in stage)
        acts = sum(u.activation_bytes for u in stage) * profile.scale
        if pipelined and profile.schedule == "1f1b":
            acts *= min(profile.microbatches, len(stages) - index) / profile.microbatches
        space = max(u.activation_bytes for u in stage) * profile.scale
        if pipelined:
            space /= profile.microbatches
        row = DeviceMemory(
            name,
            weights,
            weights,
            profile.slots * weights,
            int(acts + space),
            f"stage {index} of {len(stages)} is the largest",
            cast=sum(u.weight_copy_bytes for u in stage),
            scratch=profile.scratch,  # the whole model's largest weight: at most
        )
        if worst is None or row.total > worst.total:
            worst = row
    assert worst is not None
    if pipelined:
        worst.detail += f", {profile.microbatches} micro-batches, {profile.schedule}"
    return worst


def parse_list(text: str | None) -> list[str]:
    """A comma-separated flag value as its items."""
    return [item.strip() for item in (text or "").split(",") if item.strip()]


def get(name: str) -> Strategy:
    """The strategy called ``name`` (a name the settings were checked against): the
    ``STRATEGY`` of ``paratrain.parallel.<name>``."""
    if name not in STRATEGIES:
        raise UserError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {name!r}")
    strategy: Strategy = importlib.import_module(f"paratrain.parallel.{name}").STRATEGY
    return strategy
