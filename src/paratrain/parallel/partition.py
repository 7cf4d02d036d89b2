"""Cut any traceable model into consecutive stages, balanced by measured cost.

The model is traced with torch.fx into one graph of operations. A *cut point* is a place
in that graph where exactly one value is alive, so the model's forward is a chain there:
stage k's output is stage k+1's only input. The operations between two cut points form
a *unit* (a ResNet block, a ViT encoder layer, a pooling layer), named by the module
path its operations share. Stages are runs of consecutive units: automatically balanced
from a few profiled forward and backward passes, or where ``--split-points`` says.

Every stage is a ``torch.fx.GraphModule`` that holds the original submodules under their
original names, so the stages' state dicts together are the model's state dict.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from paratrain.errors import UserError
from paratrain.parallel.optim_state import within


def optimizer_slots(opt: str, momentum: float) -> int:
    """Tensors of optimizer state per parameter: AdamW's two moments, SGD's momentum."""
    if opt == "adamw":
        return 2
    return 1 if momentum > 0 else 0


def _forward_saving(stages, sample, cast, autocast, weights, shapes, saved):
    """Each stage's forward on the one before's output (its inputs, outputs and seconds);
    into ``saved``, where given, the bytes each stage's autograd saves for backward and
    whether they hold the stage's input and its output."""
    inputs, outputs, forward = [], [], []
    x = sample
    for index, stage in enumerate(stages):
        x = x.detach().requires_grad_(x.is_floating_point() and index > 0)
        inputs.append(x)
        seen: dict[int, int] = {}
        copies: dict[int, int] = {}

        def pack(tensor: torch.Tensor, seen=seen, copies=copies) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if tensor.dtype == autocast and tuple(tensor.shape) in shapes:
                copies[storage.data_ptr()] = storage.nbytes()  # a weight's autocast copy
            elif storage.data_ptr() not in weights:  # a weight's view (linear's t())
                seen[storage.data_ptr()] = storage.nbytes()
            return tensor

        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast():
            x = stage(x)
        forward.append(time.perf_counter() - start)
        outputs.append(x)
        if saved is not None:
            ends = (inputs[-1], x)
            ends_kept = (_storage(t) in seen for t in ends)
            saved[index] = (sum(seen.values()), sum(copies.values()), *ends_kept)
    return inputs, outputs, forward


def _storage(tensor: object) -> int | None:
    return tensor.untyped_storage().data_ptr() if isinstance(tensor, torch.Tensor) else None


def _backward_timed(stages, inputs, outputs, forward, timings) -> None:
    """Each stage's backward, last first; into ``timings``, where given, its forward plus
    backward seconds."""
    grad = torch.ones_like(outputs[-1]) / outputs[-1].numel()
    for index in range(len(stages) - 1, -1, -1):
        start = time.perf_counter()
        wanted: list[torch.Tensor] = [inputs[index]] if inputs[index].requires_grad else []
        wanted += [p for p in stages[index].parameters() if p.requires_grad]
        grads = torch.autograd.grad(outputs[index], wanted, grad, allow_unused=True)
        if timings is not None:
            timings[index].append(forward[index] + time.perf_counter() - start)
        grad = grads[0] if inputs[index].requires_grad else None
        if grad is None and index > 0:
            grad = torch.zeros_like(outputs[index - 1])


@dataclass
class Unit:
    """Consecutive graph nodes between two cut points."""

    name: str
    nodes: list[fx.Node] = field(repr=False)
    parameters: int = 0  # elements
    parameter_bytes: int = 0
    seconds: float = 0.0  # forward + backward, measured
    activation_bytes: int = 0  # saved for backward at the profiled batch size
    input_bytes: int = 0  # its input at the profiled batch size (all a checkpointed unit keeps)
    weight_copy_bytes: int = 0  # autocast's half-size copies of its weights, kept for backward
    saves_input: bool = False  # autograd keeps its input (the unit before's output) itself
    saves_output: bool = False  # ... or its output (the unit after's input)


@dataclass
class Traced:
    graph: fx.GraphModule
    units: list[Unit]
    profiled_batch: int = 0  # the batch the activation bytes were measured at

    @property
    def names(self) -> list[str]:
        """The units' names, in order."""
        return [unit.name for unit in self.units]


