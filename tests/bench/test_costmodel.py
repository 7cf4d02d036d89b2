"""The communication cost model of `paratrain scale`: formulas, fits, predictions."""

from __future__ import annotations

import json
import math
import random

import pytest

from paratrain.bench import costmodel
from paratrain.bench.collectives import message_sizes
from paratrain.bench.costmodel import Link, Network, StepProfile

MB = 2**20


def _profile(backward_s: float = 0.2, params: int = 40) -> StepProfile:
    """Gradients as a ResNet gives them: the big ones (last layers) first in backward."""
    sizes = [int(4 * MB * (params - i) / params) + 4096 for i in range(params)]
    ready = [backward_s * (i + 1) / params for i in range(params)]
    return StepProfile(0.1, backward_s, 0.03, list(zip(ready, sizes, strict=True)))


def test_ring_all_reduce_formula():
    link = Link("l", bandwidth_gbps=10.0, latency_us=20.0)
    assert costmodel.ring_all_reduce_s(1, 100 * MB, link) == 0.0
    assert costmodel.ring_all_reduce_s(2, 1e9, link) == pytest.approx(2 * 20e-6 + 1e9 / 10e9)
    assert costmodel.ring_all_reduce_s(8, 1e9, link) == pytest.approx(14 * 20e-6 + 2 * 7 / 8 * 0.1)


def test_hierarchical_all_reduce_is_ring_inside_a_node_and_between_nodes():
    inter, intra = costmodel.PRESETS["ib-hdr"], costmodel.PRESETS["nvlink4"]
    net = Network(inter, per_node=8, intra=intra)
    size = 100 * MB
    assert net.all_reduce_s(4, size) == costmodel.ring_all_reduce_s(4, size, intra)  # one node
    expected = costmodel.ring_all_reduce_s(8, size, intra) + costmodel.ring_all_reduce_s(
        4, size / 8, inter
    )
    assert net.all_reduce_s(32, size) == pytest.approx(expected)
    # cheaper than one flat ring on the slow link, dearer than one on the fast one
    assert costmodel.ring_all_reduce_s(32, size, intra) < net.all_reduce_s(32, size)
    assert net.all_reduce_s(32, size) < costmodel.ring_all_reduce_s(32, size, inter)


@pytest.mark.parametrize("noise", [0.0, 0.03])
def test_fit_recovers_alpha_and_beta_from_the_models_own_timings(noise):
    rng = random.Random(7)
    link = Link("truth", bandwidth_gbps=1.7, latency_us=85.0)
    samples = [
        (n, size, costmodel.ring_all_reduce_s(n, size, link) * (1 + rng.uniform(-noise, noise)))
        for n in (2, 4, 8)
        for size in message_sizes(256 * MB)
    ]
    fit = costmodel.fit_alpha_beta(samples)
    assert fit.alpha_s == pytest.approx(link.alpha_s, rel=0.05 if noise else 1e-9)
    assert fit.beta_bps == pytest.approx(link.beta_bps, rel=0.05 if noise else 1e-9)
    assert fit.max_error <= 1.2 * noise + 1e-9
    assert fit.points == 27


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="2 or more"):
        costmodel.fit_alpha_beta([(2, 4096, 1e-4)])


def test_buckets_follow_ddp_first_small_then_capped():
    grads = [(0.01 * i, 300_000) for i in range(1, 21)]  # 20 x 0.3 MB
    buckets = costmodel.ddp_buckets(grads, cap_bytes=2 * MB)
    assert sum(b for _, b in buckets) == sum(g for _, g in grads)
    assert buckets[0] == (0.04, 1_200_000)  # closed on reaching 1 MiB
    assert all(size >= 2 * MB for _, size in buckets[1:-1])
    assert buckets[-1][0] == 0.2  # ready when its last gradient is


def test_overlap_hides_communication_inside_backward():
    def cost(nbytes):
        return nbytes / 1e9

    # two buckets of 10 ms each, ready at 20 and 90 ms of a 100 ms backward
    total, exposed = costmodel.overlapped_communication(
        [(0.02, 10_000_000), (0.09, 10_000_000)], 0.1, cost
    )
    assert total == pytest.approx(0.02)
    assert exposed == pytest.approx(0.0)  # the second ends at exactly 100 ms
    total, exposed = costmodel.overlapped_communication(
        [(0.02, 80_000_000), (0.09, 10_000_000)], 0.1, cost
    )
    assert total == pytest.approx(0.09)
    assert exposed == pytest.approx(0.01)  # the first ends at 100 ms, the second at 110


