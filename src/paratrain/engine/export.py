"""`paratrain export`: a checkpoint as a torch.export program (.pt2), an ONNX model
(torch's dynamo exporter) or safetensors.

Each carries what a user of the model needs besides the weights: the class names in index
order (inside the file, and as class_indices.json beside it), the model name and the
eval transform (resize, crop, mean, std, interpolation). `paratrain predict` runs the
.pt2 and .onnx files as it runs a checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from paratrain.config import ExportOptions
from paratrain.errors import UserError
from paratrain.models.registry import check_weights_fit


def default_output(checkpoint_path: str, fmt: str, ema: bool) -> Path:
    """<run>/export/model[-ema].<fmt> for a checkpoint of a run, else beside the file."""
    from paratrain.engine.run_dir import run_dir_of

    path, run, suffix = Path(checkpoint_path), run_dir_of(checkpoint_path), "-ema" if ema else ""
    if path.is_dir():  # a sharded checkpoint's folder: name the file after it
        path = path.with_name(path.name + ".pt")
    if run is not None:
        return run / "export" / f"model{suffix}.{fmt}"
    return path.with_name(f"{path.stem}{suffix}.{fmt}")


def check_export(checkpoint_path: str, opts: ExportOptions) -> Path:
    """What export would write, its checkpoint checked as export reads it."""
    from paratrain.engine.predict import load_for_inference

    if opts.format == "onnx":
        need_onnx("export --format onnx")
    load_for_inference(checkpoint_path, torch.device("cpu"), opts.ema)
    return Path(opts.out) if opts.out else default_output(checkpoint_path, opts.format, opts.ema)


def export(
    checkpoint_path: str, fmt: str, out: str | None = None, ema: bool = False
) -> dict[str, str]:
    """Write the export and class_indices.json; return their paths. ``fmt``: pt2, onnx,
    safetensors or pt (checked with the command's options)."""
    from paratrain.engine.predict import load_for_inference

    if fmt == "pt":
        return _save_checkpoint(checkpoint_path, out or default_output(checkpoint_path, fmt, ema))
    model, cfg, classes = load_for_inference(checkpoint_path, torch.device("cpu"), ema)
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
    }
    if fmt == "pt2":
        _save_program(model, cfg.eval_crop, meta, target)
    elif fmt == "onnx":
        _save_onnx(model, cfg.eval_crop, meta, target)
    else:
        _save_safetensors(model, meta, target)
    index = target.parent / "class_indices.json"
    index.write_text(json.dumps({str(i): c for i, c in enumerate(classes)}, indent=2) + "\n")
    return {"export": str(target), "class_indices": str(index)}


def _save_checkpoint(checkpoint_path: str, target: str | Path) -> dict[str, str]:
    """One checkpoint file with everything a checkpoint holds: a sharded checkpoint's
    shards consolidated (model whole, optimizer in the single-device layout)."""
    from paratrain.engine import checkpoint

    state = checkpoint.load(checkpoint_path)
    cfg = state.train_config(checkpoint_path)
    classes = state.classes
    check_weights_fit(cfg.model, len(classes), cfg.train_size, state.model, checkpoint_path)
    state.optimizer_groups, state.sharded = None, False
    target = Path(target)
    checkpoint.save_atomic(state.to_dict(), target)
    index = target.parent / "class_indices.json"
    index.write_text(json.dumps({str(i): c for i, c in enumerate(classes)}, indent=2) + "\n")
    return {"export": str(target), "class_indices": str(index)}


def _save_program(model, image_size: int, meta: dict, target: Path) -> None:
    """torch.export with a dynamic batch dimension: any batch size runs the program."""
    example = (torch.randn(2, 3, image_size, image_size),)
    batch = torch.export.Dim.AUTO
    with torch.no_grad():
        program = torch.export.export(model, example, dynamic_shapes=({0: batch},))
    torch.export.save(program, target, extra_files={"paratrain.json": json.dumps(meta)})


# the ONNX graph's input and output names, and the metadata key holding paratrain's JSON
ONNX_INPUT, ONNX_OUTPUT, ONNX_META = "images", "logits", "paratrain"


def need_onnx(what: str, runtime: bool = False) -> None:
    """One line naming the extra when the ONNX packages are missing."""
    import importlib.util

    modules = ("onnxruntime",) if runtime else ("onnx", "onnxscript")
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"{what} needs {' and '.join(missing)}: pip install 'paratrain[onnx]'")


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


def load_onnx(path: str | Path, device: str = "cpu") -> tuple[Callable, dict]:
    """An ONNX export as a function of a batch (a CPU float tensor) returning its logits,
    and its paratrain metadata. Runs on onnxruntime's CUDA provider when asked for cuda
    and it is there, else on the CPU."""
    need_onnx(f"predicting with {path}", runtime=True)
    import onnxruntime

    providers = ["CPUExecutionProvider"]
    if device.startswith("cuda") and "CUDAExecutionProvider" in (
        onnxruntime.get_available_providers()
    ):
        providers.insert(0, "CUDAExecutionProvider")
    try:
        session = onnxruntime.InferenceSession(str(path), providers=providers)
    except Exception as error:  # onnxruntime's own exception types differ by build
        raise UserError(f"{path} is not an ONNX model onnxruntime can load: {error}") from None
    meta = session.get_modelmeta().custom_metadata_map.get(ONNX_META)
    if meta is None:
        raise UserError(f"{path} was not exported by paratrain (no '{ONNX_META}' metadata)")
    name = session.get_inputs()[0].name

    def run(images: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {name: images.cpu().numpy()})[0])

    return run, json.loads(meta)


def _save_safetensors(model, meta: dict, target: Path) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(
        tensors,
        str(target),
        metadata={"format": "pt", **{f"paratrain.{k}": json.dumps(v) for k, v in meta.items()}},
    )


def load_program(path: str | Path) -> tuple[torch.nn.Module, dict]:
    """The exported program's callable module and its paratrain metadata."""
    extra = {"paratrain.json": ""}
    try:
        program = torch.export.load(str(path), extra_files=extra)
    except Exception as error:  # a zip that is not a program, a program of another torch
        raise UserError(
            f"{path} is not a torch.export program this torch can load: {error}"
        ) from None
    if not extra["paratrain.json"]:
        raise UserError(f"{path} was not exported by paratrain (no paratrain.json inside)")
    return program.module(), json.loads(extra["paratrain.json"])
