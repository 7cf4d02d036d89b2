"""`paratrain scale`: measure the training step at 1..N processes, fit the link, predict.

Weak scaling: every process keeps the same batch. Two series are measured:

- *same threads per process* (cores / N_max threads each, at every N): each process is a
  "device" of fixed speed, which is what the cost model describes and what adding GPUs
  does;
- *same total cores* (cores / N threads each): what a user gains on this fixed machine.

The single-process runs happen in this process; N >= 2 through the same launcher as
`--nproc` (torch's elastic agent), each worker running `paratrain bench` and, in the
same-threads series, an all-reduce sweep over message sizes. The sweep fits alpha and
beta; the profile of one process's step (when each gradient is ready in backward) places
DDP's buckets; together they predict every N and are compared with what was measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from paratrain.bench import costmodel
from paratrain.config import STEP_SETTINGS, BenchOptions, ScaleOptions, TrainConfig, to_argv
from paratrain.distributed.runtime import usable_cores
from paratrain.errors import UserError

SAME_THREADS = "same threads per process"
SAME_CORES = "same total cores"


@dataclass
class ScaleSettings:
    """`paratrain scale`'s options as the measurement uses them (links resolved)."""

    nproc_max: int = 2
    steps: int = 10
    warmup: int = 3
    largest_message: int = 256 * 2**20
    link: costmodel.Link | None = None  # None: the link fitted here
    gpus_per_node: int | None = None
    intra_link: costmodel.Link = field(default_factory=lambda: costmodel.PRESETS["nvlink4"])
    epoch_images: int = 10_000
    max_n: int = 1024


def settings_from(opts: ScaleOptions) -> ScaleSettings:
    """The measurement's settings from the command's options: the processes to go up
    to (default: the CUDA devices, else the cores), the links named or given."""
    nproc_max = opts.nproc_max
    if nproc_max is None:
        import torch

        nproc_max = torch.cuda.device_count() or usable_cores()
    link = costmodel.PRESETS[opts.link] if opts.link else None
    if opts.bandwidth is not None and opts.latency is not None:  # given together (checked)
        link = costmodel.Link("given", opts.bandwidth, opts.latency)
    return ScaleSettings(
        nproc_max=nproc_max,
        steps=opts.steps,
        warmup=opts.warmup,
        largest_message=max(4096, int(opts.max_message_mb * 2**20)),
        link=link,
        gpus_per_node=opts.gpus_per_node,
        intra_link=costmodel.PRESETS[opts.intra_link],
        epoch_images=opts.epoch_images,
        max_n=opts.max_n,
    )


@dataclass
class Measured:
    n: int
    threads: int
    series: str
    step_ms: float
    compute_ms: float  # the same step under no_sync: what N processes do to each other
    communication_ms: float
    images_per_s: float
    speedup: float = 1.0
    efficiency: float = 1.0


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _bench_argv(cfg: TrainConfig, opts: ScaleSettings, result_file: Path, sweep: bool) -> list[str]:
    """`paratrain bench` with this step's settings, writing its result to ``result_file``."""
    bench = BenchOptions(
        steps=opts.steps,
        warmup=opts.warmup,
        result_file=str(result_file),
        sweep_bytes=opts.largest_message if sweep else 0,
    )
    return ["bench", *to_argv(cfg, STEP_SETTINGS), *to_argv(bench)]


def _launched(n: int, threads: int, cfg: TrainConfig, opts: ScaleSettings, sweep: bool) -> dict:
    from paratrain.distributed.launch import launch

    with tempfile.TemporaryDirectory(prefix="paratrain-scale-") as tmp:
        result_file = Path(tmp) / "result.json"
        with _environ(PARATRAIN_THREADS=str(threads), OMP_NUM_THREADS=str(threads)):
            code = launch(n, _bench_argv(cfg, opts, result_file, sweep))
        if code or not result_file.exists():
            raise UserError(
                f"the run at {n} processes failed (exit code {code}); "
                f"`paratrain bench --nproc {n}` with the same flags shows why"
            )
        return json.loads(result_file.read_text())


