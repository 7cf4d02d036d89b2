"""--budget against the clock: the command's wall time at each budget, on a quiet machine
and with other processes keeping every core busy.

    python benchmarks/budget_wall.py --budgets 30 120 600 [--loads quiet busy]
        [--data DIR] [-- extra train flags]

Each run is `paratrain train --nproc 2 --budget Ns` (the embedded digits unless --data),
timed from before the command starts to its exit, as a user's clock counts it. Reported
per run: the wall time, its distance from the budget and whether it is within the
target (5% of the budget or 3 s, whichever is larger), the epoch counter's totals as
the lines showed them (they change only when the plan does), and the best top-1. The
busy load is one spinning process per core, started before the command and stopped
after it.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def spinners(count: int) -> list[subprocess.Popen]:
    """``count`` processes that keep a core each busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def one_run(budget: int, load: str, data: str | None, extra: list[str], out: Path) -> dict:
    args = [sys.executable, "-m", "paratrain", "train", "--nproc", "2", "--budget", f"{budget}s"]
    args += ["--output-dir", str(out), "--name", f"{load}-{budget}"]
    if data:
        args += ["--data", data]
    load_procs = spinners(os.cpu_count() or 2) if load == "busy" else []
    try:
        start = time.perf_counter()
        done = subprocess.run(args + extra, capture_output=True, text=True)
        wall = time.perf_counter() - start
    finally:
        for proc in load_procs:
            proc.kill()
            proc.wait()
    if done.returncode != 0:
        raise SystemExit(f"budget {budget}s ({load}) failed:\n{done.stderr[-2000:]}")
    totals = [int(t) for t in re.findall(r"^epoch \d+/(\d+) ", done.stdout, flags=re.M)]
    changes = sum(1 for a, b in zip(totals, totals[1:], strict=False) if a != b)
    best = re.search(r"best val \w+ ([0-9.]+)%", done.stdout)
    said = re.search(r"done in ([0-9.]+)s", done.stdout)
    return {
        "budget": budget,
        "load": load,
        "wall": wall,
        "said": float(said.group(1)) if said else None,
        "off": wall - budget,
        "within": abs(wall - budget) <= max(0.05 * budget, 3.0),
        "epochs": len(totals),
        "first_total": totals[0] if totals else None,
        "changes": changes,
        "best": float(best.group(1)) if best else None,
        "probe": "timing took" in done.stdout,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", type=int, nargs="+", default=[30, 120, 600])
    parser.add_argument("--loads", nargs="+", default=["quiet", "busy"])
    parser.add_argument("--data", default=None)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    cpu = "AMX" if "amx_bf16" in Path("/proc/cpuinfo").read_text() else "no AMX"
    print(f"{os.cpu_count()} cores ({cpu}); data: {args.data or 'the embedded digits'}")
    print(
        "| budget | load | wall | off by | within 5% or 3 s | 'done in' | epochs | "
        "first total, changes | best top-1 |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for budget in args.budgets:
            for load in args.loads:
                r = one_run(budget, load, args.data, extra, Path(tmp))
                print(
                    f"| {budget} s | {load} | {r['wall']:.1f} s | {r['off']:+.1f} s "
                    f"({100 * r['off'] / budget:+.1f}%) | {'yes' if r['within'] else 'NO'} | "
                    f"{r['said']} s | {r['epochs']} | {r['first_total']}, {r['changes']} | "
                    f"{r['best']}% |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
