"""`paratrain export`: a checkpoint as a torch.export program (.pt2), an ONNX model
(torch's dynamo exporter) or safetensors.

Each carries what a user of the model needs besides the weights: the class names in index
order (inside the file, and as class_indices.json beside it), the model name and the
eval transform (resize, crop, mean, std, interpolation). `paratrain predict` runs the
.pt2 and .onnx files as it runs a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from paratrain.config import ExportOptions
from paratrain.engine.inference.predict import (
    ONNX_INPUT,
    ONNX_META,
    ONNX_OUTPUT,
    PT2_META,
    load_for_inference,
    need_onnx,
    open_checkpoint,
)
from paratrain.errors import told_if_full
from paratrain.files import write_atomic
from paratrain.models.registry import check_weights_fit


def default_output(checkpoint_path: str, fmt: str, ema: bool) -> Path:
    """<run>/export/model[-ema].<fmt> for a checkpoint of a run, else beside the file."""
    from paratrain.engine.checkpointing.run_dir import run_dir_of

    path, run, suffix = Path(checkpoint_path), run_dir_of(checkpoint_path), "-ema" if ema else ""
    if path.is_dir():  # a sharded checkpoint's folder: name the file after it
        path = path.with_name(path.name + ".pt")
    if run is not None:
        return run / "export" / f"model{suffix}.{fmt}"
    return path.with_name(f"{path.stem}{suffix}.{fmt}")


def check_export(checkpoint_path: str, opts: ExportOptions) -> Path:
    """What export would write, its checkpoint checked as export reads it."""
    if opts.format == "onnx":
        need_onnx("export --format onnx")
    load_for_inference(checkpoint_path, torch.device("cpu"), opts.ema)
    return Path(opts.out) if opts.out else default_output(checkpoint_path, opts.format, opts.ema)


def export(
    checkpoint_path: str, fmt: str, out: str | None = None, ema: bool = False
) -> dict[str, str]:
    """Write the export and class_indices.json; return their paths. ``fmt``: pt2, onnx,
    safetensors or pt (checked with the command's options)."""
    if fmt == "pt":
        return _save_checkpoint(checkpoint_path, out or default_output(checkpoint_path, fmt, ema))
    model, cfg, classes, threshold = open_checkpoint(checkpoint_path, torch.device("cpu"), ema)
    target = Path(out) if out else default_output(checkpoint_path, fmt, ema)
    target.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "model": cfg.model,
        "classes": classes,
        # the eval transform: RGB, resize the short side, center crop, then normalise
        "resize": cfg.eval_resize,
        "image_size": cfg.eval_crop,
        "mean": list(cfg.norm_mean),
        "std": list(cfg.norm_std),
        "interpolation": cfg.interpolation,
        # what the outputs mean: softmax over classes, or a sigmoid each and the labels
        # at or above the threshold chosen on validation (several labels an image)
        "task": cfg.task,
        "threshold": threshold,
    }
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with told_if_full(target, size):
        if fmt == "pt2":
            _save_program(model, cfg.eval_crop, meta, target)
        elif fmt == "onnx":
            _save_onnx(model, cfg.eval_crop, meta, target)
        else:
            _save_safetensors(model, meta, target)
    index = target.parent / "class_indices.json"
    with told_if_full(index):
        index.write_text(json.dumps({str(i): c for i, c in enumerate(classes)}, indent=2) + "\n")
    return {"export": str(target), "class_indices": str(index)}


def _save_checkpoint(checkpoint_path: str, target: str | Path) -> dict[str, str]:
    """One checkpoint file with everything a checkpoint holds: a sharded checkpoint's
    shards consolidated (model whole, optimizer in the single-device layout)."""
    from paratrain.engine.checkpointing import checkpoint
    from paratrain.parallel.checkpoint_io import save_atomic

    state = checkpoint.load(checkpoint_path)
    cfg = state.train_config(checkpoint_path)
    classes = state.classes
    check_weights_fit(cfg.model, len(classes), cfg.train_size, state.model, checkpoint_path)
    state.optimizer_groups, state.sharded = None, False
    target = Path(target)
    save_atomic(state.to_dict(), target)
    index = target.parent / "class_indices.json"
    write_atomic(index, json.dumps({str(i): c for i, c in enumerate(classes)}, indent=2) + "\n")
    return {"export": str(target), "class_indices": str(index)}


def _save_program(model, image_size: int, meta: dict, target: Path) -> None:
    """torch.export with a dynamic batch dimension: any batch size runs the program."""
    example = (torch.randn(2, 3, image_size, image_size),)
    batch = torch.export.Dim.AUTO
    with torch.no_grad():
        program = torch.export.export(model, example, dynamic_shapes=({0: batch},))
    torch.export.save(program, target, extra_files={PT2_META: json.dumps(meta)})


def _save_onnx(model, image_size: int, meta: dict, target: Path) -> None:
    """torch.onnx's dynamo exporter, the batch dimension dynamic; paratrain's metadata
    (classes and eval transform) in the model's metadata_props as one JSON string."""
    need_onnx("export --format onnx")
    example = (torch.randn(2, 3, image_size, image_size),)
    with torch.no_grad():
        program = torch.onnx.export(
            model,
            example,
            dynamo=True,
            input_names=[ONNX_INPUT],
            output_names=[ONNX_OUTPUT],
            dynamic_shapes=({0: torch.export.Dim("batch")},),
            verbose=False,
        )
    if program is None:  # the dynamo exporter always returns its program
        raise RuntimeError("torch.onnx.export returned no program")
    program.model.metadata_props[ONNX_META] = json.dumps(meta)
    program.save(str(target))


def _save_safetensors(model, meta: dict, target: Path) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(
        tensors,
        str(target),
        metadata={"format": "pt", **{f"paratrain.{k}": json.dumps(v) for k, v in meta.items()}},
    )
