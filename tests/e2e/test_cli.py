"""The CLI as a user runs it: a subprocess, exit codes, run files, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from imagefolders import make_image_folder
from trainruns import run_cli

pytestmark = pytest.mark.slow

FAST = ["--model", "resnet18", "--image-size", "16", "--batch-size", "4", "--workers", "0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 2-process epoch, then --resume auto to a second epoch."""
    root = tmp_path_factory.mktemp("e2e")
    data = make_image_folder(root / "data", classes=3, per_class=12)
    first = run_cli(
        "train",
        "--data",
        str(data),
        "--nproc",
        "2",
        "--epochs",
        "1",
        "--name",
        "r1",
        *FAST,
        cwd=root,
    )
    files_after_first = sorted(
        p.relative_to(root / "runs" / "r1").as_posix()
        for p in (root / "runs" / "r1").rglob("*")
        if p.is_file()
    )
    second = run_cli(  # one process: resuming also works at another world size
        "train",
        "--data",
        str(data),
        "--nproc",
        "1",
        "--epochs",
        "2",
        "--resume",
        "auto",
        *FAST,
        cwd=root,
    )
    return root, data, first, files_after_first, second


def test_two_process_epoch_writes_every_run_file(trained):
    root, data, first, files, _ = trained
    assert first.returncode == 0, first.stderr
    assert files == [
        ".paratrain.lock",  # held while the run trains (engine/checkpointing/run_dir.hold)
        "checkpoints/best.pt",
        "checkpoints/last.pt",
        "class_indices.json",
        "config.yaml",
        "curves.png",
        "metrics.csv",
        "metrics.jsonl",
        "split.npz",  # which file went to which side, kept across resumes
        "summary.json",
    ]
    assert "  processes: 2 process(es) (torchrun)" in first.stdout
    assert "  device: cpu, backend gloo, strategy ddp" in first.stdout
    assert "  global batch: 8 (4 x 2 replica(s))" in first.stdout
    assert "  schedule: sgd, peak lr 0.005 (--lr-base 0.16 x global batch 8 / 256)" in first.stdout
    assert first.stdout.count("epoch 1/1") == 1  # rank 0 speaks, rank 1 stays quiet
    assert json.loads((root / "runs/r1/class_indices.json").read_text()) == {
        "0": "class_0",
        "1": "class_1",
        "2": "class_2",
    }
    assert "Traceback" not in first.stderr


