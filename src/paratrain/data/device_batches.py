"""Training batches augmented where the model is: the loader only reads bytes.

On CUDA a loader process that crops, resizes and normalises every image can starve a
fast GPU. Here the loader hands over each image as stored (the decoded cache's uint8
pixels, or, without the cache, a JPEG file's bytes), with the crop box and flip drawn from
the sample's own seed exactly as the CPU transform draws them; the device decodes
(nvJPEG), crops, resizes, flips and normalises. On a CPU the same code gives the same
tensors as the cached CPU path, bit for bit (tested), so both are one augmentation.
"""

from __future__ import annotations

import io
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from PIL import Image

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
    seeds: list[int]  # each sample's: its policy and erasing draw from policy_seed(seed)
    augment: TrainAugment  # its apply(): crop, resize, flip, policy, normalise, erase

    def __len__(self) -> int:
        return len(self.images)

    def pin_memory(self) -> DeviceBatch:
        """The DataLoader's pin-memory thread calls this: host copies then go async."""
        return replace(self, images=[image.pin_memory() for image in self.images])

    def on(self, device: torch.device, memory_format: torch.memory_format) -> torch.Tensor:
        """The augmented float batch on ``device``, in ``memory_format``."""
        from torchvision.io import ImageReadMode, decode_jpeg

        # JPEG bytes stay on the host: torchvision's decoder takes them there and writes
        # the pixels on ``device``; the others are pixels, moved
        images = [
            image if encoded else image.to(device, non_blocking=True)
            for image, encoded in zip(self.images, self.encoded, strict=True)
        ]
        which = [i for i, encoded in enumerate(self.encoded) if encoded]
        if which:
            decoded = decode_jpeg([images[i] for i in which], mode=ImageReadMode.RGB, device=device)
            for i, image in zip(which, decoded, strict=True):
                images[i] = image
        size = self.augment.size
        out = torch.empty(len(images), 3, size, size, device=device)
        rows = zip(out, images, self.boxes.tolist(), self.flips.tolist(), self.seeds, strict=True)
        for slot, image, box, flip, seed in rows:
            with seeded(policy_seed(seed)):
                self.augment.apply(image, box, flip, slot)
        return out.contiguous(memory_format=memory_format)


class DeviceAugmented(ImageSamples):
    """Training samples read as stored, for a DeviceBatch: from the decoded cache (its
    uint8 pixels), or from their files (a JPEG's bytes; other formats decoded here)."""

    def __init__(self, samples: Samples | Sequence[Sample], transform: TrainAugment, cache=None):
        super().__init__(samples, transform)
        self.augment = transform
        self.cache = cache
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
        for index, seed in keys:
            image, is_jpeg, (height, width) = self._stored(index)
            with seeded(seed):
                box, flip = self.augment.draw(height, width)
            images.append(image)
            encoded.append(is_jpeg)
            boxes.append(box)
            flips.append(flip)
        batch = DeviceBatch(
            images,
            encoded,
            torch.tensor(boxes, dtype=torch.int64),
            torch.tensor(flips, dtype=torch.bool),
            [seed for _, seed in keys],
            self.augment,
        )
        return batch, labels


def to_model(
    images: torch.Tensor | DeviceBatch, device: torch.device, memory_format: torch.memory_format
) -> torch.Tensor:
    """A loader's batch as the model takes it: moved, or augmented on ``device``."""
    if isinstance(images, DeviceBatch):
        return images.on(device, memory_format)
    return images.to(device, non_blocking=True, memory_format=memory_format)


def faster_on_device(cpu_seconds: float, device_seconds: float, workers: int) -> bool:
    """Whether decoding a JPEG on the device outpaces the loader processes decoding on
    the CPU side by side (seconds per image each way)."""
    return device_seconds * max(workers, 1) < cpu_seconds


def decode_faster_on_device(samples: Samples, device: torch.device, workers: int) -> bool:
    """Time both decoders on a few of the training JPEGs (after one warm-up each)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if device.type != "cuda":
        return False
    source = samples.source
    first = [samples.keys[i] for i in range(min(64, len(samples)))]
    read = {key: source.read(key) if source else Path(key).read_bytes() for key in first}
    sample = [key for key in first if read[key].startswith(JPEG_MAGIC)][:16]
    if len(sample) < 4:
        return False
    raw = [torch.frombuffer(bytearray(read[key]), dtype=torch.uint8) for key in sample]
    load_rgb(sample[0], None, source)
    start = time.perf_counter()
    for key in sample:
        load_rgb(key, None, source)
    cpu = (time.perf_counter() - start) / len(sample)
    decode_jpeg(raw[:2], device=device, mode=ImageReadMode.RGB)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    decode_jpeg(raw, device=device, mode=ImageReadMode.RGB)
    torch.cuda.synchronize(device)
    gpu = (time.perf_counter() - start) / len(sample)
    return faster_on_device(cpu, gpu, workers)
