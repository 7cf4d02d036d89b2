"""Autopilot: `--nproc auto`, `--strategy auto`, `--batch-size auto`, `--lr auto`.

Each choice is measured or estimated on the machine it runs on, in this order (each
needs the ones before): processes, strategy, batch, learning rate. Every choice comes
with the reason it was made; the run's config.yaml records the values chosen, so
`--config` on it reruns exactly.

* processes: one per GPU; on a CPU alone, the layout measured faster here: one process
  with every core against N processes sharing them (a few timed steps each, in
  alternating rounds), kept in the cache folder by machine and model, so the next run
  does not measure again, unless the machine was busy, the rounds disagree or the
  layouts lie further apart than the cores allow (then it is measured again next time);
* strategy: the fastest that fits the device memory by `paratrain plan`'s estimate;
* batch: on CUDA the largest per-device batch that trains (doubling, then halving back
  after an out-of-memory, the model freed after each try), on a CPU the largest that the
  estimate fits in the free memory; times a margin, rounded down to a multiple of 8, and
  no more than leaves 16 steps an epoch of the training images; the learning rate
  follows it through --lr-base (linear in the global batch) unless --lr gives the rate;
* learning rate: a range test, an exponential sweep over a few hundred steps on the
  training images on one process; the rate where the smoothed loss falls fastest,
  divided by a safety factor, becomes --lr-base for that batch (--lr-base-size), so that
  it scales with the global batch of the run; its curve is drawn into the run folder.
"""

from __future__ import annotations

import json
import math
import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from paratrain.config import TrainConfig
from paratrain.config.run_dirs import claim_new_name
from paratrain.data.builtin import default_cache_dir
from paratrain.distributed.env import DistEnv
from paratrain.distributed.runtime import runs_on_cuda, usable_cores
from paratrain.engine.prerun.probe import sync
from paratrain.engine.run.step import Stepper, train_step
from paratrain.errors import UserError
from paratrain.files import write_atomic

V = TypeVar("V", int, float, str)
DEFAULT_BATCH = 16  # the batch assumed until --batch-size auto is decided
MARGIN = 0.8  # of the memory the batch may use
SAFETY = 2.0  # the steepest rate of the range test over this
MIN_STEPS = 16  # an epoch has at least this many steps: a batch is no more than its share
RANGE = (1e-6, 10.0)


@dataclass
class Choice(Generic[V]):
    setting: str
    value: V
    why: str

    def line(self) -> str:
        return f"{self.setting} auto -> {self.value}: {self.why}"


# ------------------------------------------------------------------ processes


def decide_nproc(timings: dict[int, float]) -> int:
    """The process count whose layout trained the most images a second (the fewer on
    a tie): ``timings`` maps a process count to its measured images/s."""
    return max(sorted(timings), key=lambda n: (timings[n], -n))


def _machine_key(cfg: TrainConfig) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = usable_cores()
    return f"{cpu}|{cores}|{cfg.model}|{cfg.train_size}|{cfg.batch_size}|{cfg.precision}"


BUSY = 0.25  # of every core's time taken by other programs: a machine too busy to time
ROUNDS = 2  # each layout timed this often, in alternating order (1, N, N, 1)


