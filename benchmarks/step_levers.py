"""The step's levers, measured side by side on this machine, each case in a fresh process:

* ``memory``: activation checkpointing (--activation-checkpointing: each repeated block
  keeps its input only) against none. Printed per model: the peak resident memory a
  training step adds (VmHWM above the memory before it, reset through
  /proc/self/clear_refs: a high-water mark), `paratrain plan`'s estimate of the
  activations each way, and the step's median time; the ratios checkpointed / plain.
  At --batch and at 2x --batch, so the growth with the batch shows.
* ``compile``: --compile-scope blocks (each repeated block compiled in place) against
  model (the whole model) and eager: seconds to the first step done (compiling
  included) and the median step after it.

fp32, SGD with momentum, 2 threads:

    python benchmarks/step_levers.py memory --models resnet50 vit_b_16 --image-size 224 --batch 8
    python benchmarks/step_levers.py compile --models resnet18 resnet50 --image-size 64 --batch 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from _machine import machine  # noqa: E402


def _case(name: str, size: int, batch: int, how: str, steps: int, out) -> None:
    import ctypes

    import torchvision

    from paratrain.bench.memory import _status_bytes
    from paratrain.parallel import regions

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = torchvision.models.get_model(name, num_classes=10, image_size=size) if name.startswith(
        "vit") else torchvision.models.get_model(name, num_classes=10)  # fmt: skip
    blocks = regions.repeated_blocks(model)
    if how == "checkpointed":
        regions.checkpoint_activations(blocks)
    elif how == "blocks":
        regions.compile_blocks(blocks)
    elif how == "model":
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    start = time.perf_counter()
    step()  # the optimizer's state exists from here on (and, compiled, the graphs)
    first = time.perf_counter() - start
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status_bytes("VmRSS") or 0
    Path("/proc/self/clear_refs").write_text("5")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = (_status_bytes("VmHWM") or 0) - before
    out.put({"first": first, "step": statistics.median(times), "peak": peak})


def _run(*args) -> dict:
    context = mp.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=_case, args=(*args, out))
    process.start()
    result = out.get()
    process.join()
    return result


def _estimated(name: str, size: int, batch: int, checkpointed: bool) -> float:
    import torchvision

    from paratrain.bench.memory import estimate

    model = torchvision.models.get_model(name, num_classes=10, image_size=size) if name.startswith(
        "vit") else torchvision.models.get_model(name, num_classes=10)  # fmt: skip
    rows = estimate(model, size, batch, 2, 1, checkpointed=checkpointed)
    return next(r.activations for r in rows if r.strategy == "ddp")


def memory(args) -> None:
    print(f"{args.image_size} px, fp32; MiB; peak: measured high-water mark a step adds")
    print(f"{'model':>10} {'batch':>5} | {'peak plain':>10} {'ckpt':>7} {'ratio':>6} | "
          f"{'estimate plain':>14} {'ckpt':>7} {'ratio':>6} | {'step s plain':>12} "
          f"{'ckpt':>6} {'ratio':>6}")  # fmt: skip
    for name in args.models:
        for batch in (args.batch, 2 * args.batch):
            got = {how: _run(name, args.image_size, batch, how, args.steps)
                   for how in ("plain", "checkpointed")}  # fmt: skip
            est = {how: _estimated(name, args.image_size, batch, how == "checkpointed")
                   for how in ("plain", "checkpointed")}  # fmt: skip
            p, c = got["plain"], got["checkpointed"]
            mib = 2**20
            print(
                f"{name:>10} {batch:>5} | {p['peak'] / mib:>10.0f} {c['peak'] / mib:>7.0f} "
                f"{c['peak'] / p['peak']:>6.2f} | {est['plain'] / mib:>14.0f} "
                f"{est['checkpointed'] / mib:>7.0f} {est['checkpointed'] / est['plain']:>6.2f} | "
                f"{p['step']:>12.3f} {c['step']:>6.3f} {c['step'] / p['step']:>6.2f}"
            )


def compile_(args) -> None:
    print(f"{args.image_size} px, batch {args.batch}, fp32, inductor on the CPU")
    print(f"{'model':>10} | {'first step s: eager':>19} {'model':>7} {'blocks':>7} | "
          f"{'step ms: eager':>14} {'model':>7} {'blocks':>7}")  # fmt: skip
    for name in args.models:
        got = {how: _run(name, args.image_size, args.batch, how, args.steps)
               for how in ("eager", "model", "blocks")}  # fmt: skip
        print(
            f"{name:>10} | {got['eager']['first']:>19.1f} {got['model']['first']:>7.1f} "
            f"{got['blocks']['first']:>7.1f} | {got['eager']['step'] * 1e3:>14.0f} "
            f"{got['model']['step'] * 1e3:>7.0f} {got['blocks']['step'] * 1e3:>7.0f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("memory", "compile"))
    parser.add_argument("--models", nargs="+", default=["resnet50", "vit_b_16"])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(machine())
    (memory if args.what == "memory" else compile_)(args)


if __name__ == "__main__":
    main()
