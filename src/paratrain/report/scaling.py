"""What `paratrain scale` prints and writes: tables, scaling.json, scaling.csv, plots."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from paratrain.report.plots import new_figure

CSV_COLUMNS = (
    "source",
    "n",
    "threads",
    "step_ms",
    "communication_ms",
    "images_per_s",
    "speedup",
    "efficiency",
    "epoch_s",
    "communication_share",
)


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: list) -> str:
        return indent + "  ".join(str(c).rjust(w) for c, w in zip(cells, widths, strict=True))

    return [line(header), *(line(r) for r in rows)]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_measured(report: dict) -> str:
    """What `paratrain scale` prints after measuring: the table, the fitted link, the profile, predicted beside measured, and larger clusters."""
    lines = [
        f"{report['model']} at {report['image_size']}px, batch {report['batch_size']} per "
        f"process, {report['cores']} cores; weak scaling (the batch per process is fixed)"
    ]
    lines.append("measured:")
    lines += _table(
        ["series", "N", "threads", "step ms", "images/s", "speedup", "efficiency"],
        [
            [
                m["series"],
                m["n"],
                m["threads"],
                f"{m['step_ms']:.1f}",
                f"{m['images_per_s']:.1f}",
                f"{m['speedup']:.2f}x",
                _pct(m["efficiency"]),
            ]
            for m in report["measured"]
        ],
    )
    ar = report["all_reduce"]
    if ar["alpha_us"] is not None:
        lines.append(
            f"all_reduce fit over {len(ar['samples'])} timings (4 KB to "
            f"{max(s[1] for s in ar['samples']) / 2**20:g} MB): latency alpha {ar['alpha_us']:.1f} "
            f"us, bandwidth beta {ar['beta_gbps']:.3f} GB/s; error rms {ar['rms_error_pct']:.1f}%, "
            f"max {ar['max_error_pct']:.1f}%"
        )
    p = report["profile"]
    lines.append(
        f"one process's step: data+forward {p['data_forward_ms']:.1f} ms, backward "
        f"{p['backward_ms']:.1f} ms, optimizer {p['optimizer_ms']:.1f} ms; gradients "
        f"{p['gradient_mb']:.1f} MB in {p['buckets']} DDP bucket(s)"
    )
    lines += _comparison_lines(report)
    lines += _prediction_lines(report)
    return "\n".join(lines)


def _comparison_lines(report: dict) -> list[str]:
    """Predicted beside measured, per process count (empty when nothing was compared)."""
    lines: list[str] = []
    if report["comparison"]:
        lines.append(
            "predicted beside measured (same threads per process; predicted = that N's "
            "compute, its no_sync step, + the modelled all-reduce on the link fitted here):"
        )
        lines += _table(
            [
                "N",
                "measured ms",
                "compute ms",
                "all-reduce ms",
                "exposed ms",
                "predicted ms",
                "error",
                "from 1 process alone",
            ],
            [
                [
                    c["n"],
                    f"{c['measured_ms']:.1f}",
                    f"{c['compute_ms']:.1f}",
                    f"{c['communication_ms']:.1f}",
                    f"{c['exposed_ms']:.1f}",
                    f"{c['predicted_ms']:.1f}",
                    f"{c['error_pct']:+.1f}%",
                    f"{c['from_one_process_ms']:.1f} ({c['from_one_process_error_pct']:+.1f}%)",
                ]
                for c in report["comparison"]
            ],
        )
        lines.append(
            "  (from 1 process alone: one process's compute, as a device would keep it; "
            "the gap is what processes sharing these cores cost each other)"
        )
    return lines


def _prediction_lines(report: dict) -> list[str]:
    """Larger clusters on the chosen network, then every link preset's efficiency."""
    lines: list[str] = []
    lines.append(
        f"predicted, {report['network']} (each device computing as one process alone here):"
    )
    lines += _table(
        [
            "N",
            "step ms",
            "all-reduce ms",
            "exposed ms",
            "images/s",
            "speedup",
            "efficiency",
            f"epoch s ({report['epoch_images']} img)",
        ],
        [
            [
                r["n"],
                f"{1000 * r['step_s']:.1f}",
                f"{1000 * r['communication_s']:.1f}",
                f"{1000 * r['exposed_s']:.1f}",
                f"{r['images_per_s']:.0f}",
                f"{r['speedup']:.1f}x",
                _pct(r["efficiency"]),
                f"{r['epoch_s']:.2f}",
            ]
            for r in report["predicted"]
        ],
    )
    first = next(iter(report["presets"].values()))
    at = list(first["efficiency"])
    lines.append(f"efficiency by link preset, at N = {', '.join(at)} (this step's compute time):")
    lines += _table(
        ["preset", "GB/s", "latency us", *[f"N={n}" for n in at], "assumes"],
        [
            [
                name,
                f"{v['bandwidth_gbps']:g}",
                f"{v['latency_us']:g}",
                *[_pct(v["efficiency"][n]) for n in at],
                v["note"],
            ]
            for name, v in report["presets"].items()
        ],
    )
    return lines


