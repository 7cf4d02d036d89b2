"""When low resolution pays under --budget: the sizes as given against the low-res recipe.

On the two generated sets of benchmarks/ablation.py (stripes: time_to_accuracy's
mirror-safe set; shapes), each budget is run with ``--budget-recipe fixed`` and with
``--budget-recipe low-res`` (5/8 of the size in training, 3/4 in evaluation, twice the
batch at the same rate); and, with ``--recipes ... auto``, as the default chooses. Printed per run:
the epochs it trained, its best and its final validation top-1; and, for ``auto``, what
it chose and how many epochs it reckoned would fit at the sizes as given. The budget at
which the two recipes cross is what ``--budget-recipe auto``'s threshold (SHORT in
engine/prerun/budget.py) rests on.

    python benchmarks/budget_recipe.py [--budgets 45 90 180] [--seeds 0 1] [--size 64] \\
        [--images 3000] [--nproc 2] [--sets stripes shapes] [--recipes fixed low-res auto]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import machine  # noqa: E402
from ablation import make_set  # noqa: E402
from vs_plain_loop import run  # noqa: E402

CHOSE = re.compile(
    r"budget \S+: about ([\d.]+) epochs fit at .*?: (--budget-recipe low-res|the sizes.*)"
)


def train(data: Path, args, cwd: Path, name: str, budget: int, recipe: str, seed: int) -> dict:
    command = [
        sys.executable, "-m", "paratrain", "train", "--data", str(data),
        "--image-size", str(args.size), "--batch-size", "16", "--nproc", str(args.nproc),
        "--seed", str(seed), "--name", name, "--budget", f"{budget}s",
        "--budget-recipe", recipe,
    ]  # fmt: skip
    cache = str(cwd / "cache" / name)  # built within the run, as a user's first run does
    _, out = run(command, max(1, 2 // args.nproc), cwd, PARATRAIN_CACHE=cache)
    rows = [json.loads(x) for x in (cwd / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    found = CHOSE.search(out)
    return {
        "epochs": rows[-1]["epoch"],
        "best": max(r["val_top1"] for r in rows),
        "final": rows[-1]["val_top1"],
        "chose": ("low-res" if "low-res" in found.group(2) else "fixed") if found else "",
        "fits": float(found.group(1)) if found else None,
        "said": found.group(0) if found else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[45, 90, 180])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--sets", nargs="+", choices=["stripes", "shapes"], default=["stripes", "shapes"]
    )
    parser.add_argument(
        "--recipes", nargs="+", choices=["fixed", "low-res", "auto"], default=["fixed", "low-res"]
    )
    args = parser.parse_args()
    recipes = args.recipes
    print(
        f"{args.images} JPEGs 400x300 a set, resnet18 at {args.size} px, batch 16 x "
        f"{args.nproc} process(es), {machine()}; top-1 best / final"
    )
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        for name in args.sets:
            data = make_set(name, cwd / name, args.images)
            for budget in args.budgets:
                for seed in args.seeds:
                    cells = []
                    for recipe in recipes:
                        r = train(data, args, cwd, f"{name}-{budget}-{recipe}-{seed}", budget,
                                  recipe, seed)  # fmt: skip
                        chose = f" chose {r['chose']} ({r['fits']:.1f} fit)" if r["chose"] else ""
                        cells.append(
                            f"{recipe} {r['epochs']} ep {r['best']:.1%} / {r['final']:.1%}{chose}"
                        )
                    print(f"  {name} {budget}s seed {seed}: " + ", ".join(cells), flush=True)
                    if r["said"]:  # auto's (the last recipe): how it chose
                        print(f"    {r['said']}", flush=True)


if __name__ == "__main__":
    main()