def measure_layouts(cfg: TrainConfig, cores: int) -> dict[int, list[float]]:
    """Images/s of one process with every core, and of ``cores`` processes of one core
    each, ``ROUNDS`` times in alternating order (so that a load that comes or goes
    weighs on both alike): `paratrain bench`, a few steps, launched as --nproc launches
    its workers."""
    from paratrain.bench.scale import ScaleSettings, _launched

    batch = cfg.batch_size if cfg.batch_size != "auto" else DEFAULT_BATCH
    step = replace(
        cfg,
        nproc=1,
        batch_size=batch,
        image_size=cfg.train_size,
        strategy="ddp",
        lr=None if cfg.lr == "auto" else cfg.lr,
    )
    settings = ScaleSettings(steps=6, warmup=2)
    layouts = sorted({1, cores})
    found: dict[int, list[float]] = {n: [] for n in layouts}
    for round_ in range(ROUNDS):
        for n in layouts if round_ % 2 == 0 else reversed(layouts):
            bench = _launched(n, cores // n, step, settings, sweep=False)["bench"]
            found[n].append(bench["images_per_s"])
    return found


def busy_share(seconds: float = 0.5) -> float:
    """The share of every core's time that other programs took over ``seconds`` (Linux's
    /proc/stat; 0 where it cannot be read)."""
    import time

    def ticks() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    try:
        total, idle = ticks()
        time.sleep(seconds)
        total2, idle2 = ticks()
    except (OSError, ValueError, IndexError):
        return 0.0
    return 1 - (idle2 - idle) / max(total2 - total, 1)


def _why_not_kept(rounds: dict[int, list[float]], load: float, cores: int) -> str | None:
    """Why a measurement is not to be trusted for later runs (None: it is)."""
    if load > BUSY:
        return f"the machine was busy ({load:.0%} of its cores taken by other programs)"
    for n, rates in rounds.items():
        if min(rates) <= 0 or max(rates) > 2 * min(rates):
            return f"{n} process(es) measured {min(rates):.0f} and {max(rates):.0f} img/s"
    return _implausible({n: statistics.median(v) for n, v in rounds.items()}, cores)


def _implausible(timings: dict[int, float], cores: int) -> str | None:
    """One layout far outside the other: N processes on N cores cannot be more than
    about N times one process's speed, nor one process more than N times theirs."""
    low, high = min(timings.values()), max(timings.values())
    if low <= 0 or high > 2 * cores * low:
        return f"{low:.0f} against {high:.0f} img/s is further apart than {cores} cores allow"
    return None


def choose_nproc(
    cfg: TrainConfig,
    measure: Callable[[TrainConfig, int], dict] = measure_layouts,
    load: Callable[[], float] = busy_share,
) -> Choice[int]:
    """One process per GPU; on a CPU alone the layout measured faster, kept for the
    next run where the measurement can be trusted (a quiet machine, rounds that agree)."""
    if runs_on_cuda(cfg.device):
        n = torch.cuda.device_count()
        return Choice("--nproc", n, f"one process per GPU ({n} GPU(s) here)")
    cores = usable_cores()
    if cores < 2:
        return Choice("--nproc", 1, "one core here")
    store = Path(cfg.cache_dir or default_cache_dir()) / "autopilot.json"
    key = _machine_key(cfg)
    known = json.loads(store.read_text()) if store.is_file() else {}
    kept = {int(n): float(v) for n, v in known.get(key, {}).items() if n.isdigit()}
    if len(kept) >= 2 and _implausible(kept, cores) is None:
        timings = kept
        when = known[key].get("when", "earlier")
        measured = f"measured on this machine {when}, kept in {store}: delete it to measure again"
    else:
        busy = load()
        rounds = measure(cfg, cores)
        timings = {n: statistics.median(v) for n, v in rounds.items()}
        distrust = _why_not_kept(rounds, busy, cores)
        measured = f"measured now in {ROUNDS} alternating rounds"
        if distrust is not None:
            measured += f", not kept: {distrust}"
        else:
            entry = {**{str(n): v for n, v in timings.items()}, "when": _today()}
            try:
                store.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(store, json.dumps({**known, key: entry}, indent=1).encode())
                measured += f", kept in {store} for the next run"
            except OSError:
                pass
    n = decide_nproc(timings)
    rates = ", ".join(
        f"{k} x {cores // k} thread(s): {v:.0f} img/s" for k, v in sorted(timings.items())
    )
    return Choice("--nproc", n, f"{rates} ({measured})")


def _today() -> str:
    import datetime

    return datetime.date.today().isoformat()


# ------------------------------------------------------------------ strategy


def device_memory(cfg: TrainConfig, nproc: int) -> tuple[int, str]:
    """The memory one process may use: a GPU's, or this machine's available memory over
    the processes."""
    if runs_on_cuda(cfg.device):
        total = torch.cuda.get_device_properties(0).total_memory
        return total, f"{total / 2**30:.0f} GiB per GPU"
    from paratrain.bench.memory import available_memory

    available = available_memory()
    where = f"{available / 2**30:.1f} GiB available / {nproc} process(es)"
    return available // max(nproc, 1), where


def choose_strategy(
    cfg: TrainConfig, nproc: int, memory: int, where: str, rows: list | None = None
) -> Choice[str]:
    """The fastest strategy that fits ``memory`` by `paratrain plan`'s estimate."""
    from paratrain.bench import memory as plan

    if nproc < 2:
        return Choice("--strategy", "ddp", "one process: the whole model on it")
    rows = rows if rows is not None else _estimate(cfg, nproc)
    choice, why = plan.recommend(rows, memory, nproc)
    if choice is None:
        raise UserError(f"--strategy auto: {why}")
    return Choice("--strategy", choice, f"fits {where}: {why}")


def _estimate(cfg: TrainConfig, devices: int, batch: int | None = None) -> list:
    from paratrain.bench import memory as plan
    from paratrain.models.registry import create_model
    from paratrain.parallel.partition import optimizer_slots

    torch.manual_seed(0)
    model = create_model(cfg.model, 10, cfg.train_size)
    batch = batch or (cfg.batch_size if cfg.batch_size != "auto" else DEFAULT_BATCH)
    return plan.estimate(
        model,
        cfg.train_size,
        batch,
        max(devices, 2),
        optimizer_slots(cfg.opt, cfg.momentum),
        cfg.microbatches,
        cfg.schedule,
        model_name=cfg.model,
        teacher=plan.teacher_of(cfg, 10),
        checkpointed=cfg.activation_checkpointing,
        averaged=plan.wants_average(cfg),
        threads=plan.cpu_threads(cfg, devices),
    )


# ------------------------------------------------------------------ batch


def round_batch(batch: float) -> int:
    """Down to a multiple of 8 (at least 8)."""
    return max(8, int(batch) // 8 * 8)


def batch_from_estimate(fixed: float, per_sample: float, memory: int) -> int:
    """The largest batch whose estimated memory (``fixed`` + ``per_sample`` x batch) fits
    the margin of ``memory``; a multiple of 8."""
    room = memory * MARGIN - fixed
    if room < 8 * per_sample:
        return 8
    return round_batch(room / per_sample)


def largest_batch_that_trains(
    try_batch: Callable[[int], None], start: int = 8, limit: int = 4096
) -> int:
    """Doubling from ``start`` while ``try_batch(b)`` trains, then between the last that
    did and the first that ran out of memory; the largest that trained."""
    good, bad = 0, None
    batch = start
    while batch <= limit:
        if _fits(try_batch, batch):
            good, batch = batch, batch * 2
        else:
            bad = batch
            break
    if good == 0:
        raise UserError(f"--batch-size auto: not even a batch of {start} fits on the device")
    if bad is not None:
        low, high = good, bad
        while high - low > 8:
            middle = round_batch((low + high) // 2)
            if middle <= low:
                break
            if _fits(try_batch, middle):
                low = middle
            else:
                high = middle
        good = low
    return good


def _fits(try_batch: Callable[[int], None], batch: int) -> bool:
    try:
        try_batch(batch)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def choose_batch(
    cfg: TrainConfig, strategy: str, nproc: int, memory: int, where: str
) -> Choice[int]:
    """The largest per-device batch that fits the memory, with a margin; a multiple of 8."""
    if runs_on_cuda(cfg.device):
        found = largest_batch_that_trains(lambda b: _cuda_step(cfg, b))
        batch = round_batch(found * MARGIN)
        why = f"{found} trained on the GPU, {MARGIN:.0%} of it kept as a margin"
        return Choice("--batch-size", batch, why)
    rows = {r.strategy: r for r in _estimate(cfg, nproc, batch=DEFAULT_BATCH)}
    row = rows[strategy if strategy in rows else "ddp"]
    per_sample = row.activations / DEFAULT_BATCH
    fixed = row.fixed
    batch = batch_from_estimate(fixed, per_sample, memory)
    batch = min(batch, 1024)
    why = (
        f"the estimate: {fixed / 2**20:.0f} MiB of weights and state, "
        f"{per_sample / 2**20:.1f} MiB of activations an image, within {MARGIN:.0%} of {where}"
    )
    return Choice("--batch-size", batch, why)


def _data_cap(cfg: TrainConfig) -> int:
    """The largest batch that leaves MIN_STEPS steps an epoch of the training images."""
    from paratrain.data.loaders import read_split
    from paratrain.parallel.base import get as strategy_of

    images = len(read_split(cfg).train)
    replicas = strategy_of(cfg.strategy).layout(cfg, cfg.processes).dp_size
    return round_batch(images / (max(replicas, 1) * MIN_STEPS * cfg.grad_accum))


def _cuda_step(cfg: TrainConfig, batch: int) -> None:
    """One training step at ``batch`` on the GPU, the training loop's own (engine/run/step.py),
    on a model of its own, freed after."""
    device = torch.device("cuda", torch.cuda.current_device())
    stepper = _one_process_stepper(replace(cfg, batch_size=batch), device, classes=10)
    images = torch.randn(batch, 3, cfg.train_size, cfg.train_size, device=device)
    labels = torch.randint(0, 10, (batch,), device=device)
    try:
        train_step(stepper, [(images, labels)], 1)
        sync(device)
    finally:
        del stepper


def _one_process_stepper(cfg: TrainConfig, device: torch.device, classes: int) -> Stepper:
    """The run's model, optimizer and recipe in this one process on ``device``."""
    from paratrain.distributed.env import DistEnv
    from paratrain.distributed.runtime import Runtime
    from paratrain.engine.prerun.probe import stepper_for
    from paratrain.models.registry import build_model
    from paratrain.parallel.parts import ModelParts, memory_format_for

    runtime = Runtime(env=DistEnv(), device=device, backend=None)  # world size 1
    model = build_model(cfg, classes)
    fmt = memory_format_for(model, cfg.memory_format, device)
    parts = ModelParts([model.to(device).to(memory_format=fmt)], memory_format=fmt)
    return stepper_for(cfg, parts, runtime, classes)


# ------------------------------------------------------------------ learning rate


def smooth(losses: Sequence[float], half: int | None = None) -> list[float]:
    """A centred moving average (the sweep is over, so no lag: an average that trails,
    as during training, would move the steepest point to higher rates)."""
    half = half if half is not None else max(1, len(losses) // 40)
    out = []
    for i in range(len(losses)):
        window = losses[max(0, i - half) : i + half + 1]
        out.append(sum(window) / len(window))
    return out


def pick_lr(
    lrs: Sequence[float], losses: Sequence[float], safety: float = SAFETY
) -> tuple[float, float]:
    """(chosen rate, steepest rate): where the smoothed loss falls fastest against the
    log of the rate, and that over ``safety``. Points after the loss blew up (4x its
    minimum) are not read."""
    smoothed = smooth(losses)
    best = math.inf
    end = len(smoothed)
    for i, loss in enumerate(smoothed):
        if not math.isfinite(loss) or loss > 4 * best:
            end = i
            break
        best = min(best, loss)
    logs = [math.log(lr) for lr in lrs[:end]]
    window = max(1, end // 20)
    slopes = [
        (smoothed[i + window] - smoothed[i - window]) / (logs[i + window] - logs[i - window])
        for i in range(window, end - window)
    ]
    if not slopes:
        raise UserError("--lr auto: the range test ended before the loss fell")
    steepest = lrs[window + min(range(len(slopes)), key=slopes.__getitem__)]
    return steepest / safety, steepest


def range_test(cfg: TrainConfig, steps: int, plot: Path | None, say) -> Choice[float]:
    """The sweep on this process: the run's model, optimizer, recipe and images, one
    step (engine/run/step.py) at a time, the rate from RANGE[0] to RANGE[1] exponentially over
    ``steps`` steps (seeded: repeatable)."""
    from torch.utils.data import DataLoader

    from paratrain.data.loaders import read_split
    from paratrain.data.samplers import TrainBatches, train_sampler
    from paratrain.data.transforms import Augment, DecodedSamples, TrainAugment, batched

    split = read_split(cfg)
    sweep = replace(cfg, lr=1.0, nproc=1, ema_decay=None)
    torch.manual_seed(cfg.seed)
    stepper = _one_process_stepper(sweep, torch.device("cpu"), len(split.classes))
    data = DecodedSamples(split.train, TrainAugment(Augment.of(cfg)))
    order = train_sampler(split.train.labels, 0, 1, cfg.seed)  # shuffled, each its own seed
    loader = DataLoader(data, batch_sampler=TrainBatches(order, cfg.batch), collate_fn=batched)
    lrs, losses = [], []
    ratio = (RANGE[1] / RANGE[0]) ** (1 / max(steps - 1, 1))
    batches = iter(loader)
    stepper.parts.train()
    for step in range(steps):
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        lr = RANGE[0] * ratio**step
        for group in stepper.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        result = train_step(stepper, [batch], 1)
        lrs.append(lr)
        losses.append(float(result.sums[0] / result.sums[2]))
        if not math.isfinite(losses[-1]) or losses[-1] > 4 * min(losses):
            break
    chosen, steepest = pick_lr(lrs, losses)
    if plot is not None:
        _plot(lrs, losses, steepest, chosen, plot)
    why = (
        f"range test over {len(lrs)} steps: the loss falls fastest at {steepest:.3g}, "
        f"divided by {SAFETY:g}, for a global batch of {cfg.batch} (--lr-base-size), scaled "
        "with the run's" + (f"; curve in {plot}" if plot else "")
    )
    return Choice("--lr", float(f"{chosen:.3g}"), why)


def _plot(lrs, losses, steepest: float, chosen: float, path: Path) -> None:
    from paratrain.report.plots import new_figure

    fig = new_figure(figsize=(6, 3.6))
    ax = fig.subplots()
    ax.plot(lrs, losses, alpha=0.4, label="loss")
    ax.plot(lrs, smooth(losses), label="smoothed")
    ax.axvline(steepest, color="tab:red", linestyle="--", label=f"steepest {steepest:.3g}")
    ax.axvline(chosen, color="tab:green", label=f"chosen {chosen:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


# ------------------------------------------------------------------ all together


def choose(
    cfg: TrainConfig, env: DistEnv, dry_run: bool, say: Callable[[str], object]
) -> tuple[TrainConfig, list[str]]:
    """Every auto setting of a run made a value, each told with its reason, the result
    checked as the values would have been (the config unchanged where none is auto)."""
    from paratrain.engine.prerun import preflight

    if not cfg.has_auto():
        return cfg, []
    if env.source != "single":
        raise UserError(
            "auto settings are chosen by `paratrain train` itself, before it starts its "
            "processes; under torchrun or srun give values (a run's config.yaml has them)"
        )
    if cfg.resume:
        raise UserError(
            "a resumed run continues with the values its config.yaml recorded: give them, "
            "not auto (--config <run>/config.yaml)"
        )
    if not dry_run and not cfg.name:  # the range test's curve goes into the run folder
        cfg = replace(cfg, name=claim_new_name(Path(cfg.output_dir)))
    plot_dir = None if dry_run else Path(cfg.output_dir) / str(cfg.name)
    cfg, choices = resolve(cfg, say=say, plot_dir=plot_dir)
    for choice in choices:
        say(choice.line())
    world = preflight.job_world(cfg, env)
    preflight.check_settings(cfg, world)
    preflight.check_devices(cfg, world)
    return cfg, [choice.line() for choice in choices]


def resolve(
    cfg: TrainConfig, say=print, plot_dir: Path | None = None, range_steps: int | None = None
) -> tuple[TrainConfig, list[Choice]]:
    """Every auto setting made a value, in order (each needs the ones before)."""
    choices: list[Choice[Any]] = []
    if cfg.nproc == "auto":
        processes = choose_nproc(cfg)
        choices.append(processes)
        cfg = replace(cfg, nproc=processes.value)
    memory, where = device_memory(cfg, cfg.processes)
    if cfg.strategy == "auto":
        strategy = choose_strategy(cfg, cfg.processes, memory, where)
        choices.append(strategy)
        cfg = replace(cfg, strategy=strategy.value)
    if cfg.batch_size == "auto":
        batch = choose_batch(cfg, cfg.strategy, cfg.processes, memory, where)
        cap = _data_cap(cfg)
        if batch.value > cap:
            batch = Choice(
                "--batch-size",
                cap,
                f"{batch.why}; {batch.value} would leave "
                f"fewer than {MIN_STEPS} steps an epoch of these images, so {cap}",
            )
        choices.append(batch)
        cfg = replace(cfg, batch_size=batch.value)
    if cfg.lr == "auto":
        steps = range_steps or 200
        plot = plot_dir / "lr_range.png" if plot_dir is not None else None
        found = range_test(cfg, steps, plot, say)
        choices.append(found)
        # found on one process at this batch: the run's rate scales with its global batch
        cfg = replace(cfg, lr=None, lr_base=found.value, lr_base_size=cfg.batch)
    return cfg.validate(), choices
