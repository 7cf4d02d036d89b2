"""Train and eval transforms (torchvision's classification reference, ImageNet statistics),
and the augmentation policies recipes add to training.

Training has one augmentation, :class:`TrainAugment`, on uint8 CHW tensors, whichever
path the pixels take (decoded every epoch, from the decoded cache, or on the device);
evaluation has torchvision's Resize + CenterCrop, which the cache stores the result of."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import default_collate
from torchvision import transforms as T
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2 import functional as F2  # uint8 fast path for resizing

from paratrain.config.train import IMAGENET_MEAN, IMAGENET_STD, resize_for_crop
from paratrain.data.folder import ImageSamples, Sample, load_rgb, seeded
from paratrain.data.samples import Samples

INTERPOLATION = {"bilinear": InterpolationMode.BILINEAR, "bicubic": InterpolationMode.BICUBIC}


eval_resize = resize_for_crop  # the short side evaluation resizes to before its crop


def resized_size(height: int, width: int, short_side: int) -> tuple[int, int]:
    """(height, width) once ``Resize(short_side)`` has scaled the shorter side to
    ``short_side``: the longer side scaled alike and truncated, as torchvision does."""
    if width <= height:
        return int(short_side * height / width), short_side
    return short_side, int(short_side * width / height)


@dataclass(frozen=True)
class Augment:
    """What training does to an image besides the crop's size: one object for the decode,
    cached and device paths alike."""

    size: int  # the training crop
    crop_scale_min: float = 0.08
    hflip: float = 0.5
    interpolation: str = "bilinear"
    policy: str = "none"  # none, trivialaugment, randaugment, autoaugment, augmix
    ra_ops: int = 2
    ra_magnitude: int = 9
    augmix_severity: int = 3
    random_erase: float = 0.0
    mean: tuple[float, float, float] = IMAGENET_MEAN  # the normalisation (the weights')
    std: tuple[float, float, float] = IMAGENET_STD
    crop: str = "resized"  # or "shifted": the training size cut out, not resized
    scale_side: int = 0  # shifted: the short side validation sees images at (0: as stored)

    @classmethod
    def of(cls, cfg) -> Augment:
        return cls(
            cfg.train_size,
            cfg.crop_scale_min,
            cfg.hflip,
            cfg.interpolation,
            cfg.auto_augment,
            cfg.ra_ops,
            cfg.ra_magnitude,
            cfg.augmix_severity,
            cfg.random_erase,
            cfg.norm_mean,
            cfg.norm_std,
            cfg.crop,
            cfg.eval_resize,
        )

    def policy_transform(self) -> Callable | None:
        """torchvision's augmentation policy (on PIL images and uint8 tensors alike)."""
        mode = INTERPOLATION[self.interpolation]
        if self.policy == "trivialaugment":
            return v2.TrivialAugmentWide(interpolation=mode)
        if self.policy == "randaugment":
            return v2.RandAugment(self.ra_ops, self.ra_magnitude, interpolation=mode)
        if self.policy == "autoaugment":
            return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=mode)
        if self.policy == "augmix":
            return v2.AugMix(self.augmix_severity, interpolation=mode)
        return None

    def eraser(self) -> Callable | None:
        """RandomErasing's settings (probability, area, aspect): its rectangle is drawn
        by TrainAugment.erase_box with the crop, and set to zero on the normalised tensor,
        as torchvision's references erase."""
        return v2.RandomErasing(self.random_erase) if self.random_erase > 0 else None


POLICY_SEED = 0x5EED_0F_A11  # the policy's draws: a stream of their own


def policy_seed(seed: int) -> int:
    """The seed of a sample's policy draws, apart from its crop's, so the cached and the
    device path draw them alike (the device draws them later)."""
    return seed ^ POLICY_SEED