def trace(model: nn.Module, model_name: str = "model") -> Traced:
    """The model's graph and its units. A model fx cannot trace is a UserError."""
    try:
        graph = fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many kinds for data-dependent control flow
        raise UserError(
            f"{model_name} cannot be cut into stages: torch.fx could not trace it "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); use --strategy ddp or fsdp"
        ) from None
    units = _units(graph)
    for unit in units[1:]:
        _not_in_place(graph, unit.nodes[0])
    own = dict(graph.named_parameters())
    for unit in units:
        targets = {str(n.target) for n in unit.nodes if n.op in ("call_module", "get_attr")}
        params = [p for name, p in own.items() if any(within(name, t) for t in targets)]
        unit.parameters = sum(p.numel() for p in params)
        unit.parameter_bytes = sum(p.numel() * p.element_size() for p in params)
    return Traced(graph, units)


def _not_in_place(graph: fx.GraphModule, node: fx.Node) -> None:
    """A stage's input is a leaf that requires grad (its gradient goes back to the stage
    before); autograd refuses an in-place operation on it, such as ResNet's ReLU after
    the stem. Same values, one more buffer."""
    if node.op == "call_module":
        module = graph.get_submodule(str(node.target))
        if getattr(module, "inplace", False):
            setattr(module, "inplace", False)  # noqa: B010 (a module attribute, not a tensor)
    elif node.kwargs.get("inplace"):
        node.kwargs = {**node.kwargs, "inplace": False}
        graph.recompile()