def measure(
    cfg: TrainConfig, opts: ScaleSettings, say: Callable[[str], object] = print
) -> tuple[costmodel.StepProfile, list[Measured], list[tuple[int, int, float]]]:
    """Run every measurement; returns (profile, measured rows, all-reduce samples)."""
    import torch

    from paratrain.bench.speed import gradient_order, run_bench
    from paratrain.distributed.env import detect
    from paratrain.distributed.runtime import distributed

    cores = usable_cores()
    same = max(1, cores // opts.nproc_max)
    rows: list[Measured] = []
    samples: list[tuple[int, int, float]] = []
    saved_threads = torch.get_num_threads()
    with distributed(detect({}), cfg.device) as runtime:
        torch.set_num_threads(same)
        say(f"profiling 1 process x {same} thread(s) ...")
        order = gradient_order(cfg, runtime, opts.steps, opts.warmup)  # also warms this process up
        for threads in sorted({same, cores}):
            torch.set_num_threads(threads)
            say(f"measuring 1 process x {threads} thread(s) ...")
            timed = run_bench(cfg, runtime, opts.steps, opts.warmup)
            assert timed is not None  # one process: it is rank 0
            result = asdict(timed)
            if threads == same:
                backward = result["backward_ms"] / 1000
                profile = costmodel.StepProfile(
                    (result["data_ms"] + result["forward_ms"]) / 1000,
                    backward,
                    result["optimizer_ms"] / 1000,
                    [(f * backward, b) for f, b in order],
                )
            rows += [_row(result, threads, series) for series in _series(threads, same, cores)]
    torch.set_num_threads(saved_threads)
    for n in range(2, opts.nproc_max + 1):
        per_process = max(1, cores // n)
        for threads in sorted({same, per_process}):
            say(f"measuring {n} processes x {threads} thread(s) ...")
            out = _launched(n, threads, cfg, opts, sweep=threads == same)
            samples += [tuple(s) for s in out.get("all_reduce") or []]
            rows += [
                _row(out["bench"], threads, series)
                for series in _series(threads, same, per_process)
            ]
    for series in (SAME_THREADS, SAME_CORES):
        base = next(r for r in rows if r.series == series and r.n == 1)
        for r in rows:
            if r.series == series:
                r.speedup = r.images_per_s / base.images_per_s
                r.efficiency = r.speedup / r.n
    return profile, rows, samples


def _series(threads: int, same: int, sharing: int) -> list[str]:
    """Which series a run with ``threads`` per process counts for (one run can serve both)."""
    return [SAME_THREADS] * (threads == same) + [SAME_CORES] * (threads == sharing)


def _row(result: dict, threads: int, series: str) -> Measured:
    return Measured(
        result["world_size"],
        threads,
        series,
        result["step_ms"],
        result["no_sync_step_ms"],
        result["communication_ms"],
        result["images_per_s"],
    )


def report(
    cfg: TrainConfig,
    opts: ScaleSettings,
    profile: costmodel.StepProfile,
    rows: list[Measured],
    samples: list[tuple[int, int, float]],
) -> dict:
    """Everything `paratrain scale` found, as the JSON it writes."""
    fit = costmodel.fit_alpha_beta(samples) if samples else None
    link = opts.link or (fit.link() if fit else None)
    if link is None:
        raise UserError(
            "no all-reduce was measured (--nproc-max 1): give --link or "
            "--bandwidth and --latency to predict"
        )
    network = costmodel.Network(
        link, opts.gpus_per_node, opts.intra_link if opts.gpus_per_node else None
    )

    def predicted(ns, net):
        return costmodel.predict(
            profile, ns, net, cfg.batch_size, cfg.bucket_cap_mb, opts.epoch_images
        )

    comparison = _comparison(cfg, profile, rows, fit)
    ns = costmodel.powers_of_two(opts.max_n, also=[r.n for r in rows])
    presets = {
        name: _preset_efficiency(preset, opts, predicted)
        for name, preset in costmodel.PRESETS.items()
    }
    return {
        "model": cfg.model,
        "image_size": cfg.image_size,
        "batch_size": cfg.batch_size,
        "precision": cfg.precision,
        "cores": usable_cores(),
        "nproc_max": opts.nproc_max,
        "epoch_images": opts.epoch_images,
        "profile": {
            "data_forward_ms": 1000 * profile.before_backward_s,
            "backward_ms": 1000 * profile.backward_s,
            "optimizer_ms": 1000 * profile.after_backward_s,
            "gradient_mb": profile.gradient_bytes / 2**20,
            "buckets": len(costmodel.ddp_buckets(profile.gradients, cfg.bucket_cap_mb * 2**20)),
        },
        "measured": [asdict(r) for r in rows],
        "all_reduce": {
            "samples": [list(s) for s in samples],
            "alpha_us": fit.alpha_s * 1e6 if fit else None,
            "beta_gbps": fit.beta_bps / 1e9 if fit else None,
            "rms_error_pct": 100 * fit.rms_error if fit else None,
            "max_error_pct": 100 * fit.max_error if fit else None,
        },
        "comparison": comparison,
        "network": network.describe(),
        "predicted": [asdict(p) for p in predicted(ns, network)],
        "presets": presets,
    }


def _comparison(
    cfg: TrainConfig,
    profile: costmodel.StepProfile,
    rows: list[Measured],
    fit: costmodel.LinkFit | None,
) -> list[dict]:
    """Predicted beside each measurement."""
    # Beside each measurement: that N's own compute (its no_sync step: processes sharing
    # a machine slow each other down, which no link model knows) plus the modelled
    # communication, overlapped with backward bucket by bucket, on the link fitted here.
    comparison: list[dict] = []
    if fit:
        here = costmodel.Network(fit.link())
        alone = 1000 * profile.compute_s
        for r in rows:
            if r.series == SAME_THREADS:
                p = costmodel.predict(
                    profile.scaled(r.compute_ms / alone),
                    [r.n],
                    here,
                    cfg.batch,
                    cfg.bucket_cap_mb,
                )[0]
                pure = costmodel.predict(profile, [r.n], here, cfg.batch, cfg.bucket_cap_mb)[0]
                comparison.append(
                    {
                        "n": r.n,
                        "measured_ms": r.step_ms,
                        "compute_ms": r.compute_ms,
                        "predicted_ms": 1000 * p.step_s,
                        "from_one_process_ms": 1000 * pure.step_s,
                        "from_one_process_error_pct": 100
                        * (1000 * pure.step_s - r.step_ms)
                        / r.step_ms,
                        "communication_ms": 1000 * p.communication_s,
                        "exposed_ms": 1000 * p.exposed_s,
                        "error_pct": 100 * (1000 * p.step_s - r.step_ms) / r.step_ms,
                    }
                )
    return comparison


def _preset_efficiency(preset, opts: ScaleSettings, predicted) -> dict:
    """One link preset's figures and efficiency at 8, 64 and the largest N."""
    net = costmodel.Network(
        preset, opts.gpus_per_node, opts.intra_link if opts.gpus_per_node else None
    )
    at = {p.n: p for p in predicted([8, 64, opts.max_n], net)}
    return {
        "bandwidth_gbps": preset.bandwidth_gbps,
        "latency_us": preset.latency_us,
        "note": preset.note,
        "efficiency": {str(n): at[n].efficiency for n in sorted(at)},
    }


def calibration_report(calibration: costmodel.Calibration, max_n: int) -> dict:
    """What `scale --calibrate` writes: the fit of the user's epoch times and its extrapolation to ``max_n``."""
    ns = costmodel.powers_of_two(max_n, also=[n for n, _ in calibration.measured])
    base = calibration.epoch_s(1)
    measured_base = dict(calibration.measured).get(1, base)
    return {
        "calibration": {
            "fixed_s": calibration.fixed_s,
            "compute_s": calibration.compute_s,
            "communication_s": calibration.communication_s,
            "speedup_limit": calibration.speedup_limit(),
            "points": [
                {
                    "n": n,
                    "measured_s": t,
                    "fitted_s": calibration.epoch_s(n),
                    "speedup": measured_base / t,
                    "error_pct": 100 * e,
                    "communication_share": calibration.communication_share(n),
                    "fixed_share": calibration.fixed_share(n),
                }
                for (n, t), e in zip(calibration.measured, calibration.errors(), strict=True)
            ],
        },
        "predicted": [
            {
                "n": n,
                "epoch_s": calibration.epoch_s(n),
                "speedup": base / calibration.epoch_s(n),
                "efficiency": base / calibration.epoch_s(n) / n,
                "communication_share": calibration.communication_share(n),
            }
            for n in ns
        ],
    }


def read_epoch_times(path: Path) -> list[tuple[int, float]]:
    """CSV of `n,seconds` lines; a header line and `#` comments are allowed."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise UserError(f"--calibrate {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise UserError(f"--calibrate {path}: not a text file of 'n,seconds' lines") from None
    points: list[tuple[int, float]] = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        cells = [c.strip() for c in line.split(",")]
        try:
            n, seconds = int(cells[0]), float(cells[1])
            if len(cells) != 2 or n < 1 or not seconds > 0:
                raise ValueError
        except (ValueError, IndexError):
            if not points and number == 1 and not cells[0].isdigit():
                continue  # a header
            raise UserError(
                f"--calibrate {path} line {number}: expected 'n,seconds' with n >= 1 "
                f"and seconds > 0, got {line!r}"
            ) from None
        points.append((n, seconds))
    if len({n for n, _ in points}) < 3:
        raise UserError(
            f"--calibrate {path}: needs epoch times at 3 or more different N, "
            f"found {len({n for n, _ in points})}"
        )
    return points


def run_scale(cfg: TrainConfig, opts: ScaleOptions, say: Callable[[str], object]) -> dict | None:
    """`paratrain scale`: measure here (or fit ``opts.calibrate``), predict, write the
    report under ``opts.out``, say it; None for a dry run."""
    from paratrain.bench import costmodel
    from paratrain.engine.prerun import preflight
    from paratrain.report.scaling import format_calibration, format_measured, write_report

    if opts.calibrate is not None:
        points = read_epoch_times(Path(opts.calibrate))
        if opts.dry_run:
            say(f"would fit {len(points)} epoch times from {opts.calibrate}")
            return None
        result = calibration_report(costmodel.calibrate(points), opts.max_n)
        text = format_calibration(result, str(opts.calibrate))
    else:
        preflight.check_devices(cfg, 1)
        settings = settings_from(opts)
        preflight.check_model_input(cfg, 1)  # scale measures one process too
        if opts.dry_run:
            say(
                f"would measure {cfg.model} at {cfg.image_size}px on 1..{settings.nproc_max} "
                f"processes and write {opts.out}"
            )
            return None
        profile, rows, samples = measure(cfg, settings, say=say)
        result = report(cfg, settings, profile, rows, samples)
        text = format_measured(result)
    paths = write_report(result, Path(opts.out))
    say(text)
    say("wrote " + ", ".join(str(p) for p in paths))
    return result
