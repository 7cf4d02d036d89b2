"""Use a trained model: class probabilities for images and folders of images, from a
checkpoint or from what `paratrain export` wrote (.pt2, .onnx)."""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from paratrain.config import PredictOptions, TrainConfig
from paratrain.data.folder import read_rgb
from paratrain.data.sources.base import is_image, is_junk
from paratrain.data.transforms import eval_transform
from paratrain.distributed.env import DistEnv
from paratrain.distributed.runtime import choose_device
from paratrain.engine.checkpointing import checkpoint
from paratrain.errors import UserError
from paratrain.models.registry import check_weights_fit, create_model, logits_of


def collect_images(inputs: Sequence[str]) -> list[str]:
    """Files as given; folders searched recursively for images, sorted (hidden files
    left out, as training's folder scan leaves them)."""
    found: list[str] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            inside: list[str] = []
            for folder, dirs, files in os.walk(path):
                dirs[:] = [d for d in dirs if not is_junk(d)]  # __MACOSX/, hidden folders
                inside += (os.path.join(folder, f) for f in files if is_image(f) and not is_junk(f))
            found += sorted(inside)
        elif path.is_file():
            found.append(str(path))
        else:
            raise UserError(f"no such image or folder: {path}")
    if not found:
        raise UserError(f"no images found in {', '.join(inputs)}")
    return found


def load_for_inference(
    checkpoint_path: str, device: torch.device, ema: bool = False
) -> tuple[torch.nn.Module, TrainConfig, list[str]]:
    """The checkpoint's model (eval mode), its config and its class names."""
    model, cfg, classes, _ = open_checkpoint(checkpoint_path, device, ema)
    return model, cfg, classes


def open_checkpoint(
    checkpoint_path: str, device: torch.device, ema: bool = False
) -> tuple[torch.nn.Module, TrainConfig, list[str], float | None]:
    """The checkpoint's model (eval mode), its config, its class names and, where it has
    several labels an image, the threshold its last evaluation chose (else None)."""
    state = checkpoint.load(checkpoint_path, with_optimizer=False)
    cfg = state.train_config(checkpoint_path)
    weights = state.weights(checkpoint_path, ema)
    check_weights_fit(cfg.model, len(state.classes), cfg.train_size, weights, checkpoint_path)
    model = create_model(cfg.model, len(state.classes), cfg.train_size)
    model.load_state_dict(weights)
    threshold = state.part("recipe").get("threshold") if cfg.task == "multilabel" else None
    return model.to(device).eval(), cfg, state.classes, threshold


@dataclass
class Inference:
    """A model ready to predict: logits of a batch, its classes and its eval transform."""

    logits: Callable[[torch.Tensor], torch.Tensor]
    classes: list[str]
    transform: Callable
    shrink: int  # the eval transform's resize: a JPEG may be decoded at reduced scale
    device: torch.device
    threshold: float | None = None  # several labels an image: those above it are said

    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        """A softmax over the classes, or a sigmoid per class (several labels an image)."""
        logits = self.logits(images.to(self.device)).float()
        return logits.sigmoid() if self.threshold is not None else logits.softmax(1)


# the ONNX graph's input and output names, and the metadata key holding paratrain's JSON
ONNX_INPUT, ONNX_OUTPUT, ONNX_META = "images", "logits", "paratrain"
PT2_META = "paratrain.json"  # the .pt2 program's extra file holding the same JSON


def need_onnx(what: str, runtime: bool = False) -> None:
    """One line naming the extra when the ONNX packages are missing."""
    import importlib.util

    modules = ("onnxruntime",) if runtime else ("onnx", "onnxscript")
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        from paratrain.version import install_extra

        raise UserError(f"{what} needs {' and '.join(missing)}: {install_extra('onnx')}")


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


def load_program(path: str | Path) -> tuple[torch.nn.Module, dict]:
    """The exported program's callable module and its paratrain metadata."""
    extra = {PT2_META: ""}
    try:
        program = torch.export.load(str(path), extra_files=extra)
    except Exception as error:  # a zip that is not a program, a program of another torch
        raise UserError(
            f"{path} is not a torch.export program this torch can load: {error}"
        ) from None
    if not extra[PT2_META]:
        raise UserError(f"{path} was not exported by paratrain (no paratrain.json inside)")
    return program.module(), json.loads(extra[PT2_META])


def open_model(path: str, device: torch.device, ema: bool = False) -> Inference:
    """A checkpoint (or a sharded checkpoint's folder), a .pt2 program or an .onnx model,
    each with its classes and the transform it was trained for."""
    suffix = Path(path).suffix.lower()
    if suffix in (".onnx", ".pt2"):
        if ema:
            raise UserError(f"--ema needs a checkpoint: {path} holds one set of weights")
        if suffix == ".onnx":
            run, meta = load_onnx(path, device.type)
        else:
            module, meta = load_program(path)
            run = module.to(device)
        transform = eval_transform(
            meta["image_size"], meta["resize"], meta["interpolation"], meta["mean"], meta["std"]
        )
        threshold = meta.get("threshold") if meta.get("task") == "multilabel" else None
        return Inference(run, meta["classes"], transform, meta["resize"], device, threshold)
    model, cfg, classes, threshold = open_checkpoint(path, device, ema)
    transform = eval_transform(
        cfg.eval_crop, cfg.eval_resize, cfg.interpolation, cfg.norm_mean, cfg.norm_std
    )
    run = lambda x: logits_of(model(x))  # noqa: E731
    return Inference(run, classes, transform, cfg.eval_resize, device, threshold)


