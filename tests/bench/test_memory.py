"""`paratrain plan`: sizes, the estimate against a measured peak, the recommendation."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

from paratrain.bench import memory
from paratrain.errors import UserError
from paratrain.models.registry import create_model
from paratrain.parallel.base import MemoryProfile, whole_model_memory
from paratrain.parallel.partition import Traced, Unit


@pytest.mark.parametrize(
    "text, expected",
    [
        ("16GB", 16 * 2**30),
        ("16GiB", 16 * 2**30),
        ("512MB", 512 * 2**20),
        ("80", 80 * 2**30),
        ("1.5g", int(1.5 * 2**30)),
        ("2T", 2 * 2**40),
    ],
)
def test_device_memory_sizes(text, expected):
    assert memory.parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "16 GBs", "-2GB", "0GB", ""])
def test_bad_device_memory_is_a_user_error(text):
    with pytest.raises(UserError, match="--device-memory"):
        memory.parse_size(text)


def _measured(
    model: str, size: int, batch: int, precision: str = "32", checkpointed: bool = False
) -> int:
    code = (
        "import torch; torch.set_num_threads(2); from paratrain.bench import memory; "
        f"print(memory.measure_training_peak({model!r}, {size}, {batch}, classes=10, "
        f"precision={precision!r}, checkpointed={checkpointed}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "precision"),
    [("resnet18", "32"), ("resnet50", "32"), ("resnet50", "bf16-mixed")],
)
def test_estimate_is_within_20_percent_of_the_measured_peak(model, precision):
    """The estimate at the run's precision: under bf16 autocast the activations are
    profiled as autocast saves them, against a peak measured under the same autocast."""
    size, batch = 64, 16
    dtype = memory.AUTOCAST.get(precision)
    model_ = create_model(model, 10, size)
    rows = memory.estimate(model_, size, batch, 1, slots=1, autocast=dtype, threads=2)
    ddp = next(r for r in rows if r.strategy == "ddp")
    measured = _measured(model, size, batch, precision)  # at 2 threads
    assert measured <= ddp.total <= 1.2 * measured, (ddp.total, measured)
    if dtype is not None:  # half-size activations: well below the fp32 estimate's
        fp32 = memory.estimate(model_, size, batch, 1, slots=1)
        assert ddp.activations < 0.8 * next(r for r in fp32 if r.strategy == "ddp").activations
    parameters = sum(p.numel() * 4 for p in create_model(model, 10, size).parameters())
    assert ddp.parameters == ddp.gradients == ddp.optimizer == parameters  # SGD momentum: 1 slot


@pytest.mark.slow
def test_with_activation_checkpointing_the_estimate_falls_as_the_measured_peak_does():
    """ResNet-50 at 128 px, batch 16: the estimate under --activation-checkpointing
    within 20% of the peak measured so, well below the estimate without it; only the
    strategies that take checkpointing are offered. The peak is the same in two fresh
    processes (with glibc's default mmap threshold it read 614 to 766 MB, against 489)."""
    size, batch = 128, 16
    model_ = create_model("resnet50", 10, size)
    plain = memory.estimate(model_, size, batch, 2, slots=1, threads=2)
    rows = memory.estimate(model_, size, batch, 2, slots=1, checkpointed=True, threads=2)
    assert [r.strategy for r in rows] == ["ddp", "fsdp"]
    ddp = rows[0]
    measured, again = (_measured("resnet50", size, batch, checkpointed=True) for _ in range(2))
    assert abs(measured - again) <= 0.01 * measured, (measured, again)  # malloc's leftovers
    assert measured <= ddp.total <= 1.2 * measured, (ddp.total, measured)
    assert ddp.activations < 0.6 * next(r for r in plain if r.strategy == "ddp").activations


def _profile_of(units: list[Unit], checkpointed: frozenset[str] = frozenset()) -> MemoryProfile:
    traced = Traced(graph=None, units=units, profiled_batch=1)  # type: ignore[arg-type]
    return MemoryProfile(None, traced, [0], 1, 1, 1, 1, checkpointed=checkpointed)  # type: ignore[arg-type]


def test_what_autograd_holds_counts_a_shared_tensor_once_and_peaks_where_backward_recomputes():
    """a keeps its output, which b keeps as its input: held once. Checkpointing b keeps
    its input only until backward reaches b, whose recomputed activations then come
    back on top of a's."""

    def units() -> list[Unit]:
        return [
            Unit("a", [], activation_bytes=10, input_bytes=1, saves_output=True),
            Unit("b", [], activation_bytes=8, input_bytes=4, saves_input=True),
            Unit("c", [], activation_bytes=6, input_bytes=2),
        ]

    assert _profile_of(units()).saved == 10 + 8 - 4 + 6
    assert _profile_of(units(), frozenset({"b"})).saved == 10 + 6  # at c: a's, b's input, c's
    late = units()
    late[2].activation_bytes = 1
    assert _profile_of(late, frozenset({"b"})).saved == 10 + 8 - 4  # at b, recomputed
    apart = units()
    apart[0].saves_output = False  # b's input is not a's to keep: both count
    assert _profile_of(apart).saved == 10 + 8 + 6
    cast = units()  # autocast's weight copies: a checkpointed unit's made again, one at a time
    for unit, copies in zip(cast, (3, 5, 7), strict=True):
        unit.weight_copy_bytes = copies
    assert _profile_of(cast).cast == 3 + 5 + 7
    assert _profile_of(cast, frozenset({"b", "c"})).cast == 3 + 7


def test_one_process_frees_its_gradients_and_makes_them_again_during_backward():
    """One process (no DDP buckets): at unit k backward holds what the units up to k
    keep and the gradients of k and the units after it, never all of both at once."""
    net = nn.Linear(2, 3)  # 9 parameters: 36 bytes, cut as 20 + 12 + 4
    units = [
        Unit("a", [], activation_bytes=10, parameter_bytes=20),
        Unit("b", [], activation_bytes=8, parameter_bytes=12),
        Unit("c", [], activation_bytes=6, parameter_bytes=4),
    ]
    traced = Traced(graph=None, units=units, profiled_batch=1)  # type: ignore[arg-type]
    one = MemoryProfile(net, traced, [0], 1, 1, 1, 1)
    assert one.saved == 24  # all three at c
    # at a: 10 held and all 36 made; at b 18 and 16; at c 24 and 4
    assert one.freed_gradients == 36 + 24 - max(10 + 36, 18 + 16, 24 + 4)
    several = whole_model_memory("ddp", replace(one, devices=2), "")
    alone = whole_model_memory("ddp", one, "")
    assert several.total - alone.total == one.freed_gradients == 14


def test_a_cpu_backward_holds_a_reordered_weight_and_a_partial_gradient_per_extra_thread():
    net = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))  # the largest weight: 20 elements
    traced = Traced(graph=None, units=[Unit("a", [], activation_bytes=1)], profiled_batch=1)  # type: ignore[arg-type]
    profile = MemoryProfile(net, traced, [0], 1, 1, 1, 1)
    assert profile.scratch == 0  # a GPU
    assert replace(profile, threads=1).scratch == 20 * 4
    assert replace(profile, threads=2).scratch == 20 * (4 + 4)
    assert replace(profile, threads=3, compute_bytes=2).scratch == 20 * (2 + 4 + 4)
    on_cpu = whole_model_memory("ddp", replace(profile, threads=2), "batch 1")
    assert on_cpu.fixed - whole_model_memory("ddp", profile, "").fixed == 160
    table = memory.format_plan([on_cpu], 2**30, 1, "ddp", "why", "heading")
    assert "the CPU kernels' scratch 0 MiB" in table  # named, as it is in no column


