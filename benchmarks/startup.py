"""Time to the first training step: `paratrain train` against the plain loop, side by side.

Two processes on this machine's cores, ResNet-18 at 64 px, batch 16 a process, a folder
of N and of 8N photo-like JPEGs (a fifth to validation), --repeats launches of each arm
alternating, the median of each:

* plain    — benchmarks/plain_ddp.py under torchrun (imports, process group, loaders);
* paratrain — `paratrain train --nproc 2` as it comes: its launcher's checks (the data
              listed once, the run folder, the devices), the workers' (the model), the
              decoded-image cache, the start line;
* fresh    — the same with PARATRAIN_FORK=0: its workers started as new interpreters,
             each importing torch, torchvision and paratrain, where by default (on
             Linux, without CUDA) they are forked from the launcher, which imported
             them once;
* budget   — the same with --budget (a minute): --budget-recipe auto times a few steps on
             synthetic batches, and looks at a few images at both sizes, before it starts.

Each from the launch to the first step: for paratrain its "first step" line, for the
plain loop a line it prints after its first optimizer step (--first-step). The ratio
paratrain / plain is what the start-up costs over the textbook's.

    python benchmarks/startup.py [--n 400] [--repeats 3] [--root /tmp/startup]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _machine import machine  # noqa: E402
from loader_cache import make_jpegs  # noqa: E402
from vs_plain_loop import plain_command  # noqa: E402

SIZE = 64


def folder(root: Path, count: int) -> Path:
    """``count`` JPEGs as root/{train,val}/class_k/*.jpg, written once."""
    data = root / f"n{count}"
    if not (data / "complete").exists():
        pool = make_jpegs(root / f"pool{count}", count, size=(96, 128))
        for index, path in enumerate(sorted(pool.rglob("*.jpg"))):
            side = "val" if index % 5 == 0 else "train"
            target = data / side / path.parent.name / path.name
            target.parent.mkdir(parents=True, exist_ok=True)
            path.rename(target)
        (data / "complete").write_text("")
    return data


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux's /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def until(command: list[str], marker: str, cwd: Path, **env: str) -> float:
    """Seconds from launching ``command`` to a line of its output starting with
    ``marker`` (the run is then stopped, its process group killed)."""
    environ = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env}
    environ.pop("PARATRAIN_STARTED", None)
    start = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=cwd, env=environ, start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(marker):
            seconds = time.time() - start
            for pid in [proc.pid, *descendants(proc.pid)]:  # workers: sessions of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait()
            return seconds
    proc.wait()
    raise RuntimeError(f"no {marker!r} line:\n" + "".join(seen[-20:]))


def arms(data: Path, work: Path, run: int) -> dict[str, tuple[list[str], str, dict]]:
    paratrain = [
        sys.executable, "-m", "paratrain", "train", "--data", str(data), "--image-size",
        str(SIZE), "--batch-size", "16", "--epochs", "1", "--nproc", "2",
        "--output-dir", str(work / "runs"),
    ]  # fmt: skip

    def cache(arm: str) -> dict[str, str]:  # a first start: its own cache to build
        return {"PARATRAIN_CACHE": str(work / "cache" / f"{data.name}-{arm}-{run}")}

    return {
        "plain": (plain_command(data, SIZE, 2, 1, "--first-step"), '{"first_step"', {}),
        "paratrain": (paratrain, "first step", cache("defaults")),
        "fresh": (paratrain, "first step", {**cache("fresh"), "PARATRAIN_FORK": "0"}),
        "budget": ([*paratrain, "--budget", "60s"], "first step", cache("budget")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=400, help="images at the smaller size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", type=Path, default=Path("/tmp/startup"))
    args = parser.parse_args()
    print(f"# {machine()}; 2 processes, ResNet-18 at {SIZE} px; median of {args.repeats}")
    print("| images | plain | paratrain | ratio | workers started afresh | ratio | "
          "with --budget | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for count in (args.n, 8 * args.n):
        data = folder(args.root, count)
        times: dict[str, list[float]] = {"plain": [], "paratrain": [], "fresh": [], "budget": []}
        for run in range(args.repeats):
            for name, (command, marker, env) in arms(data, args.root, run).items():
                times[name].append(until(command, marker, args.root, **env))
        m = {name: statistics.median(values) for name, values in times.items()}
        print(f"| {count} | {m['plain']:.2f} s | {m['paratrain']:.2f} s | "
              f"{m['paratrain'] / m['plain']:.2f}x | {m['fresh']:.2f} s | "
              f"{m['fresh'] / m['plain']:.2f}x | {m['budget']:.2f} s | "
              f"{m['budget'] / m['plain']:.2f}x |", flush=True)  # fmt: skip
        print(
            json.dumps(
                {"images": count, **{k: [round(v, 2) for v in vs] for k, vs in times.items()}}
            )
        )


if __name__ == "__main__":
    main()
