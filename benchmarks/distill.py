"""--teacher on a generated set: a small student distilled from a trained larger teacher
against the same student from scratch, in the same epochs, over several seeds.

The set: benchmarks/balance.py's colour patches (5 classes whose colours overlap), the
classes balanced (``--per-class`` training images each, 40 each in validation). The
teacher (``--teacher``, resnet34) trains ``--teacher-epochs`` once; each seed then trains
the student (``--student``, resnet18) ``--epochs`` from scratch, and again with the
teacher (--kd-alpha 0.5, --kd-temperature 4). Printed: a markdown table of the final
validation top-1 and loss (mean over seeds, spread), the teacher's own, and the machine.

    python benchmarks/distill.py [--seeds 0 1 2] [--epochs 4] [--teacher-epochs 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import machine  # noqa: E402
from balance import make_imbalanced  # noqa: E402
from vs_plain_loop import run  # noqa: E402


def train(data: Path, cwd: Path, name: str, model: str, epochs: int, seed: int, size: int,
          *extra: str) -> dict:  # fmt: skip
    command = [
        sys.executable, "-m", "paratrain", "train", "--data", str(data), "--model", model,
        "--image-size", str(size), "--epochs", str(epochs), "--batch-size", "32",
        "--workers", "1", "--cache", "on", "--seed", str(seed), "--name", name,
        "--output-dir", str(cwd / "runs"), "--balance", "none", *extra,
    ]  # fmt: skip
    run(command, 2, cwd)
    rows = (cwd / "runs" / name / "metrics.jsonl").read_text().splitlines()
    return json.loads(rows[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--teacher-epochs", type=int, default=12)
    parser.add_argument("--per-class", type=int, default=120)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--teacher", default="resnet34")
    parser.add_argument("--student", default="resnet18")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        cwd = Path(folder)
        data = make_imbalanced(cwd / "data", 100, args.per_class, args.per_class, 40)
        taught = train(data, cwd, "teacher", args.teacher, args.teacher_epochs, 0, args.size)
        weights = str(cwd / "runs" / "teacher" / "checkpoints" / "best.pt")
        results: dict[str, list[dict]] = {"scratch": [], "distilled": []}
        for seed in args.seeds:
            results["scratch"].append(
                train(data, cwd, f"scratch-{seed}", args.student, args.epochs, seed, args.size)
            )
            results["distilled"].append(
                train(
                    data,
                    cwd,
                    f"kd-{seed}",
                    args.student,
                    args.epochs,
                    seed,
                    args.size,
                    "--teacher",
                    args.teacher,
                    "--teacher-weights",
                    weights,
                )  # fmt: skip
            )
            print(f"seed {seed}: scratch {results['scratch'][-1]['val_top1']:.3f}, distilled "
                  f"{results['distilled'][-1]['val_top1']:.3f}", file=sys.stderr)  # fmt: skip
    print(f"machine: {machine()}; teacher {args.teacher} ({args.teacher_epochs} epochs): "
          f"top-1 {taught['val_top1']:.3f}; student {args.student}, {args.epochs} epochs at "
          f"{args.size} px, seeds {args.seeds}")  # fmt: skip
    print("\n| student | top-1 (mean, spread) | val loss |")
    print("|---|---|---|")
    for name, rows in results.items():
        top1 = [r["val_top1"] for r in rows]
        loss = statistics.fmean(r["val_loss"] for r in rows)
        print(f"| {name} | {statistics.fmean(top1):.3f} ({max(top1) - min(top1):.3f}) | "
              f"{loss:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
