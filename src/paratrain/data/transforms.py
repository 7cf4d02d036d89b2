"""Train and eval transforms (torchvision's classification reference, ImageNet statistics),
and the augmentation policies recipes add to training."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torchvision import transforms as T
from torchvision.transforms import InterpolationMode, v2

from paratrain.config.train import resize_for_crop
from paratrain.data.folder import ImageSamples, Sample

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
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
        """RandomErasing on the normalised tensor, as torchvision's references do."""
        return v2.RandomErasing(self.random_erase) if self.random_erase > 0 else None


def train_transform(
    size: int | Augment, crop_scale_min: float = 0.08, hflip: float = 0.5
) -> T.Compose:
    """RandomResizedCrop, an optional flip, the policy, ImageNet normalisation, random
    erasing: torchvision's reference training preset, on PIL images."""
    aug = size if isinstance(size, Augment) else Augment(size, crop_scale_min, hflip)
    steps = [
        T.RandomResizedCrop(
            aug.size,
            scale=(aug.crop_scale_min, 1.0),
            interpolation=INTERPOLATION[aug.interpolation],
            antialias=True,
        )
    ]
    if aug.hflip > 0:
        steps.append(T.RandomHorizontalFlip(aug.hflip))
    if (policy := aug.policy_transform()) is not None:
        steps.append(policy)
    steps += [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    if (erase := aug.eraser()) is not None:
        steps.append(erase)
    return T.Compose(steps)


def eval_transform(
    size: int, resize: int | None = None, interpolation: str = "bilinear"
) -> T.Compose:
    """Resize (the short side to ``resize``, default size x 256/224), center crop
    ``size``, ImageNet normalisation: torchvision's reference evaluation preset."""
    return T.Compose(
        [
            T.Resize(
                resize or eval_resize(size),
                interpolation=INTERPOLATION[interpolation],
                antialias=True,
            ),
            T.CenterCrop(size),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def eval_samples(
    samples: list[Sample], size: int, resize: int | None = None, interpolation: str = "bilinear"
) -> ImageSamples:
    """Validation images, each decoded as the cache decodes it (a JPEG at reduced scale
    where it stays at least the Resize's size; see ``open_image``) and eval-transformed."""
    resize = resize or eval_resize(size)
    return ImageSamples(samples, eval_transform(size, resize, interpolation), at_least=resize)