def format_calibration(report: dict, source: str) -> str:
    """What `scale --calibrate` prints: the fit of the user's epoch times and its extrapolation."""
    c = report["calibration"]
    lines = [
        f"calibration from {source} ({len(c['points'])} points): epoch(N) = "
        f"{c['fixed_s']:.3g} s fixed + {c['compute_s']:.3g} s / N + "
        f"{c['communication_s']:.3g} s x (N-1)/N^2 communication"
    ]
    lines += _table(
        ["N", "measured s", "fitted s", "error", "communication", "fixed cost"],
        [
            [
                p["n"],
                f"{p['measured_s']:.3g}",
                f"{p['fitted_s']:.3g}",
                f"{p['error_pct']:+.1f}%",
                _pct(p["communication_share"]),
                _pct(p["fixed_share"]),
            ]
            for p in c["points"]
        ],
    )
    limit = c["speedup_limit"]
    lines.append(
        f"implied fixed cost {c['fixed_s']:.3g} s per epoch: no N can beat it, so the speedup "
        f"stays below {limit:.1f}x"
        if math.isfinite(limit)
        else "no fixed cost found"
    )
    lines.append("extrapolated:")
    lines += _table(
        ["N", "epoch s", "speedup", "efficiency", "communication"],
        [
            [
                r["n"],
                f"{r['epoch_s']:.3g}",
                f"{r['speedup']:.2f}x",
                _pct(r["efficiency"]),
                _pct(r["communication_share"]),
            ]
            for r in report["predicted"]
        ],
    )
    return "\n".join(lines)


def _csv_rows(report: dict) -> list[dict]:
    rows = []
    for m in report.get("measured", []):
        epoch = (
            math.ceil(report["epoch_images"] / (report["batch_size"] * m["n"]))
            * m["step_ms"]
            / 1000
        )
        rows.append({**m, "source": f"measured, {m['series']}", "epoch_s": epoch})
    for p in report.get("calibration", {}).get("points", []):
        rows.append(
            {
                "source": "measured",
                "n": p["n"],
                "epoch_s": p["measured_s"],
                "speedup": p["speedup"],
                "communication_share": p["communication_share"],
            }
        )
    for r in report["predicted"]:
        row = {**r, "source": "predicted"}
        if "step_s" in r:
            row.update(step_ms=1000 * r["step_s"], communication_ms=1000 * r["communication_s"])
        rows.append(row)
    return rows


def write_report(report: dict, out: Path) -> list[Path]:
    """scaling.json, scaling.csv, speedup.png and epoch_time.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "scaling.json", out / "scaling.csv", out / "speedup.png", out / "epoch_time.png"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    rows = _csv_rows(report)
    with paths[1].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    _plot(rows, "speedup", "speedup over 1 process", paths[2], ideal=True)
    _plot(rows, "epoch_s", "epoch time (s)", paths[3], ideal=False)
    return paths


def _plot(rows: list[dict], key: str, label: str, path: Path, ideal: bool) -> None:
    fig = new_figure(figsize=(6.4, 4.4))
    ax = fig.subplots()
    predicted = [r for r in rows if r["source"] == "predicted"]
    ns = [r["n"] for r in predicted]
    ax.plot(ns, [r[key] for r in predicted], "-", label="predicted")
    if ideal:
        ax.plot(ns, ns, ":", color="gray", label="linear (ideal)")
    sources = dict.fromkeys(r["source"] for r in rows if r["source"] != "predicted")
    for source, (marker, size) in zip(sources, [("o", 7), ("s", 11), ("^", 11)], strict=False):
        points = [r for r in rows if r["source"] == source and r.get(key) is not None]
        ax.plot(
            [r["n"] for r in points],
            [r[key] for r in points],
            marker,
            markersize=size,
            fillstyle="full" if marker == "o" else "none",
            label=source,
        )  # both seen
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("processes (devices) N")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
