"""The step's levers, measured side by side on this machine, each case in a fresh process:

* ``memory``: activation checkpointing (--activation-checkpointing: each repeated block
  keeps its input only) against none. Printed per model: the peak memory a training
  step adds above the memory before it (a high-water mark: on a CPU VmHWM, reset
  through /proc/self/clear_refs, with glibc's mmap threshold held so that freed tensors
  leave; on CUDA torch.cuda.max_memory_allocated, reset), what
  `paratrain plan` estimates a step adds (its activations plus the gradients, which
  the step allocates again), and the step's median time; the ratios checkpointed /
  plain. At --batch and at 2x --batch, so the growth with the batch shows.
* ``compile``: --compile-scope blocks (each repeated block compiled in place) against
  model (the whole model) and eager, and on CUDA the whole model under CUDA graphs
  (torch.compile's reduce-overhead mode: shapes are static at a fixed batch): seconds
  to the first step done (compiling included) and the median step after it.

SGD with momentum; fp32 with 2 threads on a CPU, or --device cuda --bf16:

    python benchmarks/step_levers.py memory --models resnet50 vit_b_16 --image-size 224 --batch 8
    python benchmarks/step_levers.py compile --models resnet18 resnet50 --image-size 64 --batch 16
    python benchmarks/step_levers.py compile --device cuda --bf16 --models resnet50 vit_b_16 \
        --image-size 224 --batch 128 --steps 20
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


def _model(name: str, size: int) -> torch.nn.Module:
    import torchvision

    extra = {"image_size": size} if name.startswith("vit") else {}
    return torchvision.models.get_model(name, num_classes=10, **extra)


def _case(name: str, size: int, batch: int, how: str, steps: int, device: str, bf16: bool,
          out) -> None:  # fmt: skip
    import contextlib
    import ctypes

    from paratrain.bench.memory import _status_bytes, tensors_unmapped_when_freed
    from paratrain.parallel import regions

    torch.set_num_threads(2)
    torch.manual_seed(0)
    cuda = device == "cuda"
    if not cuda:
        tensors_unmapped_when_freed()  # the tensors' peak, not malloc's leftovers
    model = _model(name, size).to(device)
    blocks = regions.repeated_blocks(model)
    if how == "checkpointed":
        regions.checkpoint_activations(blocks)
    elif how == "blocks":
        regions.compile_blocks(blocks)
    elif how in ("model", "cudagraphs"):
        model = torch.compile(model, mode="reduce-overhead" if how == "cudagraphs" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    cast = (lambda: torch.autocast(device, torch.bfloat16)) if bf16 else contextlib.nullcontext

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with cast():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()

    start = time.perf_counter()
    step()  # the optimizer's state exists from here on (and, compiled, the graphs)
    first = time.perf_counter() - start
    optimizer.zero_grad(set_to_none=True)  # before: weights and optimizer state, no gradients
    if cuda:
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        before = _status_bytes("VmRSS") or 0
        Path("/proc/self/clear_refs").write_text("5")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    high = torch.cuda.max_memory_allocated() if cuda else (_status_bytes("VmHWM") or 0)
    out.put({"first": first, "step": statistics.median(times), "peak": high - before})


def _run(*args) -> dict:
    context = mp.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=_case, args=(*args, out))
    process.start()
    result = out.get()
    process.join()
    return result


def _estimated(name: str, size: int, batch: int, checkpointed: bool, bf16: bool) -> float:
    """`paratrain plan`'s ddp row: the activations and the gradients a step allocates."""
    from paratrain.bench.memory import estimate

    cast = torch.bfloat16 if bf16 else None
    rows = estimate(_model(name, size), size, batch, 2, 1, autocast=cast, checkpointed=checkpointed)
    row = next(r for r in rows if r.strategy == "ddp")
    return row.activations + row.gradients


def memory(args) -> None:
    print(f"{args.image_size} px, {'bf16' if args.bf16 else 'fp32'}, {args.device}; MiB; "
          "peak: the high-water mark a step adds; estimate: plan's activations + gradients")  # fmt: skip
    print(f"{'model':>10} {'batch':>5} | {'peak plain':>10} {'ckpt':>7} {'ratio':>6} | "
          f"{'estimate plain':>14} {'ckpt':>7} {'ratio':>6} | {'step s plain':>12} "
          f"{'ckpt':>6} {'ratio':>6}")  # fmt: skip
    for name in args.models:
        for batch in (args.batch, 2 * args.batch):
            got = {how: _run(name, args.image_size, batch, how, args.steps, args.device, args.bf16)
                   for how in ("plain", "checkpointed")}  # fmt: skip
            est = {how: _estimated(name, args.image_size, batch, how == "checkpointed", args.bf16)
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
    ways = ("eager", "model", "blocks") + (("cudagraphs",) if args.device == "cuda" else ())
    print(f"{args.image_size} px, batch {args.batch}, {'bf16' if args.bf16 else 'fp32'}, "
          f"inductor on {args.device}; first step s (compiling included) | median step ms")  # fmt: skip
    print(f"{'model':>10} | " + " ".join(f"{w:>10}" for w in ways) + " | "
          + " ".join(f"{w:>10}" for w in ways))  # fmt: skip
    for name in args.models:
        got = {how: _run(name, args.image_size, args.batch, how, args.steps, args.device,
                         args.bf16) for how in ways}  # fmt: skip
        firsts = " ".join(f"{got[w]['first']:>10.1f}" for w in ways)
        steps = " ".join(f"{got[w]['step'] * 1e3:>10.1f}" for w in ways)
        print(f"{name:>10} | {firsts} | {steps}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("memory", "compile"))
    parser.add_argument("--models", nargs="+", default=["resnet50", "vit_b_16"])
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--bf16", action="store_true", help="the forward under bf16 autocast")
    args = parser.parse_args()
    print(machine())
    (memory if args.what == "memory" else compile_)(args)


if __name__ == "__main__":
    main()
