"""Where the images come from and how they are prepared: the source, the split, sizes, transforms, the cache."""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.config.schema import setting
from paratrain.config.words import CACHE_MODES, INTERPOLATIONS, MAX_IMAGE_SIZE, NUMBERS3, SCORES


@dataclass(frozen=True)
class DataSettings:
    data: str | None = setting(
        None,
        "the images: a folder DIR/<class>/* or DIR/{train,val}/<class>/*; a Hugging Face "
        "dataset, hf:NAME or a save_to_disk/parquet folder; WebDataset shards, "
        "wds:PATTERN (local paths or URLs, {000..099} expands); a CSV listing, csv:FILE.csv "
        "(an image path and its class a row)",
        group="data",
        path="data",
        metavar="DATA",
        default_text="the embedded digits set",
        resume="quiet",
    )
    data_split: str | None = setting(
        None,
        "the dataset split to train on (hf: and dataset folders)",
        group="data",
        metavar="NAME",
        default_text="train",
        resume="fixed",
        resume_why="the train/val split would change",
    )
    val_split: str | None = setting(
        None,
        "the validation split: a dataset split's name (hf:), or a shard pattern (wds:)",
        group="data",
        metavar="NAME",
        default_text="validation/valid/val/test where the dataset has one, else "
        "--val-fraction of the training data",
        resume="fixed",
        resume_why="the train/val split would change",
    )
    labels: str | None = setting(
        None,
        "a labels file naming --data's images and their classes: CSV (an image path and a "
        "class a row, or 0/1 columns one per class) or JSON lines; paths relative to --data, "
        "a split column (train/val) optional",
        group="data",
        path="file",
        metavar="FILE",
        resume="fixed",
        resume_why="the classes and the split come from it",
    )
    image_column: str | None = setting(
        None,
        "the dataset column holding the images (hf: and dataset folders)",
        group="data",
        metavar="NAME",
        default_text="the column of Image type",
        resume="fixed",
        resume_why="the images would change",
    )
    label_column: str | None = setting(
        None,
        "the dataset column holding the labels (hf: and dataset folders)",
        group="data",
        metavar="NAME",
        default_text="the ClassLabel column, else label/labels/target/class",
        resume="fixed",
        resume_why="the labels would change",
    )
    val_fraction: float = setting(
        0.2,
        "share of each class held out for validation",
        group="data",
        low=0.0,
        high=1.0,
        low_open=True,
        high_open=True,
        resume="fixed",
        resume_why="the train/val split would change",
    )
    split_seed: int = setting(
        0,
        "seed of the train/val split",
        group="data",
        low=0,
        high=2**32 - 1,
        resume="fixed",
        resume_why="the train/val split would change",
    )
    image_size: int = setting(
        224, "training crop size in pixels", group="data", low=8, high=MAX_IMAGE_SIZE
    )
    crop_scale_min: float = setting(
        0.08,
        "smallest area share of RandomResizedCrop",
        group="data",
        low=0.0,
        high=1.0,
        low_open=True,
    )
    crop: str = setting(
        "resized",
        "training crop: resized (RandomResizedCrop, --crop-scale-min) or shifted (a square "
        "of the training size cut at a random place from the stored image, not resized, "
        "as small-image recipes crop)",
        group="data",
        choices=("resized", "shifted"),
    )
    hflip: float = setting(0.5, "horizontal flip probability", group="data", low=0.0, high=1.0)
    workers: int | None = setting(
        None,
        "loader processes per rank",
        group="data",
        short="-j",
        low=0,
        high=64,
        default_text="from the cores",
        resume="quiet",
    )
    train_crop: int | None = setting(
        None,
        "training crop in pixels, where it differs from --image-size",
        group="data",
        low=8,
        high=MAX_IMAGE_SIZE,
        default_text="--image-size",
    )
    val_resize: int | None = setting(
        None,
        "validation images' short side before the center crop",
        group="data",
        low=8,
        high=MAX_IMAGE_SIZE,
        default_text="val crop x 256/224",
    )
    val_crop: int | None = setting(
        None,
        "validation center crop in pixels; above the training size it evaluates at a higher "
        "resolution than training (FixRes: objects look larger after RandomResizedCrop)",
        group="data",
        low=8,
        high=MAX_IMAGE_SIZE,
        default_text="--image-size",
        aliases=("--val-size",),
    )
    progressive: str | None = setting(
        None,
        "progressive resizing START:END: train at START pixels for most of the run, rising "
        "to END over its later epochs (FFCV's shape; batch and lr unchanged)",
        group="data",
        pattern=r"\d+:\d+",
        pattern_text="two sizes in pixels, START:END",
        metavar="START:END",
        resume="fixed_mid_epoch",
    )
    task: str = setting(
        "auto",
        "one class an image (multiclass: softmax and cross-entropy) or several "
        "(multilabel: a sigmoid per class, binary cross-entropy, mAP and F1 at a threshold "
        "chosen on validation); auto: multilabel where the labels file or the dataset "
        "gives several labels an image",
        group="data",
        choices=("auto", "multiclass", "multilabel"),
        resume="fixed",
        resume_why="the model's outputs would mean something else",
    )
    monitor: str = setting(
        "auto",
        "the validation score that picks best.pt (report/scores); auto: top1, macro_f1 "
        "where the classes are balanced (--balance), map with several labels an image",
        group="data",
        choices_from=SCORES,
        auto=True,
        resume="quiet",
    )
    balance: str = setting(
        "auto",
        "imbalanced classes: sampler draws each epoch's images weighted by inverse class "
        "frequency (tempered by --balance-power), loss weights the loss alike, auto samples "
        "so where the largest class is at least 4x the smallest, none trains on the data "
        "as it is; evaluation stays exact and unweighted",
        group="data",
        choices=("none", "sampler", "loss", "auto"),
        resume="fixed_mid_epoch",
    )
    balance_power: float = setting(
        0.5,
        "how far --balance evens the classes: weights (1/class count)^power, 1 draws every "
        "class equally often, 0.5 (the square root) halfway",
        group="data",
        low=0.0,
        high=1.0,
        low_open=True,
        resume="fixed_mid_epoch",
    )
    order: str = setting(
        "padded",
        "the training order over processes: padded is torch's DistributedSampler (one "
        "permutation an epoch, padded to a multiple of the processes, every rank's "
        "batches alike); global cuts the same permutation, unpadded, into global batches "
        "that do not depend on the world size, each rank's loss weighed by its share",
        group="data",
        choices=("padded", "global"),
        resume="fixed_mid_epoch",
    )
    tta: str = setting(
        "none",
        "test-time augmentation in evaluation: flip averages each image's logits with its mirror's",
        group="data",
        choices=("none", "flip"),
    )
    interpolation: str = setting(
        "bilinear",
        "how images are resized",
        group="data",
        choices=INTERPOLATIONS,
        default_text="the weights', else bilinear",
    )
    mean: str | None = setting(
        None,
        "per-channel mean the images are normalised with, R,G,B in 0..1",
        group="data",
        pattern=NUMBERS3,
        pattern_text="three numbers separated by commas",
        default_text="the weights', else ImageNet's 0.485,0.456,0.406",
    )
    std: str | None = setting(
        None,
        "per-channel standard deviation the images are normalised with, R,G,B",
        group="data",
        pattern=NUMBERS3,
        pattern_text="three numbers separated by commas",
        default_text="the weights', else ImageNet's 0.229,0.224,0.225",
    )
    bad_images: str = setting(
        "error",
        "unreadable images: list them all and stop, or leave them out",
        group="data",
        choices=("error", "skip"),
        resume="quiet",
    )
    cache: str = setting(
        "auto",
        "decode every image once, resized, onto local disk, as one of the cache kinds",
        group="data",
        choices_from=CACHE_MODES,
        resume="quiet",
    )
    cache_side: int | None = setting(
        None,
        "the short side the decoded cache keeps images at (never below validation's "
        "resize); larger keeps the detail of large originals that RandomResizedCrop's small "
        "crops blow up to the training size",
        group="data",
        low=8,
        high=MAX_IMAGE_SIZE,
        default_text="validation's resize; for a folder of larger images, the side at which "
        "the smallest crop holds the training size, where it fits --cache-max-gb",
    )
    cache_max_gb: float = setting(
        4.0,
        "memory budget of raw cached pixels in auto mode (beyond it: packed JPEG)",
        group="data",
        low=0.0,
        low_open=True,
        resume="quiet",
    )
    augment_on: str = setting(
        "auto",
        "where training images are decoded, cropped, resized, flipped and normalised: on "
        "the model's device, the whole batch at once, or in the loader processes on the "
        "CPU; auto: on a GPU, whichever a measurement of a few images finds faster (the "
        "start line says the figures); on a CPU, the loader",
        group="data",
        choices=("auto", "device", "cpu"),
    )
    loader: str = setting(
        "auto",
        "what makes training batches: torch's DataLoader (see --augment-on), or NVIDIA "
        "DALI decoding each crop's region and resizing on the GPU, fed paratrain's own "
        "order (extra [dali]); auto: DALI too is measured where it is installed",
        group="data",
        choices=("auto", "torch", "dali"),
    )
    cache_dir: str | None = setting(
        None,
        "where the decoded cache and the embedded data set are written",
        group="data",
        metavar="DIR",
        default_text="~/.cache/paratrain",
        resume="quiet",
    )