@torch.no_grad()
def predict(
    checkpoint_path: str,
    inputs: Sequence[str],
    top_k: int = 5,
    batch_size: int = 64,
    device: str = "cpu",
    ema: bool = False,
    on_rows: Callable[[list[dict]], None] | None = None,
) -> tuple[list[dict], list[tuple[str, str]]]:
    """One row per image (its path and the top-k (class, probability) pairs; with several
    labels an image also ``labels``: every (class, probability) at or above the
    threshold, highest first), and the (path, why) of each image that could not be
    read: those are skipped, the rest predicted. ``on_rows`` receives each batch's rows
    as soon as they are known."""
    if top_k < 1:
        raise UserError(f"--top-k must be at least 1, got {top_k}")
    model = open_model(checkpoint_path, choose_device(DistEnv(), device), ema)
    classes = model.classes
    paths = collect_images(inputs)
    k = min(top_k, len(classes))
    rows: list[dict] = []
    unreadable: list[tuple[str, str]] = []
    with tqdm(total=len(paths), unit="img", desc="predict", leave=False, disable=None) as bar:
        for start in range(0, len(paths), batch_size):
            chunk, images = [], []
            batch_paths = paths[start : start + batch_size]
            for path in batch_paths:
                image, problem = read_rgb(path, model.shrink)
                if image is None:
                    unreadable.append((path, problem or "unreadable"))
                    continue
                chunk.append(path)
                images.append(model.transform(image))
            bar.update(len(batch_paths))
            if not chunk:
                continue
            probabilities = model.probabilities(torch.stack(images))
            values, indices = probabilities.topk(k, dim=1)
            batch_rows = [
                {"path": path, "top": [(classes[i], v) for i, v in zip(idx, vals, strict=True)]}
                for path, vals, idx in zip(chunk, values.tolist(), indices.tolist(), strict=True)
            ]
            if model.threshold is not None:
                _above(batch_rows, probabilities, classes, model.threshold)
            rows += batch_rows
            if on_rows is not None:
                on_rows(batch_rows)
    return rows, unreadable


def _above(
    rows: list[dict], probabilities: torch.Tensor, classes: list[str], threshold: float
) -> None:
    """Each row's ``labels``: every class at or above ``threshold``, highest first."""
    for row, probs in zip(rows, probabilities.tolist(), strict=True):
        said = sorted(((p, c) for c, p in zip(classes, probs, strict=True) if p >= threshold),
                      reverse=True)  # fmt: skip
        row["labels"], row["threshold"] = [(c, p) for p, c in said], threshold


def check_inputs(checkpoint_path: str, inputs: Sequence[str], ema: bool = False) -> list[str]:
    """What predict would read, checked without predicting: the images it would find."""
    open_model(checkpoint_path, torch.device("cpu"), ema)
    return collect_images(inputs)


def write_csv(rows: list[dict], path: str) -> None:
    """--csv: one row per image, each top-k class and its probability (several labels
    an image: first the labels said, separated by ;)."""
    k = len(rows[0]["top"]) if rows else 0
    several = bool(rows) and "labels" in rows[0]
    header = ["path"] + (["labels"] if several else [])
    header += [f"{name}_{n}" for n in range(1, k + 1) for name in ("class", "prob")]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for row in rows:
            said = [";".join(c for c, _ in row["labels"])] if several else []
            writer.writerow(
                [row["path"], *said]
                + [x for pair in row["top"] for x in (pair[0], f"{pair[1]:.6f}")]
            )


def _said(row: dict) -> str:
    """An image's line: its top-k, or every label above the threshold."""
    if "labels" not in row:
        return ", ".join(f"{name} {p:.3f}" for name, p in row["top"])
    listed = ", ".join(f"{name} {p:.3f}" for name, p in row["labels"])
    return f"{listed or 'no label'} (at or above {row['threshold']:g})"


def run_predict(opts: PredictOptions, say: Callable[[str], object]) -> list[dict]:
    """`paratrain predict`: each image's top-k said as its batch is done, the CSV
    written; unreadable images named on stderr and, after the rest, one error line."""
    import sys

    if opts.dry_run:
        paths = check_inputs(str(opts.checkpoint), opts.inputs, opts.ema)
        say(f"would predict {len(paths)} image(s) with {opts.checkpoint} on {opts.device}")
        return []

    def tell(rows: list[dict]) -> None:  # as each batch is done, not all at the end
        for row in rows:
            say(f"{row['path']}: {_said(row)}")

    rows, unreadable = predict(
        str(opts.checkpoint), opts.inputs, opts.top_k, opts.batch_size, opts.device, opts.ema, tell
    )
    if opts.csv:
        write_csv(rows, opts.csv)
    for path, why in unreadable:
        print(f"paratrain: skipped {path}: {why}", file=sys.stderr)
    if unreadable:
        raise UserError(
            f"{len(unreadable)} of {len(rows) + len(unreadable)} image(s) could not be read "
            "(listed above); the others were predicted"
        )
    return rows