class TrainAugment:
    """RandomResizedCrop (or a shifted crop) + horizontal flip + policy + normalisation +
    erasing on a uint8 CHW tensor: the one training augmentation, whether the pixels come
    decoded from the file, from the decoded cache, or to the device
    (data/device_batches.py).

    The same augmentation as the decode path's, written against torchvision's functional
    API: the transform classes' dispatch costs as much as the resize itself at this size.
    """

    def __init__(self, size: int | Augment, crop_scale_min: float = 0.08, hflip: float = 0.5):
        aug = size if isinstance(size, Augment) else Augment(size, crop_scale_min, hflip)
        self.size, self.scale, self.hflip = aug.size, (aug.crop_scale_min, 1.0), aug.hflip
        self.shifted, self.scale_side = aug.crop == "shifted", aug.scale_side
        self.interpolation = INTERPOLATION[aug.interpolation]
        self.policy, self.eraser = aug.policy_transform(), aug.eraser()
        self.mean = torch.tensor(aug.mean).mul(255).view(3, 1, 1)
        self.inv_std = torch.tensor(aug.std).mul(255).reciprocal().view(3, 1, 1)

    def crop_box(self, height: int, width: int, draws: list[float]) -> tuple[int, int, int, int]:
        """RandomResizedCrop's box (torchvision's algorithm: 10 tries, then the centre),
        from random numbers drawn all at once; shifted: a square of the training size at
        a random place, at the scale validation sees the image at (its short side
        resized to ``scale_side``): from an image stored at that side, the training size's
        own pixels, not resampled; never more than the image's short side."""
        if self.shifted:
            short = min(height, width)
            side = round(self.size * short / self.scale_side) if self.scale_side else self.size
            side = max(1, min(side, short))
            return (
                int(draws[2] * (height - side + 1)),
                int(draws[3] * (width - side + 1)),
                side,
                side,
            )
        area = height * width
        low, high = math.log(3 / 4), math.log(4 / 3)
        for attempt in range(10):
            u = draws[4 * attempt : 4 * attempt + 4]
            target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[0])
            aspect = math.exp(low + (high - low) * u[1])
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                return int(u[2] * (height - h + 1)), int(u[3] * (width - w + 1)), h, w
        ratio = width / height
        if ratio < 3 / 4:
            w, h = width, int(round(width / (3 / 4)))
        elif ratio > 4 / 3:
            h, w = height, int(round(height * (4 / 3)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def draw(self, height: int, width: int) -> tuple[tuple[int, int, int, int], bool]:
        """The crop box and the flip of one image, from the torch generator (seeded per
        sample by the dataset): the same draws wherever the image is then augmented."""
        draws = torch.rand(41).tolist()  # one call to the generator, not forty
        return self.crop_box(height, width, draws), self.hflip > 0 and draws[40] < self.hflip

    def erase_box(self, draws: list[float]) -> tuple[int, int, int, int]:
        """RandomErasing's rectangle on the ``size`` x ``size`` output (torchvision's
        draw: probability p, 2-33% of the area, aspect 0.3-3.3, 10 tries), from 41 random
        numbers drawn at once; (0, 0, 0, 0) where nothing is erased."""
        eraser: Any = self.eraser
        if eraser is None or draws[0] >= eraser.p:
            return 0, 0, 0, 0
        size, (low, high) = self.size, eraser.scale
        log_ratio = (math.log(eraser.ratio[0]), math.log(eraser.ratio[1]))
        for attempt in range(10):
            u = draws[1 + 4 * attempt : 5 + 4 * attempt]
            area = size * size * (low + (high - low) * u[0])
            aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[1])
            h, w = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
            if h < size and w < size:
                return int(u[2] * (size - h + 1)), int(u[3] * (size - w + 1)), h, w
        return 0, 0, 0, 0

    def apply(
        self,
        image: torch.Tensor,
        box: tuple[int, int, int, int],
        flip: bool,
        out: torch.Tensor | None = None,
        erase: tuple[int, int, int, int] | None = None,
    ) -> torch.Tensor:
        """Crop, resize, flip, apply the policy, normalise and erase (``erase``: the
        rectangle ``erase_box`` drew, set to zero) ``image`` on its own device."""
        top, left, height, width = box
        crop = F2.resized_crop(
            image,
            top,
            left,
            height,
            width,
            [self.size, self.size],
            interpolation=self.interpolation,
            antialias=True,
        )
        if flip:
            crop = crop.flip(-1)
        if self.policy is not None:
            crop = self.policy(crop)
        out = crop.float() if out is None else out.copy_(crop)
        mean, inv_std = self._constants(out.device)
        out = out.sub_(mean).mul_(inv_std)
        if erase is not None and erase[2] > 0:
            top, left, height, width = erase
            out[..., top : top + height, left : left + width] = 0.0
        return out

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mean.device != device:
            self.mean, self.inv_std = self.mean.to(device), self.inv_std.to(device)
        return self.mean, self.inv_std

    def draw_erase(self) -> tuple[int, int, int, int] | None:
        """The erased rectangle (``erase_box``) from the torch generator, drawn after the
        crop and flip from the sample's seed; None without erasing."""
        return self.erase_box(torch.rand(41).tolist()) if self.eraser is not None else None

    def __call__(self, image: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        box, flip = self.draw(image.shape[-2], image.shape[-1])
        return self.apply(image, box, flip, out, self.draw_erase())

    def sample(
        self, image: torch.Tensor, seed: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The augmentation of one sample, every draw from its seed (the policy's from a
        stream of its own, ``policy_seed``)."""
        with seeded(seed):
            box, flip = self.draw(image.shape[-2], image.shape[-1])
            erase = self.draw_erase()
        with seeded(policy_seed(seed)):
            return self.apply(image, box, flip, out, erase)


def to_chw(image: Image.Image) -> torch.Tensor:
    """A decoded RGB image as the uint8 CHW tensor the augmentation takes."""
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)


def batched(batch: Any) -> Any:
    """collate_fn for AugmentedSamples: its __getitems__ returns the batch ready."""
    return batch


class AugmentedSamples(ImageSamples):
    """Samples whose ``load`` gives uint8 CHW tensors: a whole batch at once (the
    DataLoader asks for it so), each augmented straight into its slot of the batch with
    :class:`TrainAugment` (a copy of every image saved); another transform per item."""

    def load(self, index: int) -> torch.Tensor:
        """The sample's pixels, uint8 CHW."""
        raise NotImplementedError

    def __getitems__(self, keys: list) -> tuple[torch.Tensor, torch.Tensor]:
        indices = [k[0] if isinstance(k, tuple) else k for k in keys]
        labels = torch.from_numpy(self.samples.labels[indices].astype(np.int64))
        if not isinstance(self.transform, TrainAugment):
            return default_collate([self[k] for k in keys])[0], labels
        size = self.transform.size
        batch = torch.empty(len(keys), 3, size, size)
        for slot, (index, seed) in zip(batch, keys, strict=True):
            self.transform.sample(self.load(index), seed, out=slot)
        return batch, labels


class DecodedSamples(AugmentedSamples):
    """Training samples decoded from their files every epoch (no cache)."""

    def load(self, index: int) -> torch.Tensor:
        return to_chw(load_rgb(self.samples.keys[index], None, self.source))


def eval_transform(
    size: int,
    resize: int | None = None,
    interpolation: str = "bilinear",
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> T.Compose:
    """Resize (the short side to ``resize``, default size x 256/224), center crop
    ``size``, normalisation (ImageNet's, or the weights'): torchvision's reference
    evaluation preset."""
    return T.Compose(
        [
            T.Resize(
                resize or eval_resize(size),
                interpolation=INTERPOLATION[interpolation],
                antialias=True,
            ),
            T.CenterCrop(size),
            T.ToTensor(),
            T.Normalize(list(mean), list(std)),
        ]
    )


def eval_samples(
    samples: Samples | Sequence[Sample],
    size: int,
    resize: int | None = None,
    interpolation: str = "bilinear",
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
) -> ImageSamples:
    """Validation images, each decoded as the cache decodes it (a JPEG at reduced scale
    where it stays at least the Resize's size; see ``open_image``) and eval-transformed."""
    resize = resize or eval_resize(size)
    transform = eval_transform(size, resize, interpolation, mean, std)
    return ImageSamples(samples, transform, at_least=resize)
