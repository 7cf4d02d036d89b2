"""--loader dali: NVIDIA DALI decodes, crops, resizes and flips the training batch.

paratrain's own loader still decides everything about a batch: its samples (the
sampler's order, so the split, mid-epoch resume and the same steps on every rank hold),
each sample's crop box, flip and erased rectangle (drawn from its seed, as on the CPU
path), and it reads each image as stored: a file's JPEG bytes, the packed cache's JPEG,
a WebDataset shard's member. The batch (a ``DeviceBatch``) reaches DALI through an
external source; DALI's graph decodes only the crop's region of each JPEG (nvJPEG on a
GPU, ``decoders.image_slice``), resizes it to the training size (antialiased linear)
and mirrors it where the flip says; the augmentation policy, normalisation and erasing
then run batch-wide in torch as for the other device path (``DeviceBatch.finish``).

A batch holding anything but JPEG bytes (the raw cache's pixels, a PNG, an EXIF-rotated
JPEG decoded by the loader) goes the roi_align way instead. Validation keeps the torch
loader: evaluation is exact either way. Without the ``nvidia.dali`` package the option
is refused in one line naming the extra (engine/prerun/preflight).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["available", "crops", "external_inputs"]

EXTRA = "dali"  # pip install paratrain[dali] (DALI's wheels are on pypi.nvidia.com)
_PIPELINES: dict[tuple, Any] = {}  # (device, size, largest batch): built once, reused


def available() -> str | None:
    """None where DALI can run here; else why not, in a few words."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return "the nvidia.dali package is not installed"
    return None


def external_inputs(
    jpegs: list[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor
) -> dict[str, list[np.ndarray]]:
    """What the loader hands DALI for a batch: each image's JPEG bytes (1-D uint8), and
    its crop as an anchor (x, y) and a shape (width, height) in the upright image's
    pixels (``boxes``: top, left, height, width), and its flip (1: mirrored)."""
    top, left, height, width = boxes.unbind(1)
    anchors = torch.stack([left, top], 1).float().numpy()
    shapes = torch.stack([width, height], 1).float().numpy()
    return {
        "jpegs": [image.numpy() for image in jpegs],
        "anchors": list(anchors),
        "shapes": list(shapes),
        "flips": [np.array(f, dtype=np.int32) for f in flips.to(torch.int32).tolist()],
    }


def _pipeline(device: torch.device, size: int, batch: int) -> Any:
    """The DALI graph for one device, training size and largest batch, built once."""
    key = (str(device), size, batch)
    if key in _PIPELINES:
        return _PIPELINES[key]
    from nvidia.dali import fn, pipeline_def, types

    gpu = device.type == "cuda"

    @pipeline_def(
        batch_size=batch,
        num_threads=4,
        device_id=(device.index or 0) if gpu else None,
        prefetch_queue_depth=1,
    )
    def graph():
        jpegs = fn.external_source(name="jpegs", dtype=types.UINT8)
        anchors = fn.external_source(name="anchors", dtype=types.FLOAT)
        shapes = fn.external_source(name="shapes", dtype=types.FLOAT)
        flips = fn.external_source(name="flips", dtype=types.INT32)
        images = fn.decoders.image_slice(
            jpegs,
            anchors,
            shapes,
            device="mixed" if gpu else "cpu",
            output_type=types.RGB,
            normalized_anchor=False,
            normalized_shape=False,
            axis_names="WH",
            out_of_bounds_policy="trim_to_shape",
        )
        images = fn.resize(
            images,
            resize_x=size,
            resize_y=size,
            interp_type=types.INTERP_LINEAR,
            antialias=True,
        )
        return fn.crop_mirror_normalize(
            images, dtype=types.UINT8, output_layout="CHW", mirror=flips
        )

    pipe = graph()
    pipe.build()
    _PIPELINES[key] = pipe
    return pipe


def crops(
    jpegs: list[torch.Tensor],
    boxes: torch.Tensor,
    flips: torch.Tensor,
    size: int,
    device: torch.device,
) -> torch.Tensor:
    """The crops, resized to ``size`` and flipped by DALI: (B, 3, size, size) uint8 on
    ``device``."""
    from nvidia.dali.plugin.pytorch import feed_ndarray

    capacity = 1 << max(len(jpegs) - 1, 0).bit_length()  # a power of two: few graphs built
    pipe = _pipeline(device, size, capacity)
    for name, value in external_inputs(jpegs, boxes, flips).items():
        pipe.feed_input(name, value)
    (out,) = pipe.run()
    if device.type == "cuda":
        out = out.as_tensor()
        target = torch.empty((len(jpegs), 3, size, size), dtype=torch.uint8, device=device)
        feed_ndarray(out, target, cuda_stream=torch.cuda.current_stream(device))
        return target
    return torch.from_numpy(np.ascontiguousarray(out.as_array()))
