"""One checkpoint format for every strategy: the state a single-device run would have.

The model's state dict has the unwrapped model's keys. The optimizer's state is indexed
like an optimizer built over the whole model's trainable parameters, in the model's own
order (what DDP and a single device save anyway). Staged and sharded strategies convert
their local optimizer state through parameter names: index -> name -> index.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

# layers whose weights and biases --norm-weight-decay covers
NORM_LAYERS = (
    nn.modules.batchnorm._BatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.instancenorm._InstanceNorm,
)


@dataclass(frozen=True)
class Grouping:
    """How the optimizer groups the parameters: by kind for weight decay
    (--norm-weight-decay, --bias-weight-decay), and by learning-rate scale (--head-lr-mult,
    --layer-decay). Made once from the whole model (a pipeline stage alone cannot tell a
    block's depth), so every strategy and every checkpoint index the parameters alike."""

    by_kind: bool = False
    scales: Mapping[str, float] = field(default_factory=dict)  # name -> lr scale (else 1)
    head: str | None = None  # the classifier head's path, where the model has one

    def scale(self, name: str) -> float:
        return self.scales.get(name, 1.0)

    def in_head(self, name: str) -> bool:
        return self.head is not None and within(name, self.head)


def within(name: str, module: str) -> bool:
    """Whether ``name`` (a parameter's or a module's) is ``module`` or inside it."""
    return name == module or name.startswith(module + ".")


def grouping(cfg, model: nn.Module | None = None) -> Grouping:
    """The grouping ``cfg`` asks for, over ``model`` (the whole, unwrapped model)."""
    by_kind = splits_decay(cfg)
    if model is None:
        return Grouping(by_kind)
    from paratrain.errors import UserError
    from paratrain.models.registry import classifier_head

    try:
        head: str | None = classifier_head(model, cfg.model)
    except UserError:
        head = None
    names = [name for name, _ in model.named_parameters()]
    decay, mult = getattr(cfg, "layer_decay", None), getattr(cfg, "head_lr_mult", 1.0)
    scales = lr_scales(names, head, decay, mult) if decay or mult != 1.0 else {}
    return Grouping(by_kind, scales, head)


INDEX = re.compile(r"\d+|.*\D\d+")  # layer1, 0, encoder_layer_3, s2: a block's index
CONTAINERS = ("blocks", "layers")  # stages.1.blocks.2 (timm): the index goes on


def block_of(name: str) -> tuple[str, bool]:
    """The block a parameter belongs to, by its name: above the module that owns it,
    the path up to the first index and the plain numbers after it (layer1.0,
    features.3.1, blocks.7, encoder.layers.encoder_layer_3, stages.1.blocks.2), and
    whether it is one; else the module that owns it (conv1, patch_embed.proj,
    encoder.ln)."""
    parts = name.split(".")
    inner = len(parts) - 2  # the components above the module that owns the parameter
    for i, part in enumerate(parts[:inner]):
        if INDEX.fullmatch(part):
            end = i + 1
            while end < inner:
                if parts[end].isdigit():
                    end += 1
                elif parts[end] in CONTAINERS and end + 1 < inner and parts[end + 1].isdigit():
                    end += 2
                else:
                    break
            return ".".join(parts[:end]), True
    return ".".join(parts[:-1]) or name, False


def lr_scales(
    names: list[str], head: str | None, layer_decay: float | None, head_mult: float = 1.0
) -> dict[str, float]:
    """Each parameter's learning-rate scale (those other than 1): the head's
    ``head_mult``; with ``layer_decay``, a block ``d`` blocks below the head
    ``layer_decay ** d`` (timm's layer decay). Consecutive parameters outside any block
    (a stem, a ViT's embeddings) are one layer; the first block after them the next."""

    def in_head(name: str) -> bool:
        return head is not None and within(name, head)

    layer, depth, last, last_indexed = {}, -1, None, True
    for name in names:
        if in_head(name):
            continue
        block, indexed = block_of(name)
        if block != last and (indexed or last_indexed or depth < 0):
            depth += 1
        layer[name], last, last_indexed = depth, block, indexed
    top = depth + 1  # the head's layer
    scales = {}
    for name in names:
        scale = head_mult if in_head(name) else (layer_decay or 1.0) ** (top - layer[name])
        if scale != 1.0:
            scales[name] = scale
    return scales


# a transformer's position embeddings and class tokens: no weight decay with the norms
# (--norm-weight-decay), as timm's and torchvision's ViT recipes keep them
EMBEDDINGS = {
    "pos_embed",
    "pos_embedding",
    "cls_token",
    "class_token",
    "dist_token",
    "reg_token",
    "absolute_pos_embed",
    "relative_position_bias_table",
}


def named_groups(
    model: nn.Module, split: bool | Grouping = False
) -> list[tuple[str, float, list[str]]]:
    """The optimizer's parameter groups by name, in the model's order within each, as
    (kind, lr scale, names): one ("decay"), or, grouped by kind (--norm-weight-decay,
    --bias-weight-decay), the other layers' weights ("decay"), normalisation layers'
    weights and biases and a transformer's position embeddings and class tokens
    ("norm"), the other layers' biases ("bias"); each kind divided
    by learning-rate scale where --head-lr-mult or --layer-decay give some. Every
    strategy groups alike, so the checkpoint's optimizer indexing is one."""
    grouping = split if isinstance(split, Grouping) else Grouping(bool(split))
    kinds: dict[str, list[str]] = {"decay": [], "norm": [], "bias": []}
    if not grouping.by_kind:
        kinds["decay"] = [name for name, p in model.named_parameters() if p.requires_grad]
    else:
        seen: set[int] = set()
        for prefix, module in model.named_modules():
            for name, param in module.named_parameters(recurse=False):
                if not param.requires_grad or id(param) in seen:
                    continue
                seen.add(id(param))
                kind = (
                    "norm"
                    if isinstance(module, NORM_LAYERS) or name in EMBEDDINGS
                    else "bias"
                    if name == "bias"
                    else "decay"
                )
                kinds[kind].append(f"{prefix}.{name}" if prefix else name)
    groups = []
    for kind, names in kinds.items():
        by_scale: dict[float, list[str]] = {}
        for name in names:
            by_scale.setdefault(grouping.scale(name), []).append(name)
        groups += [(kind, scale, members) for scale, members in by_scale.items()]
    return groups


def splits_decay(cfg) -> bool:
    """Whether the settings ask for weight decay by kind of parameter."""
    return cfg.norm_weight_decay is not None or cfg.bias_weight_decay is not None


def trainable_names(model: nn.Module, split: bool | Grouping = False) -> list[str]:
    """The order an optimizer over ``model``'s trainable parameters indexes them in."""
    return [name for _, _, names in named_groups(model, split) for name in names]


def by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state dict indexed 0..n-1 over ``names`` -> keyed by name."""
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }


def by_index(named: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The reverse of :func:`by_name`, over ``names`` (which may be a subset: a stage's)."""
    index = {name: i for i, name in enumerate(names)}
    groups = []
    for group in named["param_groups"]:
        mine = [index[name] for name in group["params"] if name in index]
        if mine:  # a stage holds none of some groups' parameters
            groups.append({**group, "params": mine})
    return {
        "state": {index[name]: value for name, value in named["state"].items() if name in index},
        "param_groups": groups,
    }


KINDS = ("decay", "norm", "bias")  # named_groups' order of kinds


def merge_groups(parts: list[list[dict[str, Any]]], names: list[str]) -> list[dict[str, Any]]:
    """Stages' name-keyed parameter groups -> the whole model's, as named_groups orders
    them: by kind, then by learning-rate scale in the order of ``names``; each group's
    parameters in the order of ``names``."""
    merged: dict[tuple[str, float], dict[str, Any]] = {}
    for groups in parts:
        for group in groups:
            key = (group.get("kind", "decay"), group.get("lr_scale", 1.0))
            merged.setdefault(key, {**group, "params": []})["params"] += group["params"]
    order = {name: i for i, name in enumerate(names)}

    def place(group: dict[str, Any]) -> tuple[int, int]:
        first = min((order[n] for n in group["params"]), default=0)
        return KINDS.index(group.get("kind", "decay")), first

    ordered = sorted(merged.values(), key=place)
    for group in ordered:
        group["params"] = sorted(group["params"], key=order.__getitem__)
    return ordered


def merge_named(parts: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Stages' name-keyed optimizer states -> one over ``names`` (the whole model's)."""
    state: dict[str, Any] = {}
    for part in parts:
        state.update(part["state"])
    return {"state": state, "param_groups": merge_groups([p["param_groups"] for p in parts], names)}


IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable", "differentiable")


def own_implementation(state: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A saved state with this optimizer's implementation flags: a checkpoint of fused
    SGD (plain tensors) loads into an FSDP run, whose sharded parameters take foreach."""
    groups = [
        {**saved, **{k: own[k] for k in IMPLEMENTATION_KEYS if k in own}}
        for saved, own in zip(state["param_groups"], optimizer.param_groups, strict=False)
    ]
    return {**state, "param_groups": groups}


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict``, then each state tensor laid out as its parameter.

    A checkpoint keeps the layout it was saved in: a pipeline's or fsdp's momentum is
    contiguous, a data-parallel run's weights are channels_last. torch's fused CPU SGD and
    AdamW (2.14) read such a mixed pair in different element orders — measured: one
    resumed ResNet-18 step put a weight 1.9 away from the uninterrupted run's."""
    from torch.distributed.tensor import DTensor

    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, DTensor):
                continue
            entry = optimizer.state.get(param, {})
            for key, value in entry.items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.shape == param.shape
                    and value.stride() != param.stride()
                ):
                    entry[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


# A sharded checkpoint's tensors, by flat key: "model::<name>" and "optim::<name>::<slot>"
# (names hold dots, so another separator keeps keys and slots apart).
MODEL, OPTIM = "model::", "optim::"


def flatten(model: dict[str, Any], named_optim: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A model state dict and a name-keyed optimizer state as one flat dict of tensors."""
    flat = {MODEL + name: value for name, value in model.items()}
    for name, slots in named_optim["state"].items():
        for slot, value in slots.items():
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value)
            flat[f"{OPTIM}{name}::{slot}"] = value
    return flat


def unflatten(
    flat: dict[str, torch.Tensor], groups: list[dict[str, Any]]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The reverse of :func:`flatten`: the model state dict, and the name-keyed optimizer
    state with its param groups."""
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        if key.startswith(MODEL):
            model[key[len(MODEL) :]] = value
        elif key.startswith(OPTIM):
            name, slot = key[len(OPTIM) :].rsplit("::", 1)
            state.setdefault(name, {})[slot] = value
    return model, {"state": state, "param_groups": groups}
