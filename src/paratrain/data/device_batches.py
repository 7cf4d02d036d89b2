"""Training batches augmented where the model is: the loader only reads bytes.

On CUDA a loader process that crops, resizes and normalises every image can starve a
fast GPU. Here the loader hands over each image as stored (the decoded cache's uint8
pixels, padded into one batch tensor, or, without the cache, a JPEG file's bytes), with
the crop box, the flip and the erased rectangle drawn from the sample's own seed as the
CPU transform draws them; the device decodes (nvJPEG), then crops and resizes the whole
batch in one ``torchvision.ops.roi_align`` (bilinear, averaging ceil(box/size) samples
a side per output pixel where the box shrinks: an area filter in place of the per-image
path's antialiased resize), flips, normalises and erases batch-wide. The number of
kernels does not grow with the batch (counted with torch.profiler in the tests), except
for an augmentation policy, which torchvision applies image by image. The pixels differ
from the per-image path's by the filter (measured in benchmarks/augment_where.py).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision.ops import roi_align

from paratrain.data.folder import EXIF_ORIENTATION, ImageSamples, Sample, load_rgb, seeded
from paratrain.data.samples import Samples
from paratrain.data.transforms import TrainAugment, policy_seed, to_chw

JPEG_MAGIC = b"\xff\xd8\xff"


@dataclass
class DeviceBatch:
    """A batch still to be augmented: each image as stored, its crop box and flip."""

    images: list[torch.Tensor]  # uint8: CHW pixels, or 1-D JPEG bytes where encoded
    encoded: list[bool]
    boxes: torch.Tensor  # (B, 4) int64: top, left, height, width in the upright image
    flips: torch.Tensor  # (B,) bool
    seeds: list[int]  # each sample's: its policy draws from policy_seed(seed)
    augment: TrainAugment  # its size, policy, normalisation and eraser
    erases: torch.Tensor | None = None  # (B, 4) int64: the erased rectangle (0s: none)
    pixels: torch.Tensor | None = None  # (B, 3, H, W) uint8: the images padded, where
    # none is encoded (then ``images`` are views of it)
    dali: bool = False  # --loader dali: DALI decodes, crops, resizes and flips (data/dali.py)

    def __len__(self) -> int:
        return len(self.images)

    def pin_memory(self) -> DeviceBatch:
        """The DataLoader's pin-memory thread calls this: host copies then go async."""
        if self.pixels is not None:
            pinned = self.pixels.pin_memory()
            views = [
                pinned[i, :, : im.shape[-2], : im.shape[-1]] for i, im in enumerate(self.images)
            ]
            return replace(self, pixels=pinned, images=views)
        return replace(self, images=[image.pin_memory() for image in self.images])

    def _padded(self, device: torch.device) -> torch.Tensor:
        """Every image on ``device`` in one (B, 3, H, W) uint8 tensor: the loader's padded
        batch moved in one copy; JPEG bytes decoded there and padded (a copy each)."""
        if self.pixels is not None:
            return self.pixels.to(device, non_blocking=True)
        from torchvision.io import ImageReadMode, decode_jpeg

        images = [
            image if encoded else image.to(device, non_blocking=True)
            for image, encoded in zip(self.images, self.encoded, strict=True)
        ]
        which = [i for i, encoded in enumerate(self.encoded) if encoded]
        if which:
            decoded = decode_jpeg([images[i] for i in which], mode=ImageReadMode.RGB, device=device)
            for i, image in zip(which, decoded, strict=True):
                images[i] = image
        return pad_images(images, device)

    def on(self, device: torch.device, memory_format: torch.memory_format) -> torch.Tensor:
        """The augmented float batch on ``device``, in ``memory_format``."""
        if self.dali and all(self.encoded):
            from paratrain.data import dali

            out = dali.crops(self.images, self.boxes, self.flips, self.augment.size, device)
            out = out.float()
        else:
            out = self._crops(device)
        return self._finish(out, device).contiguous(memory_format=memory_format)

    def _crops(self, device: torch.device) -> torch.Tensor:
        """Every image's crop, resized and flipped: one roi_align over the padded batch."""
        pixels = self._padded(device)
        size, batch = self.augment.size, len(pixels)
        top, left, height, width = self.boxes.to(device, non_blocking=True).float().unbind(1)
        index = torch.arange(batch, device=device, dtype=torch.float32)
        rois = torch.stack([index, left, top, left + width, top + height], dim=1)
        out = roi_align(pixels.float(), rois, (size, size), 1.0, -1, aligned=True).round_()
        flips = self.flips.to(device, non_blocking=True).view(batch, 1, 1, 1)
        return torch.where(flips, out.flip(-1), out)

    def _finish(self, out: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The crops (float, 0-255) given their policy, normalised and erased."""
        augment, size = self.augment, self.augment.size
        if augment.policy is not None:  # torchvision's policies: image by image
            crops = out.to(torch.uint8)
            for i, seed in enumerate(self.seeds):
                with seeded(policy_seed(seed)):
                    crops[i] = augment.policy(crops[i])
            out = crops.float()
        mean, inv_std = augment._constants(device)
        out = out.sub_(mean).mul_(inv_std)
        if self.erases is not None:
            out = out.masked_fill_(
                _rectangles(self.erases.to(device, non_blocking=True), size), 0.0
            )
        return out


def _rectangles(boxes: torch.Tensor, size: int) -> torch.Tensor:
    """(B, 1, size, size) True inside each (top, left, height, width) box."""
    at = torch.arange(size, device=boxes.device)
    top, left, height, width = (column.view(-1, 1) for column in boxes.unbind(1))
    rows = (at >= top) & (at < top + height)
    columns = (at >= left) & (at < left + width)
    return (rows[:, :, None] & columns[:, None, :]).unsqueeze(1)


def pad_images(images: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """(3, h, w) uint8 images in one (B, 3, H, W) tensor (H, W: the largest), each padded
    with its own last row and column: a crop at the image's edge then resizes as the
    per-image path's does (its edge pixels repeat), not towards black."""
    height = max(image.shape[-2] for image in images)
    width = max(image.shape[-1] for image in images)
    out = torch.empty(len(images), 3, height, width, dtype=torch.uint8, device=device)
    for slot, image in zip(out, images, strict=True):
        h, w = image.shape[-2:]
        slot[:, :h, :w] = image
        slot[:, h:, :w] = image[:, -1:, :]
        slot[:, :, w:] = slot[:, :, w - 1 : w]
    return out


class DeviceAugmented(ImageSamples):
    """Training samples read as stored, for a DeviceBatch: from the decoded cache (its
    uint8 pixels), or from their files (a JPEG's bytes; other formats decoded here)."""

    def __init__(
        self,
        samples: Samples | Sequence[Sample],
        transform: TrainAugment,
        cache=None,
        dali: bool = False,
    ):
        super().__init__(samples, transform)
        self.augment = transform
        self.cache, self.dali = cache, dali
        self.rows = cache.slots(self.samples) if cache is not None else np.zeros(0, np.int64)

    def _stored(self, index: int) -> tuple[torch.Tensor, bool, tuple[int, int]]:
        """(image as stored, whether it is JPEG bytes, (height, width) once upright)."""
        if self.cache is not None:
            return self.cache.stored(int(self.rows[index]))
        key = self.samples.keys[index]
        raw = self.source.read(key) if self.source is not None else Path(key).read_bytes()
        if raw.startswith(JPEG_MAGIC):
            with Image.open(io.BytesIO(raw)) as header:  # the header only: no decoding
                upright = header.getexif().get(EXIF_ORIENTATION, 1) == 1
                height, width = header.height, header.width
            if upright:  # nvJPEG ignores an EXIF orientation: such files are decoded here
                return torch.frombuffer(bytearray(raw), dtype=torch.uint8), True, (height, width)
        pixels = to_chw(load_rgb(key, None, self.source)).contiguous()
        return pixels, False, (pixels.shape[-2], pixels.shape[-1])

    def __getitems__(self, keys: list) -> tuple[DeviceBatch, torch.Tensor]:
        labels = torch.from_numpy(
            self.samples.labels[[index for index, _ in keys]].astype(np.int64)
        )
        images: list[torch.Tensor] = []
        encoded: list[bool] = []
        boxes: list[tuple[int, int, int, int]] = []
        flips: list[bool] = []
        erases: list[tuple[int, int, int, int]] = []
        for index, seed in keys:
            image, is_jpeg, (height, width) = self._stored(index)
            with seeded(seed):  # as the CPU path draws them (TrainAugment.sample)
                box, flip = self.augment.draw(height, width)
                erases.append(self.augment.draw_erase() or (0, 0, 0, 0))
            images.append(image)
            encoded.append(is_jpeg)
            boxes.append(box)
            flips.append(flip)
        pixels = None
        if not any(encoded):  # one tensor, one copy to the device; the images views of it
            pixels = pad_images(images)
            images = [pixels[i, :, : im.shape[-2], : im.shape[-1]] for i, im in enumerate(images)]
        batch = DeviceBatch(
            images,
            encoded,
            torch.tensor(boxes, dtype=torch.int64),
            torch.tensor(flips, dtype=torch.bool),
            [seed for _, seed in keys],
            self.augment,
            torch.tensor(erases, dtype=torch.int64) if self.augment.eraser is not None else None,
            pixels,
            self.dali,
        )
        return batch, labels


def to_model(
    images: torch.Tensor | DeviceBatch, device: torch.device, memory_format: torch.memory_format
) -> torch.Tensor:
    """A loader's batch as the model takes it: moved, or augmented on ``device``."""
    if isinstance(images, DeviceBatch):
        return images.on(device, memory_format)
    return images.to(device, non_blocking=True, memory_format=memory_format)