@pytest.mark.parametrize("preset", list(costmodel.PRESETS))
def test_predictions_are_monotone(preset):
    profile = _profile()
    ns = costmodel.powers_of_two(1024)
    flat = costmodel.predict(profile, ns, Network(costmodel.PRESETS[preset]), batch_size=16)
    tiered = costmodel.predict(
        profile, ns, Network(costmodel.PRESETS[preset], 8, costmodel.PRESETS["nvlink4"]), 16
    )
    for rows in (flat, tiered):
        assert [r.n for r in rows] == ns
        assert rows[0].speedup == 1.0 and rows[0].step_s == pytest.approx(profile.compute_s)
        for a, b in zip(rows, rows[1:], strict=False):
            assert b.step_s >= a.step_s  # more ranks never make a step shorter
            assert b.communication_s >= a.communication_s
            assert b.efficiency <= a.efficiency + 1e-12
            assert b.speedup >= a.speedup  # but the whole still goes faster
            assert b.speedup <= b.n
    # a faster link never makes any N slower
    slow = costmodel.predict(profile, ns, Network(Link("s", 1.0, 50.0)), 16)
    fast = costmodel.predict(profile, ns, Network(Link("f", 10.0, 50.0)), 16)
    assert all(f.step_s <= s.step_s for f, s in zip(fast, slow, strict=True))
    assert slow[-1].step_s > fast[-1].step_s


def test_calibration_recovers_its_own_terms():
    truth = costmodel.Calibration(0.5, 20.0, 3.0, ())
    points = [(n, truth.epoch_s(n)) for n in (1, 2, 4, 8, 16)]
    fit = costmodel.calibrate(points)
    assert (fit.fixed_s, fit.compute_s, fit.communication_s) == pytest.approx((0.5, 20.0, 3.0))
    assert fit.speedup_limit() == pytest.approx(truth.epoch_s(1) / 0.5)


V100 = "n,seconds\n1,9\n2,5.5\n4,3\n8,2\n"  # ResNet-34, 16 per GPU, 2,939 images


def test_calibrate_reproduces_a_published_v100_measurement(tmp_path, capsys):
    from paratrain.cli import main

    (tmp_path / "v100.csv").write_text(V100)
    out = tmp_path / "report"
    assert main(["scale", "--calibrate", str(tmp_path / "v100.csv"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    report = json.loads((out / "scaling.json").read_text())
    points = report["calibration"]["points"]
    assert [p["n"] for p in points] == [1, 2, 4, 8]
    for p in points:
        assert abs(p["fitted_s"] - p["measured_s"]) <= 0.15 * p["measured_s"]
        assert p["error_pct"] == pytest.approx(
            100 * (p["fitted_s"] - p["measured_s"]) / p["measured_s"]
        )
    fixed = report["calibration"]["fixed_s"]
    assert 0 < fixed < 2 and report["calibration"]["communication_s"] > 0
    assert f"implied fixed cost {fixed:.3g} s per epoch" in text
    assert "communication" in text and f"{100 * points[-1]['communication_share']:.1f}%" in text
    predicted = report["predicted"]
    assert predicted[-1]["n"] == 1024
    assert all(b["epoch_s"] <= a["epoch_s"] for a, b in zip(predicted, predicted[1:], strict=False))
    assert predicted[-1]["speedup"] < report["calibration"]["speedup_limit"]
    lines = (out / "scaling.csv").read_text().splitlines()
    assert lines[0].startswith("source,n,") and len(lines) == 1 + 4 + len(predicted)
    for name in ("speedup.png", "epoch_time.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "No such file"),
        ("n,seconds\n1,9\n2,abc\n4,3\n", "line 3: expected 'n,seconds'"),
        ("1,9\n2,5\n", "3 or more different N"),
        ("1,9\n2,5\n0,3\n", "line 3"),
    ],
)
def test_calibrate_rejects_bad_files_in_one_line(tmp_path, capsys, content, message):
    from paratrain.cli import main

    path = tmp_path / "times.csv"
    if content is not None:
        path.write_text(content)
    assert main(["scale", "--calibrate", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("paratrain: error: --calibrate") and message in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_bandwidth_needs_latency(capsys):
    from paratrain.cli import main

    assert main(["scale", "--bandwidth", "10"]) == 2
    assert "--bandwidth and --latency go together" in capsys.readouterr().err


def test_powers_of_two_include_the_measured():
    assert costmodel.powers_of_two(16, also=[3]) == [1, 2, 3, 4, 8, 16]
    assert math.log2(costmodel.powers_of_two(1024)[-1]) == 10
