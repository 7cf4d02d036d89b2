"""Train and eval presets (torchvision's classification reference, ImageNet statistics)."""

from __future__ import annotations

from torchvision import transforms as T

from paratrain.data.folder import ImageSamples, Sample

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def eval_resize(size: int) -> int:
    """The short side evaluation resizes to before its center crop (torchvision's 256/224)."""
    return int(round(size * 256 / 224))


def train_transform(size: int, crop_scale_min: float = 0.08, hflip: float = 0.5) -> T.Compose:
    """RandomResizedCrop, an optional flip, ImageNet normalisation: torchvision's reference training preset."""
    steps = [T.RandomResizedCrop(size, scale=(crop_scale_min, 1.0), antialias=True)]
    if hflip > 0:
        steps.append(T.RandomHorizontalFlip(hflip))
    steps += [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return T.Compose(steps)


def eval_transform(size: int) -> T.Compose:
    """Resize, center crop, ImageNet normalisation: torchvision's reference evaluation preset."""
    return T.Compose(
        [
            T.Resize(eval_resize(size), antialias=True),
            T.CenterCrop(size),
            T.ToTensor(),
            T.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def eval_samples(samples: list[Sample], size: int) -> ImageSamples:
    """Validation images, each decoded as the cache decodes it (a JPEG at reduced scale
    where it stays at least the Resize's size; see ``open_image``) and eval-transformed."""
    return ImageSamples(samples, eval_transform(size), at_least=eval_resize(size))