def _units(graph: fx.GraphModule) -> list[Unit]:
    nodes = list(graph.graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    last_use = {n: max((order[u] for u in n.users), default=order[n]) for n in nodes}
    groups: list[list[fx.Node]] = [[]]
    reach = -1  # how far the values of the nodes before this one are used
    for i, node in enumerate(nodes):
        if node.op == "output":
            break
        if node.op != "placeholder":
            groups[-1].append(node)
            if reach <= i < last_use[node]:
                groups.append([])  # only this node's value crosses: a cut point
        reach = max(reach, last_use[node])
    units: list[Unit] = []
    for group in (g for g in groups if g):
        name = _common_path(group)
        previous = units[-1].name if units else None
        if units and (name is None or name == previous or name.startswith(f"{previous}.")):
            units[-1].nodes.extend(group)  # a block's trailing ReLU, a flatten: same unit
        else:
            units.append(Unit(name or group[0].name, group))
    return units


def _common_path(group: list[fx.Node]) -> str | None:
    targets = [str(n.target).split(".") for n in group if n.op in ("call_module", "get_attr")]
    if not targets:
        return None
    common = os.path.commonprefix(targets)
    return ".".join(common) if common else "+".join(dict.fromkeys(t[0] for t in targets))


def stage_starts(units: list[str], split_points: list[str], stages: int) -> list[int]:
    """``--split-points``: the units where stages 2..P begin, by name (a module path
    that names a unit or starts one: ``layer3`` starts at ``layer3.0``)."""
    if len(split_points) != stages - 1:
        raise UserError(
            f"--split-points: {stages} stages need {stages - 1} split point(s), "
            f"got {len(split_points)}"
        )
    starts = [0]
    for point in split_points:
        index = next(
            (i for i, name in enumerate(units) if name == point or name.startswith(point + ".")),
            None,
        )
        if index is None or index == 0:
            raise UserError(
                f"--split-points: {point!r} does not begin a unit after the first; "
                f"units: {', '.join(units)}"
            )
        if index <= starts[-1]:
            raise UserError(f"--split-points must be in model order and distinct: {point!r}")
        starts.append(index)
    return starts


def balance(
    costs: list[float],
    stages: int,
    sizes: list[float] | None = None,
    limit: float | None = None,
) -> list[int]:
    """Start indices of ``stages`` contiguous groups minimising the costliest group (the
    pipeline's throughput is set by its slowest stage); dynamic programming, exact. With
    ``sizes`` (bytes a unit needs) and ``limit`` (bytes a device has), only groups that
    fit are allowed; a UserError when no cut fits."""
    n = len(costs)
    if stages > n:
        raise UserError(f"{stages} stages asked for, but the model has only {n} units")
    prefix, used = [0.0], [0.0]
    for cost, size in zip(costs, sizes or [0.0] * n, strict=True):
        prefix.append(prefix[-1] + cost)
        used.append(used[-1] + size)
    room = float("inf") if limit is None else limit
    inf = float("inf")
    # best[k][i]: the least possible maximum for the first i units in k groups
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if used[i] - used[j] > room:
                    continue  # this group would not fit one device
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-15:
                    best[k][i], cut[k][i] = value, j
    if best[stages][n] == inf:
        raise UserError(
            f"no cut into {stages} stages fits {room / 2**30:.2f} GiB per device (the "
            f"model needs {used[-1] / 2**30:.2f} GiB in all); use more stages, a smaller "
            "--batch-size, or --strategy fsdp"
        )
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def stage_units(traced: Traced, starts: list[int]) -> list[list[Unit]]:
    """The units of each stage, given where the stages start."""
    bounds = [*starts, len(traced.units)]
    return [traced.units[bounds[s] : bounds[s + 1]] for s in range(len(starts))]


def build_stages(
    traced: Traced, starts: list[int], contiguous_outputs: bool = False
) -> list[fx.GraphModule]:
    """One GraphModule per stage, holding the original submodules and parameters under
    their original qualified names (GraphModule copies what its graph refers to).
    ``contiguous_outputs``: every stage but the last hands on a contiguous tensor (what
    sending it to another process needs)."""
    nodes = list(traced.graph.graph.nodes)
    output = next(n for n in nodes if n.op == "output")
    per_stage = stage_units(traced, starts)
    stages, previous = [], None
    for stage, units in enumerate(per_stage):
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        if previous is None:
            for node in (n for n in nodes if n.op == "placeholder"):
                env[node] = graph.node_copy(node)
        else:
            env[previous] = graph.placeholder("x")
        chosen = [n for u in units for n in u.nodes]
        for node in chosen:
            env[node] = graph.node_copy(node, env.__getitem__)
        last = chosen[-1]
        if stage == len(per_stage) - 1:
            graph.output(fx.map_arg(output.args[0], env.__getitem__))
        elif contiguous_outputs:
            graph.output(graph.call_method("contiguous", (env[last],)))
        else:
            graph.output(env[last])
        stages.append(fx.GraphModule(traced.graph, graph, class_name=f"Stage{stage}"))
        previous = last
    return stages


def sample_images(
    image_size: int, batch: int, memory_format: torch.memory_format = torch.contiguous_format
) -> torch.Tensor:
    """Random CPU images to profile with, as many as a stage will compute at once: where
    the time goes depends on the batch (measured, ResNet-18 at 64 px: at 2 images the
    last blocks, with most of the weights, weigh as much as the first three layers; at 8
    the first layers, with the largest maps, take two thirds)."""
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(max(2, batch), 3, image_size, image_size, generator=generator)
    return sample.contiguous(memory_format=memory_format)


def profile(
    traced: Traced, sample: torch.Tensor, repeats: int = 3, autocast: torch.dtype | None = None
) -> None:
    """Per unit: forward + backward seconds (median of ``repeats`` after one warm-up)
    and the bytes autograd saves for backward, at ``sample``'s batch size; under
    ``autocast`` (the run's mixed precision) what it saves then, half-size copies
    of inputs and weights included."""
    cast = (
        (lambda: torch.autocast(sample.device.type, dtype=autocast))
        if autocast is not None
        else contextlib.nullcontext
    )
    stages = build_stages(traced, list(range(len(traced.units))))
    weights = {t.untyped_storage().data_ptr() for t in traced.graph.parameters()}
    # autocast's half-size copies of the weights are saved too; they do not grow with
    # the batch, so they are not activations (known by a weight's shape in that dtype,
    # or a matrix's transposed: linear saves its weight's t())
    shapes = {
        s
        for p in traced.graph.parameters()
        for s in (tuple(p.shape), tuple(p.mT.shape) if p.dim() == 2 else ())
    }
    timings: list[list[float]] = [[] for _ in stages]
    saved: list[tuple[int, int, bool, bool]] = [(0, 0, False, False)] * len(stages)
    for attempt in range(repeats + 1):
        inputs, outputs, forward = _forward_saving(stages, sample, cast, autocast, weights, shapes,
                                                   saved if attempt == 0 else None)  # fmt: skip
        _backward_timed(stages, inputs, outputs, forward, timings if attempt > 0 else None)
    for unit, seconds, kept, given in zip(traced.units, timings, saved, inputs, strict=True):
        unit.seconds = statistics.median(seconds)
        unit.activation_bytes, unit.weight_copy_bytes, unit.saves_input, unit.saves_output = kept
        unit.input_bytes = given.numel() * given.element_size()


@dataclass
class StagePlan:
    units: list[str]
    parameters: int
    parameter_bytes: int
    time_share: float
    activation_bytes: int  # at the profiled batch size


def describe(traced: Traced, starts: list[int]) -> list[StagePlan]:
    """Each stage's units, parameters, share of the time and memory: what the plan prints."""
    total = sum(unit.seconds for unit in traced.units) or 1.0
    plans = []
    for units in stage_units(traced, starts):
        plans.append(
            StagePlan(
                units=[u.name for u in units],
                parameters=sum(u.parameters for u in units),
                parameter_bytes=sum(u.parameter_bytes for u in units),
                time_share=sum(u.seconds for u in units) / total,
                activation_bytes=sum(u.activation_bytes for u in units),
            )
        )
    return plans


def format_plan(plans: list[StagePlan], devices: list[str], batch: int) -> str:
    """The stage plan as lines, one per stage, with where each stage runs."""
    lines = [f"stage plan ({len(plans)} stages; activations at batch {batch}):"]
    for index, (plan, device) in enumerate(zip(plans, devices, strict=True)):
        span = plan.units[0] if len(plan.units) == 1 else f"{plan.units[0]} .. {plan.units[-1]}"
        lines.append(
            f"  stage {index} on {device}: {span} ({len(plan.units)} units), "
            f"{plan.parameters / 1e6:.2f}M parameters, {plan.time_share:.0%} of the time, "
            f"{(plan.parameter_bytes + plan.activation_bytes) / 2**20:.0f} MiB "
            f"(weights {plan.parameter_bytes / 2**20:.0f}, activations "
            f"{plan.activation_bytes / 2**20:.0f})"
        )
    return "\n".join(lines)


def user_starts(
    traced: Traced, stages: int, split_points: list[str] | None, model_name: str = "model"
) -> list[int] | None:
    """The stage starts ``--split-points`` asks for (None: to be balanced), after checking
    that the model has enough units; the same answer on every rank."""
    if stages > len(traced.units):
        raise UserError(
            f"{model_name} has {len(traced.units)} units where it can be cut; "
            f"{stages} stages are too many"
        )
    return stage_starts(traced.names, split_points, stages) if split_points else None


def measure(traced: Traced, sample: torch.Tensor, autocast: torch.dtype | None = None) -> None:
    """Profile the units in training mode (under ``autocast`` where the run computes
    in a lower precision), leaving weights, buffers and RNG as found."""
    was_training = traced.graph.training
    buffers = {name: b.clone() for name, b in traced.graph.named_buffers()}
    traced.graph.train()
    with torch.random.fork_rng(devices=[]):
        profile(traced, sample, autocast=autocast)
    traced.profiled_batch = len(sample)
    traced.graph.train(was_training)
    with torch.no_grad():
        for name, buffer in traced.graph.named_buffers():
            buffer.copy_(buffers[name])


def training_bytes(traced: Traced, batch: int, slots: int) -> list[float]:
    """Per unit, what training it needs: weights, their gradients and ``slots`` optimizer
    tensors each, and its activations at ``batch`` (scaled from the profiled batch)."""
    scale = batch / max(traced.profiled_batch, 1)
    return [u.parameter_bytes * (2 + slots) + u.activation_bytes * scale for u in traced.units]


def device_memory(device: torch.device) -> int | None:
    """A CUDA device's memory in bytes; None on the CPU (no limit is known)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def choose_starts(
    traced: Traced, stages: int, batch: int, slots: int, limit: int | None
) -> list[int]:
    """Balanced by measured time, every stage within ``limit`` bytes of memory."""
    sizes = training_bytes(traced, batch, slots)
    return balance([unit.seconds for unit in traced.units], stages, sizes, limit)


def plan_stages(
    model: nn.Module,
    stages: int,
    sample: torch.Tensor,
    split_points: list[str] | None = None,
    model_name: str = "model",
    batch: int | None = None,
    slots: int = 1,
    limit: int | None = None,
    autocast: torch.dtype | None = None,
) -> tuple[Traced, list[int]]:
    """Trace, profile and choose where the stages start: the user's split points, or
    balanced by measured time with every stage's training memory at ``batch`` within
    ``limit``. The profile runs on ``sample``'s device."""
    traced = trace(model, model_name)
    starts = user_starts(traced, stages, split_points, model_name)
    measure(traced, sample, autocast)
    if starts is None:
        starts = choose_starts(traced, stages, batch or len(sample), slots, limit)
    return traced, starts
