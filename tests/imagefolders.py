"""Generate small labelled image folders whose classes are learnable (by colour)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

PALETTE = [
    (220, 40, 40),
    (40, 200, 60),
    (40, 60, 220),
    (230, 200, 30),
    (160, 40, 200),
    (30, 200, 200),
    (240, 120, 20),
    (120, 120, 120),
    (250, 250, 250),
    (10, 10, 10),
]


def make_image_folder(
    root: Path,
    classes: int = 3,
    per_class: int = 12,
    size: tuple[int, int] = (40, 30),
    layout: str = "split",
    seed: int = 0,
    ext: str = ".jpg",
) -> Path:
    """``root/<class>/*`` (layout "split") or ``root/{train,val}/<class>/*`` ("given")."""
    rng = np.random.default_rng(seed)
    names = [f"class_{i}" for i in range(classes)]
    subsets = (
        [("", per_class)]
        if layout == "split"
        else [("train", per_class), ("val", max(2, per_class // 3))]
    )
    for subset, count in subsets:
        for c, name in enumerate(names):
            folder = root / subset / name
            folder.mkdir(parents=True, exist_ok=True)
            base = np.array(PALETTE[c % len(PALETTE)], dtype=np.float32)
            for i in range(count):
                noise = rng.normal(0, 25, size=(size[1], size[0], 3))
                pixels = np.clip(base + noise, 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:03d}{ext}")
    return root


def make_damaged_folder(root, classes=3, per_class=34):
    """3% truncated JPEGs, 1% zero-byte files and stray .txt files."""
    data = make_image_folder(root, classes=classes, per_class=per_class, size=(64, 48))
    images = sorted(p for p in data.rglob("*.jpg"))
    rng = np.random.default_rng(1)
    picked = rng.choice(len(images), size=4, replace=False)
    truncated = [images[i] for i in picked[:3]]
    empty = [images[picked[3]]]
    for path in truncated:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for path in empty:
        path.write_bytes(b"")
    for c in range(classes):
        (data / f"class_{c}" / "notes.txt").write_text("not an image")
    return data, sorted(str(p) for p in truncated + empty)


def _jpeg(rng, colour: int, size: tuple[int, int]) -> bytes:
    import io

    base = np.array(PALETTE[colour % len(PALETTE)], dtype=np.float32)
    pixels = np.clip(base + rng.normal(0, 25, size=(size[1], size[0], 3)), 0, 255)
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


def make_hf_dataset(
    root: Path,
    classes: int = 3,
    per_class: int = 12,
    splits: tuple[str, ...] = ("train", "validation"),
    image_column: str = "image",
    label_column: str = "label",
    class_label: bool = True,
    form: str = "save_to_disk",
    size: tuple[int, int] = (40, 30),
    several: bool = False,
) -> Path:
    """A Hugging Face dataset on disk: ``save_to_disk`` (a DatasetDict) or parquet files
    (``root/<split>-00000.parquet``), an Image column and a ClassLabel (or plain int)
    column; the validation split has a third as many images per class. ``several``: a
    Sequence(ClassLabel) column, every other image of class c also labelled c + 1."""
    import datasets

    rng = np.random.default_rng(0)
    names = [f"class_{i}" for i in range(classes)]
    label_type = datasets.ClassLabel(names=names) if class_label else datasets.Value("int64")
    if several:
        label_type = datasets.Sequence(label_type)
    features = datasets.Features({image_column: datasets.Image(), label_column: label_type})
    made = {}
    for split in splits:
        count = per_class if split == splits[0] else max(2, per_class // 3)
        rows = [(c, _jpeg(rng, c, size)) for c in range(classes) for _ in range(count)]
        made[split] = datasets.Dataset.from_dict(
            {
                image_column: [{"bytes": raw, "path": None} for _, raw in rows],
                label_column: [
                    ([c, (c + 1) % classes][: 1 + i % 2] if several else c)
                    for i, (c, _) in enumerate(rows)
                ],
            },
            features=features,
        )
    if form == "save_to_disk":
        datasets.DatasetDict(made).save_to_disk(str(root))
    else:
        root.mkdir(parents=True, exist_ok=True)
        for split, dataset in made.items():
            dataset.to_parquet(str(root / f"{split}-00000.parquet"))
    return root


def make_multilabel_folder(
    root: Path, classes: int = 4, images: int = 48, size: int = 32, seed: int = 0
) -> Path:
    """``root/NNN.png`` images of 1 to 3 labels and ``root/labels.csv`` naming them
    (``image,labels``, names separated by ``;``): an image is stripes of its labels'
    colours, so each label is learnable. Returns the labels file."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    lines = ["image,labels"]
    for i in range(images):
        count = 1 + i % 3
        chosen = sorted(rng.choice(classes, size=min(count, classes), replace=False).tolist())
        pixels = np.zeros((size, size, 3), np.float32)
        bands = np.array_split(np.arange(size), len(chosen))
        for band, c in zip(bands, chosen, strict=True):
            pixels[band] = PALETTE[c % len(PALETTE)]
        pixels = np.clip(pixels + rng.normal(0, 20, pixels.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(root / f"{i:03d}.png")
        lines.append(f"{i:03d}.png," + ";".join(f"label_{c}" for c in chosen))
    listing = root / "labels.csv"
    listing.write_text("\n".join(lines) + "\n")
    return listing


def make_shards(
    root: Path,
    shards: int = 4,
    classes: int = 3,
    per_shard: int = 12,
    label: str = "number",
    names_file: bool = False,
    size: tuple[int, int] = (40, 30),
    prefix: str = "shard",
) -> Path:
    """WebDataset tar shards ``root/<prefix>-000.tar``...: each sample a ``.jpg`` and a
    ``.cls`` (its class number, or its class name with ``label="name"``); returns root."""
    import io
    import tarfile

    rng = np.random.default_rng(len(prefix))
    root.mkdir(parents=True, exist_ok=True)
    count = 0
    for shard in range(shards):
        with tarfile.open(root / f"{prefix}-{shard:03d}.tar", "w") as tar:
            for _ in range(per_shard):
                c = count % classes
                key = f"sample{count:06d}"
                text = str(c) if label == "number" else f"class_{c}"
                for name, data in (
                    (f"{key}.jpg", _jpeg(rng, c, size)),
                    (f"{key}.cls", text.encode()),
                ):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
                count += 1
    if names_file:
        (root / "classes.txt").write_text("".join(f"class_{c}\n" for c in range(classes)))
    return root


def make_csv_listing(root: Path, classes: int = 3, per_class: int = 16, split: bool = True) -> Path:
    """A flat folder of images and ``root/labels.csv`` naming each one's class (and, with
    ``split``, its side: every fourth of a class to val): the Kaggle layout."""
    made = make_image_folder(root / "tmp", classes=classes, per_class=per_class)
    images = root / "images"
    images.mkdir(parents=True)
    rows = ["file,label" + (",split" if split else "")]
    for folder in sorted(made.iterdir()):
        for i, path in enumerate(sorted(folder.iterdir())):
            name = f"{folder.name}-{path.name}"
            path.rename(images / name)
            side = ",val" if i % 4 == 3 else ",train"
            rows.append(f"images/{name},{folder.name}" + (side if split else ""))
    (root / "labels.csv").write_text("\n".join(rows) + "\n")
    return root / "labels.csv"