def test_strategies_divide_memory_as_they_should():
    model = create_model("resnet18", 10, 32)
    rows = {r.strategy: r for r in memory.estimate(model, 32, 8, 4, slots=2)}
    ddp, fsdp, pipe, split = rows["ddp"], rows["fsdp"], rows["pipeline"], rows["split"]
    assert ddp.optimizer == 2 * ddp.parameters  # AdamW: two slots
    assert fsdp.gradients == ddp.gradients // 4 and fsdp.optimizer == ddp.optimizer // 4
    states = {k: r.parameters + r.gradients + r.optimizer for k, r in rows.items()}
    assert states["fsdp"] < 0.5 * states["ddp"] and fsdp.activations == ddp.activations
    assert split.parameters < ddp.parameters and split.activations < ddp.activations
    assert pipe.parameters <= ddp.parameters and pipe.activations <= split.activations


def test_recommendation_is_the_fastest_that_fits():
    rows = [
        memory.DeviceMemory("ddp", 100, 100, 100, 700),
        memory.DeviceMemory("fsdp", 25, 25, 25, 700),
        memory.DeviceMemory("pipeline", 50, 50, 50, 200),
        memory.DeviceMemory("split", 50, 50, 50, 300),
    ]
    assert memory.recommend(rows, 2000, 4)[0] == "ddp"
    assert memory.recommend(rows, 900, 4)[0] == "fsdp"
    assert memory.recommend(rows, 500, 4)[0] == "pipeline"
    choice, why = memory.recommend(rows, 100, 4)
    assert choice is None and "nothing fits" in why and "pipeline" in why
    assert memory.recommend(rows, 900, 1)[0] is None  # one device: only ddp's layout exists


