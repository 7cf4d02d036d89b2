"""Time to accuracy: the plain DDP loop against paratrain, from the command to a good model.

The generated photo set of benchmarks/vs_plain_loop.py made harder (JPEGs of 400x300,
5 classes, 80/20; ``--set``: ``mirror-safe``, whose labels survive a horizontal flip, or
``hard``, whose do not), same processes, model, image size, batch and epochs. Each run
evaluates after every epoch; the clock starts when the command is launched, so
start-up, decoding and cache building count for both. Printed: for a ladder of
accuracies, the seconds each run first reaches it and the plain loop's time over
paratrain's; then each run's best.

Variants (``--variants``):

* plain    — benchmarks/plain_ddp.py --eval-every-epoch (ImageFolder + PIL,
             DistributedSampler, DDP, fp32, SGD 0.01 x world, cosine to 0)
* defaults — ``paratrain train`` as it comes, with the same epochs
* defaults-lrf0 — the same, the cosine ending at 0 (``--lrf 0``) as the plain loop's does
* fast     — the defaults plus ``--progressive`` (half the size for most of the run)
  and ``--val-size`` (evaluation 25% larger than the final training size)
* third    — the defaults given ``--budget``: a third of the plain loop's time to its
  best (the target: reach that best within it); the run chooses its recipe
  (``--budget-recipe auto``: low resolution when fewer than 10 epochs fit)
* third-fixed — the same at the sizes as given (``--budget-recipe fixed``)
* third-low-res — the same with the low-resolution recipe's settings spelled out:
  training at 40 px, evaluating at 48, batch 32 a process, ``--lr-base 0.08`` (half the
  default rate for its global batch), what ``--budget-recipe low-res`` makes of 64 px

    python benchmarks/time_to_accuracy.py [--images 3000] [--size 64] [--epochs 8] \\
        [--nproc 2] [--set mirror-safe|hard] [--seeds 0 1 ...] [--variants plain ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
from _machine import machine  # noqa: E402
from vs_plain_loop import make_folder, plain_command, run  # noqa: E402

# vs_plain_loop's set made hard enough that accuracy climbs over the epochs: a colour
# offset per image hides each class's cast, the stripes fainter and their angles looser
HARD = {"noise": 55.0, "jitter": 0.4, "shift": 25.0, "contrast": 15.0}
# The same, its stripe angles over a quarter-turn so that a mirror image keeps its label
# (over HARD's half-turn a flip turns class 1's stripes into class 4's and 2's into 3's,
# and both recipes flip: their best is then a ceiling of about 61%, reached by neither
# sooner in any measured way), the jitter halved with the spacing
MIRROR_SAFE = {**HARD, "jitter": 0.2, "span": np.pi / 2}
SETS = {"hard": HARD, "mirror-safe": MIRROR_SAFE}
# what the budgeted low-resolution variant adds: training at 40 px, evaluating at 48,
# batch 32 a process at half the default rate for its global batch (0.02 at 2 x 32, the
# plain loop's rate at twice its batch)
LOW_RES = ["--image-size", "40", "--val-size", "48", "--batch-size", "32", "--lr-base", "0.08"]


def launch(command: list[str], cwd: Path, threads: int, **options) -> tuple[float, str]:
    """(time.time() at launch, stdout) of a command that must succeed (``options``:
    vs_plain_loop.run's timeout and tolerate, and environment variables)."""
    start = time.time()
    _, out = run(command, threads, cwd, **options)
    return start, out


def plain(data: Path, args, cwd: Path) -> list[tuple[float, float]]:
    """(seconds from launch, val top-1) after every epoch of the plain loop."""
    command = plain_command(
        data, args.size, args.nproc, args.epochs, "--eval-every-epoch", "--seed", str(args.seed)
    )
    start, out = launch(command, cwd, max(1, 2 // args.nproc))
    rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"epoch"')]
    return [(row["time"] - start, row["val_top1"]) for row in rows]


def paratrain(
    data: Path, args, cwd: Path, name: str, extra: list[str]
) -> list[tuple[float, float]]:
    """(seconds from launch, val top-1) after every epoch of a paratrain run."""
    command = [
        sys.executable, "-m", "paratrain", "train", "--data", str(data),
        "--image-size", str(args.size), "--batch-size", "16", "--epochs", str(args.epochs),
        "--nproc", str(args.nproc), "--name", name, "--seed", str(args.seed), *extra,
    ]  # fmt: skip
    cache = str(cwd / "cache" / name)  # built within the run
    launch(command, cwd, max(1, 2 // args.nproc), PARATRAIN_CACHE=cache)
    rows = [json.loads(x) for x in (cwd / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return [(row["since_start_s"], row["val_top1"]) for row in rows]


def first_reach(curve: list[tuple[float, float]], level: float) -> float | None:
    """Seconds to the first evaluation at ``level`` or above; the plain loop's top-1 is a
    float32 and paratrain's a float64, so the same count of images is the same level
    only to about 1e-7."""
    return next((t for t, top1 in curve if top1 >= level - 1e-6), None)


def run_seed(args, data: Path, cwd: Path, seed: int) -> dict[str, list[tuple[float, float]]]:
    """Every variant's curve with both loops seeded by ``seed``, printed as it ends."""
    args = argparse.Namespace(**{**vars(args), "seed": seed})  # the loops read args.seed
    curves: dict[str, list[tuple[float, float]]] = {}
    small = max(8, (args.size // 2) // 8 * 8)
    extras = {
        "defaults": [],
        "defaults-lrf0": ["--lrf", "0"],  # cosine to 0, as the plain loop
        "fast": ["--progressive", f"{small}:{args.size}", "--val-size", str(args.size * 5 // 4)],
    }
    for variant in args.variants:
        if variant == "plain":
            curves[variant] = plain(data, args, cwd)
            continue
        if variant.startswith("third"):  # --budget: a third of plain's time to its best
            base = curves.get("plain")
            if not base:
                sys.exit(f"{variant} needs the plain variant run before it")
            third = first_reach(base, max(a for _, a in base)) / 3
            extras[variant] = ["--budget", f"{third:.0f}s"] + {
                "third": [],
                "third-fixed": ["--budget-recipe", "fixed"],
                "third-low-res": LOW_RES,
            }[variant]
        curves[variant] = paratrain(data, args, cwd, f"{variant}-{seed}", extras[variant])
    print(f"\nseed {seed}:")
    for variant in args.variants:
        print(f"  {variant}: {' '.join(extras.get(variant, [])) or '(as above)'}")
    for name, curve in curves.items():
        print(f"  {name:9s} " + "  ".join(f"{t:6.1f}s {a:.1%}" for t, a in curve))
    base = curves.get("plain")
    ladder = [0.6, 0.7, 0.8] + ([max(a for _, a in base)] if base else [])
    print("seconds from launch to first reaching each accuracy (plain / run):")
    for level in ladder:
        cells = []
        for name, curve in curves.items():
            t = first_reach(curve, level)
            ratio = ""
            if base and name != "plain" and t is not None:
                b = first_reach(base, level)
                ratio = f" ({b / t:.2f}x)" if b is not None else ""
            cells.append(f"{name} {'-' if t is None else f'{t:.1f}s'}{ratio}")
        print(f"  {level:.1%}: " + ", ".join(cells))
    for name, curve in curves.items():
        print(f"  best {name}: {max(a for _, a in curve):.1%}, final {curve[-1][1]:.1%}")
    return curves


def summary(runs: dict[int, dict[str, list[tuple[float, float]]]]) -> None:
    """Over the seeds: each variant's time to the plain loop's best of the same seed (and
    the plain loop's time over it), its best and final top-1, and their means."""
    print("\nover the seeds: time to the plain loop's best (speed-up), best / final top-1")
    names = list(next(iter(runs.values())))
    for name in names:
        cells, bests, finals = [], [], []
        for seed, curves in runs.items():
            curve, base = curves[name], curves.get("plain")
            reach = ""
            if base:
                level = max(a for _, a in base)
                t, b = first_reach(curve, level), first_reach(base, level)
                reach = "-, " if t is None else f"{t:.1f}s ({b / t:.2f}x), "
            best, final = max(a for _, a in curve), curve[-1][1]
            bests.append(best)
            finals.append(final)
            cells.append(f"seed {seed} {reach}{best:.1%} / {final:.1%}")
        print(
            f"  {name}: "
            + "; ".join(cells)
            + f"; mean {np.mean(bests):.1%} / {np.mean(finals):.1%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--variants", nargs="+", default=["plain", "defaults", "third", "third-fixed"]
    )
    parser.add_argument("--set", choices=sorted(SETS), default="mirror-safe")
    parser.add_argument(
        "--seeds", nargs="+", type=int, default=[0], help="both loops' seed, a run of each"
    )
    args = parser.parse_args()
    print(
        f"{args.images} JPEGs 400x300 ({args.set}), resnet18 at {args.size} px, batch 16 x "
        f"{args.nproc} process(es), {args.epochs} epochs, {machine()}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        data = make_folder(cwd / "data", args.images, **SETS[args.set])
        runs = {seed: run_seed(args, data, cwd, seed) for seed in args.seeds}
    if len(runs) > 1:
        summary(runs)


if __name__ == "__main__":
    main()
