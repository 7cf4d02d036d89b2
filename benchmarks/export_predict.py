"""`paratrain predict` from a checkpoint, a torch.export program and an ONNX model, side
by side: the same trained model, the same images, the answers compared.

A small run is trained on a generated folder (vs_plain_loop's JPEGs of 400x300), then
exported; each form predicts N and 8N images (the folder read again for 8N). Printed:
the export's seconds and size, each form's images/s (decoding included, the command's
own loop), and the largest probability difference from the checkpoint's answers.

    python benchmarks/export_predict.py [--images 64] [--size 64] [--model resnet18]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import machine  # noqa: E402
from vs_plain_loop import make_folder  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--model", default="resnet18")
    args = parser.parse_args()
    from paratrain import TrainConfig, train
    from paratrain.engine.inference.export import export
    from paratrain.engine.inference.predict import predict

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_folder(root / "data", max(args.images, 50))
        train(
            TrainConfig(
                data=str(data), model=args.model, image_size=args.size, epochs=1,
                workers=0, output_dir=str(root / "runs"), name="r",
            )
        )  # fmt: skip
        checkpoint = str(root / "runs/r/checkpoints/last.pt")
        sources = {"checkpoint": checkpoint}
        for fmt in ("pt2", "onnx"):
            start = time.perf_counter()
            written = export(checkpoint, fmt)["export"]
            seconds = time.perf_counter() - start
            size = os.path.getsize(written) / 2**20
            print(f"export {fmt}: {seconds:.1f} s, {size:.1f} MiB")
            sources[fmt] = written
        images = sorted(str(p) for p in data.rglob("*.jpg"))[: args.images]
        many = root / "many"
        for copy in range(8):  # 8N: the same images under other names
            for i, path in enumerate(images):
                target = many / f"{copy}-{i}.jpg"
                target.parent.mkdir(exist_ok=True)
                shutil.copyfile(path, target)
        print(f"{args.model} at {args.size} px, {machine()}, batch 64")
        answers = {}
        for name, source in sources.items():
            cells = []
            for inputs in (images, [str(many)]):
                start = time.perf_counter()
                rows, _ = predict(source, inputs, top_k=5)
                rate = len(rows) / (time.perf_counter() - start)
                cells.append(f"{len(rows)} images {rate:.0f}/s")
                answers.setdefault(name, rows)
            worst = max(
                abs(p - dict(a["top"])[c])
                for r, a in zip(answers["checkpoint"], answers[name], strict=True)
                for c, p in r["top"]
            )
            print(f"  {name:10s} " + ", ".join(cells) + f"; largest difference {worst:.2e}")


if __name__ == "__main__":
    main()
