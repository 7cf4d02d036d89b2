"""JPEG decoders on this CPU, one core: which one the loader and the packed cache use.

Times, per image, on photo-like JPEGs: the originals (400x300, quality 90) decoded whole
and at reduced scale (PIL's draft, simplejpeg's min size) as training at 224 px needs
them, and the packed cache's entries (short side 256, quality 90), with PIL, simplejpeg
(libjpeg-turbo; pip install 'paratrain[fast]') and torchvision's decode_jpeg. Each
decoder's pixels are compared with PIL's (the same libjpeg-turbo: identical where the
options match). On CUDA, also torchvision's batched nvJPEG decode of a whole batch.

    python benchmarks/jpeg_decode.py [--images 200] [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from _machine import machine  # noqa: E402
from loader_cache import photo  # noqa: E402

from paratrain.data import jpeg  # noqa: E402


def encoded(count: int, size: tuple[int, int]) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(photo(rng, *size)).save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def pil_whole(raw: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(raw)) as image:
        return np.asarray(image.convert("RGB"))


def pil_draft(raw: bytes, at_least: int) -> np.ndarray:
    with Image.open(io.BytesIO(raw)) as image:
        image.draft("RGB", (at_least, at_least))
        return np.asarray(image.convert("RGB"))


def per_image_ms(decode, images: list[bytes], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for raw in images:
            decode(raw)
        times.append((time.perf_counter() - start) / len(images) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from torchvision.io import ImageReadMode, decode_jpeg

    def tv(raw: bytes) -> np.ndarray:
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        return decode_jpeg(data, mode=ImageReadMode.RGB).permute(1, 2, 0).numpy()

    decoders = {"PIL": pil_whole, "torchvision": tv}
    if jpeg.simplejpeg is not None:
        decoders["simplejpeg"] = lambda raw: jpeg.simplejpeg.decode_jpeg(raw, colorspace="RGB")
    print(f"{machine()}; one thread; {args.images} photo-like JPEGs each")
    print(f"{'images':<34}{'decoder':<24}{'ms/image':>9}  same pixels as PIL")
    for name, size in (
        ("originals 400x300 q90", (300, 400)),
        ("packed entries 256x341 q90", (256, 341)),
    ):
        images = encoded(args.images, size)
        reference = pil_whole(images[0])
        for decoder, decode in decoders.items():
            ms = per_image_ms(decode, images, args.rounds)
            same = np.array_equal(decode(images[0]), reference)
            print(f"{name:<34}{decoder:<24}{ms:>9.3f}  {same}")
        if size == (300, 400):  # training at 224 px keeps a short side of 256: 1/1 scale;
            # evaluation at 64 px (short side 73) decodes at 1/4
            ms = per_image_ms(lambda raw: pil_draft(raw, 73), images, args.rounds)
            print(f"{name:<34}{'PIL draft (>= 73 px)':<24}{ms:>9.3f}  (reduced scale)")
            if jpeg.simplejpeg is not None:
                scaled = lambda raw: jpeg.simplejpeg.decode_jpeg(  # noqa: E731
                    raw, colorspace="RGB", min_height=73, min_width=73
                )
                ms = per_image_ms(scaled, images, args.rounds)
                print(f"{name:<34}{'simplejpeg (>= 73 px)':<24}{ms:>9.3f}  (reduced scale)")
    if torch.cuda.is_available():
        images = encoded(64, (300, 400))
        batch = [torch.frombuffer(bytearray(raw), dtype=torch.uint8) for raw in images]
        decode_jpeg(batch[:2], device="cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.rounds):
            decode_jpeg(batch, device="cuda", mode=ImageReadMode.RGB)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / (args.rounds * len(batch)) * 1e3
        print(f"{'originals 400x300 q90':<34}{'nvJPEG, batch of 64':<24}{ms:>9.3f}")


if __name__ == "__main__":
    main()
