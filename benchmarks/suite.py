"""Time to accuracy across a suite of sets nobody tuned on (benchmarks/suite_sets.py and
the embedded digits): the plain loop against paratrain, per set and seed.

Arms, each a run that evaluates after every epoch, the clock from the command's launch:

* plain      — benchmarks/plain_ddp.py --eval-every-epoch (the reference)
* defaults   — ``paratrain train`` as it comes, at the plain loop's epochs
* third      — the defaults given ``--budget``: a third of the plain loop's time to its
               best (the same set and seed), the recipe left to ``--budget-recipe auto``
* two-thirds — the same at two thirds

Runnable in pieces, since the whole is long on 2 cores: ``run`` appends each finished
(set, seed, arm) to ``--results`` (JSON lines) and skips those already there; the
budget arms need their plain run first. ``report`` prints, per set and for the two
halves (the sets the recipes may be chosen on, and the sets that confirm them): each
arm's time to the plain loop's best and its speed-up, its best and final top-1 (means
over the seeds), the equal-epoch gap to the plain loop at every epoch against one
seed's spread, then the geometric means and the confirm half's targets. Each ``run``
first times a fixed step of ResNet-18 (CALIBRATE) and records it with every arm;
``report`` names the sets whose arms ran on a machine a fifth slower or faster than
their plain runs, whose budgets then held fewer or more epochs than their share implies.

``chance`` says how often the equal-epoch verdict flags the plain loop against its own
other seeds (a set run with at least twice ``--group`` seeds), beside how often it flags
the defaults.

    python benchmarks/suite.py run --sets colour fine digits --seeds 0 1 2
    python benchmarks/suite.py report [--markdown]
    python benchmarks/suite.py chance --sets few [--group 3]
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import machine  # noqa: E402
from suite_sets import SETS, described, make_set  # noqa: E402
from time_to_accuracy import first_reach  # noqa: E402
from time_to_accuracy import launch as launch_once  # noqa: E402
from vs_plain_loop import plain_command  # noqa: E402

from paratrain.report.metrics import judged  # noqa: E402

CHOOSE = ("colour", "texture", "many")  # the recipes' rules may be chosen on these
CONFIRM = ("shape", "fine", "few", "digits")  # and are confirmed on these
ARMS = ("plain", "defaults", "third", "two-thirds")
SIZES = {"digits": 32}  # the training size (the rest: --size)
# Epochs a run gets where not --epochs 8: few's 240 training images make 8 steps an epoch,
# so its runs get the steps the 2,000-image sets get in 8 epochs (400); at 8 epochs the
# plain loop itself never left chance there (a best of 17.2%, 10 classes)
EPOCHS = {"few": 50}
TIMEOUT = 600  # seconds a run may take before it is taken for stalled
TOO_SHORT = "was used up before the first step"  # a budget shorter than the start-up


def write_digits(root: Path) -> Path:
    """The embedded digits as root/{train,val}/class/*.png (a fifth of each class to
    validation, by order)."""
    from PIL import Image

    from paratrain.data.builtin import DIGITS_FILE

    with np.load(DIGITS_FILE) as digits:
        images, labels = digits["images"], digits["labels"]
    seen: dict[int, int] = {}
    for index, (pixels, label) in enumerate(zip(images, labels, strict=True)):
        count = seen[int(label)] = seen.get(int(label), -1) + 1
        side = "val" if count % 5 == 0 else "train"
        folder = root / side / f"class_{int(label)}"
        folder.mkdir(parents=True, exist_ok=True)
        grey = np.clip(pixels * (255 / 16), 0, 255).astype(np.uint8)
        Image.fromarray(grey, mode="L").save(folder / f"{index:04d}.png")
    return root


def data_of(name: str, work: Path) -> Path:
    """The set's folder under ``work``, written once (again where the set has changed
    since: its marker file names what it holds)."""
    root, written = work / "data" / name, work / "data" / f"{name}.complete"
    what = "the embedded digits" if name == "digits" else described(name)
    if not written.exists() or written.read_text() != what:  # none yet, or the set changed
        import shutil

        shutil.rmtree(root, ignore_errors=True)
        write_digits(root) if name == "digits" else make_set(name, root)
        written.write_text(what)
    return root


def launch(
    command: list[str], cwd: Path, threads: int, budget: bool = False, **env: str
) -> tuple[float, str]:
    """time_to_accuracy.launch, tried a second time where the first hangs past TIMEOUT
    (a 2-process gloo run with loader workers was seen to stall, once, with no process
    using the CPU). ``budget``: a run refused because its budget is shorter than its
    start-up gives no output (no epoch)."""
    for attempt in (1, 2):
        try:
            return launch_once(command, cwd, threads, timeout=TIMEOUT,
                               tolerate=TOO_SHORT if budget else None, **env)  # fmt: skip
        except subprocess.TimeoutExpired:
            print(f"  stalled past {TIMEOUT}s (attempt {attempt}): {' '.join(command[-12:])}")
    sys.exit(f"stalled twice: {' '.join(command)}")


def run_arm(name: str, arm: str, seed: int, args, done: dict) -> list[list[float]]:
    """One arm's curve: [seconds from launch, val top-1] after each epoch."""
    data, size = data_of(name, args.work), SIZES.get(name, args.size)
    epochs = args.epochs or EPOCHS.get(name, 8)
    threads = max(1, 2 // args.nproc)
    if arm == "plain":
        command = plain_command(data, size, args.nproc, epochs, "--eval-every-epoch",
                                "--seed", str(seed))  # fmt: skip
        start, out = launch(command, args.work, threads)
        rows = [json.loads(line) for line in out.splitlines() if line.startswith('{"epoch"')]
        return [[row["time"] - start, row["val_top1"]] for row in rows]
    extra: list[str] = []
    if arm in ("third", "two-thirds"):
        base = done[(name, seed, "plain")]
        share = 1 / 3 if arm == "third" else 2 / 3
        seconds = first_reach(base, max(a for _, a in base)) * share
        extra = ["--budget", f"{max(seconds, 5):.0f}s"]
    run_name = f"{args.results.stem}-{name}-{arm}-{seed}"
    command = [
        sys.executable, "-m", "paratrain", "train", "--data", str(data), "--image-size",
        str(size), "--batch-size", "16", "--epochs", str(epochs), "--nproc",
        str(args.nproc), "--name", run_name, "--seed", str(seed), *extra, *args.flags,
    ]  # fmt: skip
    _, out = launch(command, args.work, threads, bool(extra),
                    PARATRAIN_CACHE=str(args.work / "cache" / run_name))  # fmt: skip
    metrics = args.work / "runs" / run_name / "metrics.jsonl"
    if not metrics.exists():  # refused: its budget was shorter than its start-up
        return []
    # its lines beside its metrics: what auto chose for the budget, and why
    (metrics.parent / "stdout.txt").write_text(out)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    column = "val_top1" + judged(rows)  # the EMA weights' where the run kept them
    return [[row["since_start_s"], row[column]] for row in rows]


def _rows(results: Path) -> list[dict]:
    if not results.exists():
        return []
    return [json.loads(line) for line in results.read_text().splitlines() if line.strip()]


def curves(rows: list[dict]) -> dict[tuple[str, int, str], list[list[float]]]:
    return {(r["set"], r["seed"], r["arm"]): r["curve"] for r in rows}


def load(results: Path) -> dict[tuple[str, int, str], list[list[float]]]:
    return curves(_rows(results))


# A fixed piece of work timed before a session's arms: ResNet-18's training step at 64 px,
# batch 16, one thread (as each of the 2 processes trains), the median of 15 after 1. The
# budget arms' seconds are shares of plain runs that may have run in another session, and
# machines of the same name differ: one session's host trained ResNet-18 1.4-1.5x slower
# than the last's (docs/benchmarks.md), so its budgets held fewer epochs than a third of
# the plain loop's time implies. report says where an arm's machine and its plain run's
# differ by more than a fifth.
CALIBRATE = """
import statistics, time, torch, torchvision, paratrain.engine
torch.set_num_threads(1); torch.manual_seed(0)
model = torchvision.models.resnet18(num_classes=10)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
times = []
for _ in range(16):
    start = time.perf_counter()
    optimizer.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step(); times.append(time.perf_counter() - start)
print(1000 * statistics.median(times[1:]))
"""
# report: a machine this much slower or faster than the plain run's (the step's own spread:
# 347 to 375 ms over four calls in a row on one machine)
DIFFER = 1.2


def calibrate() -> float:
    """Milliseconds of CALIBRATE's step on this machine now (it loads the libraries as
    well: a session's first launch was seen to start late, as from a cold disk cache, a
    budget run's first step at 16.4 s, 9.3 s when run again; loaded here, untimed, the
    first arm timed starts as the others do)."""
    done = subprocess.run([sys.executable, "-c", CALIBRATE], check=True, capture_output=True,
                          text=True)  # fmt: skip
    return float(done.stdout.split()[-1])


def run(args) -> None:
    args.work.mkdir(parents=True, exist_ok=True)
    done = load(args.results)
    pending = [(n, s, a) for n in args.sets for s in args.seeds for a in args.arms
               if (n, s, a) not in done]  # fmt: skip
    if not pending:  # every arm asked for is in the results already: nothing to time
        return
    step_ms = calibrate()
    print(f"{machine()}: ResNet-18's step at 64 px, batch 16, one thread: {step_ms:.0f} ms",
          flush=True)  # fmt: skip
    for name, seed, arm in pending:
        curve = run_arm(name, arm, seed, args, done)
        done[(name, seed, arm)] = curve
        with args.results.open("a") as handle:
            handle.write(json.dumps({"set": name, "seed": seed, "arm": arm, "curve": curve,
                                     "step_ms": step_ms}) + "\n")  # fmt: skip
        if not curve:
            print(f"{name} seed {seed} {arm}: refused, its budget shorter than its start-up",
                  flush=True)  # fmt: skip
            continue
        best = max(a for _, a in curve)
        print(f"{name} seed {seed} {arm}: best {best:.1%} final {curve[-1][1]:.1%} "
              f"in {curve[-1][0]:.0f}s", flush=True)  # fmt: skip


def _row(name: str, done: dict, seeds: list[int]) -> dict | None:
    """A set's figures over the seeds that have its plain run."""
    seeds = [s for s in seeds if (name, s, "plain") in done]
    if not seeds:
        return None
    row: dict = {"seeds": len(seeds)}
    for arm in ARMS:
        curves = [(s, done[(name, s, arm)]) for s in seeds if (name, s, arm) in done]
        if not curves:
            continue
        speed, reached = [], 0
        for seed, curve in curves:
            base = done[(name, seed, "plain")]
            level = max(a for _, a in base)
            t, b = first_reach(curve, level), first_reach(base, level)
            if t is not None and b is not None:
                speed.append(b / t)
                reached += 1
        row[arm] = {  # a run refused for its short budget trained nothing: 0
            "best": float(np.mean([max((a for _, a in c), default=0.0) for _, c in curves])),
            "final": float(np.mean([c[-1][1] if c else 0.0 for _, c in curves])),
            "speedup": float(np.exp(np.mean(np.log(speed)))) if speed else None,
            "reached": f"{reached}/{len(curves)}",
        }
    # equal epochs: the defaults' top-1 less the plain loop's, epoch by epoch (means over
    # the seeds), against one seed's spread
    pairs = [(done[(name, s, "plain")], done[(name, s, "defaults")]) for s in seeds
             if (name, s, "defaults") in done]  # fmt: skip
    if pairs:
        row["gap"], row["spread"] = equal_epoch_gap([p for p, _ in pairs], [d for _, d in pairs])
    return row


def equal_epoch_gap(plain: list, other: list) -> tuple[list[float], float]:
    """``other``'s mean top-1 less ``plain``'s at every epoch both reached (each a list
    of several seeds' curves), and one seed's spread (``plain``'s: spread_of)."""
    epochs = min(len(c) for c in [*plain, *other])
    gap = [float(np.mean([c[e][1] for c in other]) - np.mean([c[e][1] for c in plain]))
           for e in range(epochs)]  # fmt: skip
    return gap, spread_of([c[:epochs] for c in plain])


def spread_of(curves: list[list[list[float]]]) -> float:
    """One seed's spread on a set: the plain loop's standard deviation over the seeds
    (sample, ddof 1), pooled over the epochs (the root of the mean variance). Pooled,
    since three seeds' deviation at one epoch is itself a noisy figure (it was 0.5
    points at one epoch of a set whose epochs' ranged to 5.8), and the worst of eight
    such epochs would then decide."""
    if len(curves) < 2:
        return 0.0
    top1 = np.array([[a for _, a in curve] for curve in curves])
    return float(np.sqrt(np.mean(np.var(top1, axis=0, ddof=1))))


LUCK = 0.2  # chance: the share of draws flagged that a lead is sized to


def chance(args) -> None:
    """How often the equal-epoch target flags a set by chance. With more seeds than a
    run of the suite has (``--group`` of them, 3 as the suite): every way of taking
    ``--group`` seeds' plain runs as the loop and as many others as the arm, that is,
    the loop against itself, and the share flagged behind by more than a seed's spread
    at some epoch; beside it, every ``--group`` seeds of the defaults against the same
    seeds' plain runs, and the share flagged; the lead at every epoch that an arm would
    need over the loop to be flagged in no more than ``LUCK`` of the draws; and the
    defaults' mean gap over every epoch and seed, with its standard error over the
    seeds."""
    done = load(args.results)
    k = args.group
    if k < 2:
        sys.exit("--group: at least 2 seeds a side (one seed has no spread)")
    for name in args.sets:
        plain = {s: c for (n, s, a), c in done.items() if n == name and a == "plain"}
        ours = {s: done[(name, s, "defaults")] for s in plain if (name, s, "defaults") in done}
        if len(plain) < 2 * k:
            print(f"{name}: {len(plain)} plain run(s); the loop against itself needs {2 * k}")
            continue
        null = np.array([_margin(*equal_epoch_gap([plain[s] for s in a], [plain[s] for s in b]))
                         for a in combinations(plain, k)
                         for b in combinations([s for s in plain if s not in a], k)])  # fmt: skip
        lead = max(float(np.quantile(-null, 1 - LUCK)), 0.0)
        print(f"{name}, {k} seeds a side: the plain loop against itself (seeds "
              f"{sorted(plain)}) flagged in {np.mean(null < 0):.0%} of {len(null)} draws; "
              f"an arm {lead:.1%} ahead at every epoch would be in {LUCK:.0%}")  # fmt: skip
        if len(ours) < k:
            continue
        drawn = [_behind_by(*equal_epoch_gap([plain[s] for s in a], [ours[s] for s in a]))
                 for a in combinations(ours, k)]  # fmt: skip
        per_seed = [np.mean(equal_epoch_gap([plain[s]], [ours[s]])[0]) for s in ours]
        error = np.std(per_seed, ddof=1) / np.sqrt(len(per_seed))
        print(f"  the defaults against it (seeds {sorted(ours)}): flagged in "
              f"{np.mean(drawn):.0%} of {len(drawn)} draws; their gap over every epoch "
              f"and seed {np.mean(per_seed):+.1%} (standard error {error:.1%})")  # fmt: skip


def _margin(gap: list[float], spread: float) -> float:
    """How far the worst epoch stays inside a seed's spread (below 0: behind by more)."""
    return min(gap) + spread


def _behind_by(gap: list[float], spread: float) -> bool:
    return _margin(gap, spread) < 0


def _behind(r: dict) -> bool:
    """Whether the defaults' mean is ever behind the plain loop's by more than a seed's
    spread at an equal epoch."""
    return _behind_by(r["gap"], r["spread"])


def _geo(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.exp(np.mean(np.log(np.maximum(values, 1e-9))))) if values else None


def _most(a: dict) -> bool:
    """Whether an arm reached the plain loop's best on most of a set's seeds."""
    ran, _, of = a["reached"].partition("/")
    return int(ran) > int(of) / 2


def _mean_row(rows: list[dict]) -> dict:
    """A half's means over its sets: accuracies over every set (arithmetic: a refused
    run's 0 stays a 0), speed-ups geometric over the sets that reached on any seed, with
    how many sets it reached on most seeds of (what the targets count), the sets whose
    equal-epoch gap ever exceeds a seed's spread."""
    mean: dict = {"seeds": min(r["seeds"] for r in rows)}
    for arm in ARMS:
        had = [r[arm] for r in rows if arm in r]
        if not had:
            continue
        speeds = [a["speedup"] for a in had if a["speedup"]]
        mean[arm] = {
            "best": float(np.mean([a["best"] for a in had])),
            "final": float(np.mean([a["final"] for a in had])),
            "speedup": _geo(speeds),
            "reached": f"most seeds on {sum(1 for a in had if _most(a))}/{len(had)} sets",
        }
    gapped = [r for r in rows if "gap" in r]
    behind = sum(1 for r in gapped if _behind(r))
    mean["behind"] = f"{behind}/{len(gapped)} sets behind by more than a spread"
    return mean


def markdown(rows: dict) -> None:
    """The table docs/benchmarks.md shows: a row a set, both halves, each half's means
    (_mean_row)."""
    print("| set | half | seeds | plain best / final | defaults best / final | equal epochs: "
          "worst gap (spread) | third: speed-up (reached), best / final | two thirds: "
          "speed-up (reached), best / final |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")

    def pair(r: dict, arm: str) -> str:
        return f"{r[arm]['best']:.1%} / {r[arm]['final']:.1%}" if arm in r else "-"

    def budget(r: dict, arm: str) -> str:
        if arm not in r:
            return "-"
        a = r[arm]
        fast = f"{a['speedup']:.2f}x" if a["speedup"] else "never"
        return f"{fast} ({a['reached']}), {pair(r, arm)}"

    for half, names in (("choose", CHOOSE), ("confirm", CONFIRM)):
        had = [n for n in names if n in rows]
        for name in had:
            r = rows[name]
            worst = "-"
            if "gap" in r:
                e = min(range(len(r["gap"])), key=lambda i: r["gap"][i])
                worst = f"{r['gap'][e]:+.1%} at epoch {e + 1} ({r['spread']:.1%})"
            print(f"| {name} | {half} | {r['seeds']} | {pair(r, 'plain')} | "
                  f"{pair(r, 'defaults')} | {worst} | {budget(r, 'third')} | "
                  f"{budget(r, 'two-thirds')} |")  # fmt: skip
        if had:
            m = _mean_row([rows[n] for n in had])
            print(f"| **{half} half, mean** | {half} | {m['seeds']} | "
                  f"{pair(m, 'plain')} | {pair(m, 'defaults')} | {m['behind']} | "
                  f"{budget(m, 'third')} | {budget(m, 'two-thirds')} |")  # fmt: skip


def machines_apart(rows: list[dict]) -> list[str]:
    """A line for each set whose arms ran on a machine more than DIFFER slower or faster
    than their plain runs (by CALIBRATE's step; rows written before it have none)."""
    plain = {(r["set"], r["seed"]): r["step_ms"] for r in rows
             if r["arm"] == "plain" and r.get("step_ms")}  # fmt: skip
    apart: dict[str, list[float]] = {}
    for r in rows:
        base = plain.get((r["set"], r["seed"]))
        if r["arm"] != "plain" and base and r.get("step_ms"):
            ratio = r["step_ms"] / base
            if max(ratio, 1 / ratio) > DIFFER:
                apart.setdefault(r["set"], []).append(ratio)

    def span(ratios: list[float]) -> str:
        low, high = f"{min(ratios):.2f}", f"{max(ratios):.2f}"
        return f"{low}x" if low == high else f"{low} to {high}x"

    return [
        f"{name}: {len(ratios)} run(s) on a machine {span(ratios)} as slow as their plain "
        "runs' (ResNet-18's step timed before each session): a "
        "budget's share of the plain loop's time held that much fewer (or more) of their "
        "epochs, and their speed-ups carry the difference"
        for name, ratios in sorted(apart.items())
    ]


def report(args) -> None:
    written = _rows(args.results)  # read once: the curves and the machines' steps
    done = curves(written)
    seeds = sorted({seed for _, seed, _ in done})
    print(f"{args.results}: seeds {seeds}; {machine()}")
    for line in machines_apart(written):
        print(f"  machines apart: {line}")
    rows = {name: r for name in (*CHOOSE, *CONFIRM) if (r := _row(name, done, seeds))}
    if args.markdown:
        markdown(rows)
        return
    for half, names in (("choose", CHOOSE), ("confirm", CONFIRM)):
        print(f"\n{half} half: time to the plain loop's best as a speed-up over it "
              "(reached/runs), best / final top-1, means over the seeds")  # fmt: skip
        for name in names:
            if name not in rows:
                print(f"  {name}: not run")
                continue
            r = rows[name]
            cells = []
            for arm in ARMS:
                if arm in r:
                    a = r[arm]
                    fast = "" if arm == "plain" else (
                        f"{a['speedup']:.2f}x ({a['reached']}), " if a["speedup"] else
                        f"never ({a['reached']}), ")  # fmt: skip
                    cells.append(f"{arm} {fast}{a['best']:.1%} / {a['final']:.1%}")
            print(f"  {name} ({r['seeds']} seeds): " + "; ".join(cells))
            if "gap" in r:
                print("    equal epochs, defaults - plain: " + " ".join(
                    f"{g:+.1%}" for g in r["gap"]) + f" (spread {r['spread']:.1%}; "
                    f"{'behind by more' if _behind(r) else 'never behind by more'} than a "
                    "seed's spread)")  # fmt: skip
        speeds = [rows[n][arm]["speedup"] for n in names if n in rows
                  for arm in ("third",) if arm in rows[n] and rows[n][arm]["speedup"]]  # fmt: skip
        ran = sum(1 for n in names if n in rows and "third" in rows[n])
        if speeds:
            print(f"  third reached the loop's best on {len(speeds)} of {ran} sets; the "
                  f"geometric mean of their speed-ups: {np.exp(np.mean(np.log(speeds))):.2f}x")  # fmt: skip
    for half, names in (("choose", CHOOSE), ("confirm", CONFIRM)):
        if had := [rows[n] for n in names if n in rows]:
            print(f"\n{half} half against the targets: " + targets(had))


def targets(rows: list[dict]) -> str:
    """The issue's three targets on a half: a third of the time reaches the plain loop's
    best at least 3x sooner (on most of a set's seeds) on two thirds of the sets; each
    arm's final top-1 at least the loop's; no set behind by more than a seed's spread at
    an equal epoch."""

    def fast(a: dict) -> bool:
        return (a["speedup"] or 0) >= 3 and _most(a)

    third = sum(1 for r in rows if "third" in r and fast(r["third"]))
    finals = [
        f"{arm} {sum(1 for r in rows if arm in r and r[arm]['final'] >= r['plain']['final'])}"
        f"/{sum(1 for r in rows if arm in r)}"
        for arm in ARMS[1:]
    ]
    behind = sum(1 for r in rows if "gap" in r and _behind(r))
    return (
        f"a third of the time reaches the loop's best 3x sooner on {third}/{len(rows)} sets "
        f"(target: two thirds); final at least the loop's on every set ({', '.join(finals)} "
        f"sets); sets behind by more than a seed's spread at an equal epoch: {behind} "
        "(target: none)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("run", "report", "chance"))
    parser.add_argument("--sets", nargs="+", default=[*CHOOSE, *CONFIRM],
                        choices=[*SETS, "digits"])  # fmt: skip
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--epochs", type=int, help="every set's (default: 8, few 50)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("suite-work"))
    parser.add_argument("--results", type=Path, default=Path("suite-results.jsonl"))
    parser.add_argument("--markdown", action="store_true", help="report: the docs' table")
    parser.add_argument("--group", type=int, default=3, help="chance: seeds a side")
    parser.add_argument("--flags", type=shlex.split, default=[],
                        help="run: more paratrain flags for its arms (a variant tried: give it "
                        "its own --results, with the plain runs copied in)")  # fmt: skip
    args = parser.parse_args()
    args.work = args.work.resolve()
    {"run": run, "report": report, "chance": chance}[args.what](args)


if __name__ == "__main__":
    main()