def test_resume_auto_continues_at_the_next_epoch(trained):
    root, _, _, _, second = trained
    assert second.returncode == 0, second.stderr
    assert "resumed from runs/r1/checkpoints/last.pt at epoch 2" in second.stdout
    assert "epoch 1/2" not in second.stdout and "epoch 2/2" in second.stdout
    rows = [json.loads(x) for x in (root / "runs/r1/metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]
    assert all(r["val_count"] == 6 for r in rows)  # 3 classes x 2 val images, each once
    csv_lines = (root / "runs/r1/metrics.csv").read_text().splitlines()
    assert csv_lines[0].startswith("epoch,lr,train_loss,train_acc,val_loss,val_top1,val_top5")
    assert len(csv_lines) == 3
    state = torch.load(root / "runs/r1/checkpoints/last.pt", weights_only=False)
    assert state["parts"]["progress"]["epoch"] == 2
    assert not any(k.startswith("module.") for k in state["model"])


def test_eval_counts_each_image_once_at_any_world_size(trained, capsys):
    from paratrain.cli import main

    root, data, *_ = trained
    ckpt = str(root / "runs/r1/checkpoints/last.pt")
    assert main(["eval", "--checkpoint", ckpt, "--data", str(data), "--json"]) == 0  # here
    one = capsys.readouterr().out
    two = run_cli(
        "eval", "--checkpoint", ckpt, "--data", str(data), "--json", "--nproc", "2", cwd=root
    )
    assert two.returncode == 0, two.stderr
    a, b = json.loads(one.strip().splitlines()[-1]), json.loads(two.stdout.strip().splitlines()[-1])
    assert a["count"] == b["count"] == 6
    assert (a["loss"], a["top1"]) == (b["loss"], b["top1"])
    assert (a["world_size"], b["world_size"]) == (1, 2)


def test_models_lists_torchvision_classifiers(capsys):
    from paratrain.cli import main

    assert main(["models"]) == 0
    assert {"resnet18", "resnet34", "vit_b_16"} <= set(capsys.readouterr().out.split())


def test_models_come_by_family_with_parameter_counts_and_a_filter(capsys):
    """`paratrain models` printed 80 bare names; now each under its family with its
    size, and --filter narrows the list (timm's are counted once narrowed)."""
    from paratrain.cli import main

    assert main(["models", "--filter", "resnet*"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "resnet:"
    sizes = {line.split()[0]: line.split()[1] for line in lines[1:]}
    assert sizes["resnet18"] == "11.7M" and sizes["resnet50"] == "25.6M"
    assert "wide_resnet50_2" not in sizes  # the pattern is anchored; a plain word is a part
    assert main(["models", "--filter", "vit"]) == 0  # a part of the name: maxvit_t too
    families = [x for x in capsys.readouterr().out.splitlines() if not x.startswith(" ")]
    assert families == ["maxvit:", "vision_transformer:"]
    assert main(["models", "--timm", "--filter", "resnet18"]) == 0
    timm_lines = capsys.readouterr().out.splitlines()
    assert "resnet:" in timm_lines
    assert any(line.split() == ["timm/resnet18", "11.7M"] for line in timm_lines)
    assert main(["models", "--filter", "no-such-model"]) == 2
    assert "no model matches --filter no-such-model" in capsys.readouterr().err


def _bad_inputs(root: Path) -> dict[str, tuple[list[str], str]]:
    good = make_image_folder(root / "good", classes=2, per_class=4)
    (root / "empty").mkdir()
    (root / "flat").mkdir()
    (root / "flat" / "x.jpg").write_bytes(b"")
    empty_class = make_image_folder(root / "emptyclass", classes=2, per_class=4)
    (empty_class / "class_9").mkdir()
    small = make_image_folder(root / "small", classes=2, per_class=4)
    for extra in list((small / "class_1").iterdir())[1:]:
        extra.unlink()
    differ = make_image_folder(root / "differ", classes=2, per_class=6, layout="given")
    (differ / "val" / "class_1").rename(differ / "val" / "class_7")
    (root / "notweights.pt").write_text("hello")
    d = str(good)
    return {
        "missing data": (
            ["--data", str(root / "nope")],
            f"data directory does not exist: {root / 'nope'}",
        ),
        "empty data": (["--data", str(root / "empty")], "data directory is empty"),
        "no class folders": (["--data", str(root / "flat")], "no class folders"),
        "empty class": (["--data", str(empty_class)], "class folder has no images"),
        "one image": (["--data", str(small)], "has 1 image; at least 2"),
        "classes differ": (["--data", str(differ)], "train/val class folders differ"),
        "unknown model": (["--data", d, "--model", "resnet17"], "unknown model 'resnet17'"),
        "not weights": (
            ["--data", d, "--weights", str(root / "notweights.pt")],
            "could not be read as a state dict",
        ),
        "nproc 0": (["--data", d, "--nproc", "0"], "--nproc must be at least 1, or auto, got 0"),
        "batch 0": (
            ["--data", d, "--batch-size", "0"],
            "--batch-size must be at least 1, or auto, got 0",
        ),
        "bad flag": (["--data", d, "--epochs", "many"], "expected an integer, got 'many'"),
    }


@pytest.fixture(scope="module")
def bad_root(tmp_path_factory):
    return tmp_path_factory.mktemp("bad")


BAD_CASES = [
    "missing data",
    "empty data",
    "no class folders",
    "empty class",
    "one image",
    "classes differ",
    "unknown model",
    "not weights",
    "nproc 0",
    "batch 0",
    "bad flag",
]


# Run as a user runs them (a subprocess): proves no traceback and no hang across ranks.
IN_SUBPROCESS = {"missing data", "bad flag"}  # unreadable images on 2 ranks: test_data.py


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_one_line_and_exit_code_2(bad_root, case, capsys, monkeypatch):
    cases = _bad_inputs(bad_root / case.replace(" ", "_"))
    args, message = cases[case]
    if case in IN_SUBPROCESS:
        out = run_cli("train", "--epochs", "1", *args, cwd=bad_root, timeout=120)
        code, stderr = out.returncode, out.stderr
    else:  # the same entry point, called in this process (start-up costs seconds each)
        from paratrain.cli import main

        monkeypatch.setenv("PARATRAIN_CACHE", str(bad_root / "cache"))
        code = main(["train", "--epochs", "1", *args])
        stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert message in stderr
    error_lines = [line for line in stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and error_lines[0].startswith("paratrain")
    assert "Traceback" not in stderr


def test_check_prints_a_table_and_exits_0(tmp_path):
    out = run_cli("check", "--nproc", "2", cwd=tmp_path, timeout=180)
    assert out.returncode == 0, out.stderr
    for name in (
        "backends",
        "rank placement",
        "all_reduce",
        "broadcast",
        "all_gather",
        "SyncBatchNorm",
        "all_reduce 1 MB",
        "all_reduce 16 MB",
        "all_reduce 64 MB",
    ):
        line = next(line for line in out.stdout.splitlines() if line.startswith(name + " "))
        assert " ok " in line, line
    assert "FAIL" not in out.stdout


def test_done_in_is_the_commands_own_time(tmp_path):
    """Every "done in" was shorter than the command's wall time: it left out start-up
    (imports, the listing, the cache) that the user waited through. It is now counted
    from the process's start, with the first step and the training beside it."""
    import re
    import time

    data = make_image_folder(tmp_path / "data", classes=2, per_class=6)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARATRAIN_")}
    env["PARATRAIN_CACHE"] = str(tmp_path / "cache")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "paratrain", "train", "--data", str(data), "--name", "clock",
         "--epochs", "1", "--cache", "off", *FAST],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    wall = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    told = re.search(
        r"done in ([\d.]+)s \(first step at ([\d.]+)s, training ([\d.]+)s\)", done.stdout
    )
    assert told is not None, done.stdout
    said, first, training = (float(x) for x in told.groups())
    assert wall - 1.5 < said <= wall + 0.1, (said, wall)  # only the exit after the line
    assert first < said and training < said
    summary = json.loads((tmp_path / "runs/clock/summary.json").read_text())
    assert summary["wall_s"] == pytest.approx(said, abs=0.1)
    assert summary["first_step_s"] == pytest.approx(first, abs=0.1)


def test_a_launcher_leaves_the_model_to_its_workers_which_tell_its_error_once(tmp_path):
    """A launcher of workers loads neither torchvision nor the engine (a second and
    more before its workers could start): its workers check the model first, and a
    model that cannot take the size is still one line, exit 2, no run folder; nor does
    the launch leave a folder in the temporary folder."""
    data = make_image_folder(tmp_path / "data", classes=2, per_class=4)
    probe = (
        "import json, sys\n"
        "import paratrain.api as api\n"
        "from paratrain.config import TrainConfig\n"
        "heavy = ('torchvision', 'paratrain.engine.trainer', 'paratrain.bench.autopilot')\n"
        "seen = []\n"
        "api.launch_or_run = lambda *a, **k: seen.extend(m for m in heavy if m in sys.modules)\n"
        f"api.train(TrainConfig(data={str(data)!r}, nproc=2, model='resnet17', image_size=16))\n"
        "print(json.dumps(seen))\n"
    )
    env = {**os.environ, "PARATRAIN_CACHE": str(tmp_path / "cache")}
    launcher = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert launcher.returncode == 0, launcher.stderr
    assert json.loads(launcher.stdout.splitlines()[-1]) == []  # none of them loaded
    temporary = tmp_path / "tmp"  # torch's agent left a folder there at every launch
    temporary.mkdir()
    out = run_cli("train", "--data", str(data), "--nproc", "2", "--epochs", "1", "--model",
                  "vit_b_32", *FAST[2:], cwd=tmp_path, timeout=180,
                  TMPDIR=str(temporary))  # fmt: skip
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("paratrain: error:"), out.stderr
    assert (
        "cannot run on 16px images" in errors[0]
        and "smallest --image-size it takes is 32" in errors[0]
    )
    assert "Traceback" not in out.stderr and not list(tmp_path.glob("runs/*"))
    assert not [
        p.name for p in temporary.iterdir() if p.name.startswith(("torchelastic_", "paratrain-"))
    ]