@pytest.mark.slow
def test_plan_cli_prints_every_strategy_and_json(tmp_path):
    args = [
        sys.executable,
        "-m",
        "paratrain",
        "plan",
        "--model",
        "resnet18",
        "--image-size",
        "32",
        "--batch-size",
        "8",
        "--device-memory",
        "64MB",
        "--devices",
        "2",
    ]
    text = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert text.returncode == 0, text.stderr
    for strategy in ("ddp", "fsdp", "pipeline", "split"):
        assert f"\n{strategy} " in text.stdout
    assert "recommended: " in text.stdout
    as_json = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=300)
    result = json.loads(as_json.stdout)
    fits = [r for r in result["rows"] if r["total"] <= result["device_memory"]]
    assert result["recommended"] == (fits[0]["strategy"] if fits else None)
    bad = subprocess.run([*args[:-4], "--device-memory", "lots"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("paratrain: error") == 1


def test_plan_without_a_device_memory_takes_this_machines(capsys, monkeypatch):
    """`plan` stopped without --device-memory; it now plans for this machine (no GPU
    here: 2 devices sharing the available memory) and says so."""
    from paratrain.bench import memory
    from paratrain.cli import main

    monkeypatch.setattr(memory, "available_memory", lambda: 6 * 2**30)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["plan", "--model", "resnet18", "--image-size", "32", "--batch-size", "8"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["devices"], result["device_memory"]) == (2, 3 * 2**30)
    assert main(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("2 device(s) of 3.0GiB (this machine's; --device-memory for another):")
    assert main([*args, "--devices", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["device_memory"] == 2 * 2**30


def test_plan_estimates_at_the_precision_the_run_would_use(capsys, monkeypatch):
    """`plan` estimated fp32 while training defaults to bf16: --precision auto resolves
    as a run here would (bf16 where the CPU computes it natively), and bf16's
    activations, profiled under autocast, are smaller than fp32's."""
    from paratrain.bench import memory
    from paratrain.cli import main
    from paratrain.distributed import runtime

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = ["plan", "--model", "resnet18", "--image-size", "32", "--batch-size", "8", "--json"]
    rows = {}
    for native, expected in ((True, "bf16-mixed"), (False, "32")):
        monkeypatch.setattr(runtime, "cpu_has_native_bf16", lambda _=None, n=native: n)
        assert memory.run_precision(memory.TrainConfig(model="resnet18"))[0] == expected
        assert main(args) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["precision"] == expected
        rows[expected] = next(r for r in result["rows"] if r["strategy"] == "ddp")
    assert rows["bf16-mixed"]["activations"] < 0.8 * rows["32"]["activations"]
    assert rows["bf16-mixed"]["parameters"] == rows["32"]["parameters"]  # fp32 master weights
    assert main([*args[:-1], "--precision", "32"]) == 0
    assert "resnet18 at 32px, batch 8 per device, sgd, 32 (--precision)" in capsys.readouterr().out


def test_plan_counts_the_ema_copy_where_the_strategy_keeps_one():
    from paratrain.bench.memory import estimate, wants_average
    from paratrain.config import TrainConfig
    from paratrain.models.registry import create_model

    model = create_model("resnet18", 10, 32)
    copy = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    rows = {r.strategy: r for r in estimate(model, 32, 8, 2, 1, averaged=True)}
    plain = {r.strategy: r for r in estimate(model, 32, 8, 2, 1)}
    assert rows["ddp"].average == copy and rows["ddp"].total - plain["ddp"].total == copy
    assert rows["fsdp"].average == 0 and rows["pipeline"].average == 0  # they keep none
    # auto keeps one, except under --budget; 0 keeps none
    assert wants_average(TrainConfig()) and not wants_average(TrainConfig(budget="60s"))
    assert not wants_average(TrainConfig(ema_decay=0.0))
