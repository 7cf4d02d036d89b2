"""Runs started together never share a run directory."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from paratrain.config import TrainConfig
from paratrain.config.run_dirs import claim_new_name
from paratrain.engine.checkpointing.run_dir import resolve_run
from paratrain.errors import UserError

STAMP = "20261203-120000"


def test_runs_started_in_the_same_second_get_distinct_folders(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda _format: STAMP)  # all in the same second
    count = 6
    barrier = threading.Barrier(count)

    def claim() -> str:
        barrier.wait()  # every claim at once: only mkdir's atomicity keeps them apart
        return claim_new_name(tmp_path)

    with ThreadPoolExecutor(count) as pool:
        names = list(pool.map(lambda _: claim(), range(count)))
    assert sorted(names) == sorted([STAMP, *(f"{STAMP}-{i}" for i in range(2, count + 1))])
    assert all((tmp_path / name).is_dir() for name in names)


def test_a_name_another_run_took_a_moment_ago_is_refused(tmp_path):
    cfg = TrainConfig(output_dir=str(tmp_path), name="sweep")
    run_dir, resume_from = resolve_run(cfg)  # the first run: nothing written in it yet
    assert run_dir == tmp_path / "sweep" and resume_from is None
    with pytest.raises(UserError, match="already holds a run"):
        resolve_run(cfg)
    run_dir, _ = resolve_run(TrainConfig(output_dir=str(tmp_path), name="sweep", resume="auto"))
    assert run_dir == tmp_path / "sweep"  # --resume auto: continued, nothing to resume yet


def test_unnamed_runs_each_claim_their_own_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda _format: STAMP)
    cfg = TrainConfig(output_dir=str(tmp_path))
    first, _ = resolve_run(cfg)
    second, _ = resolve_run(cfg)
    assert (first.name, second.name) == (STAMP, f"{STAMP}-2")


def test_a_launch_that_wrote_nothing_leaves_no_empty_run_folder(tmp_path, monkeypatch):
    from imagefolders import make_image_folder
    from paratrain import api

    data = make_image_folder(tmp_path / "data", classes=2, per_class=4)
    cfg = TrainConfig(data=str(data), output_dir=str(tmp_path / "runs"), nproc=2)

    def workers_refused(nproc, argv, work, **_):
        assert "--name" in argv  # the claimed name is handed to the workers
        raise SystemExit(2)

    monkeypatch.setattr(api, "launch_or_run", workers_refused)
    with pytest.raises(SystemExit):
        api.train(cfg)
    assert list((tmp_path / "runs").iterdir()) == []

    def workers_wrote(nproc, argv, work, **_):
        name = argv[argv.index("--name") + 1]
        (tmp_path / "runs" / name / "config.yaml").write_text("epochs: 1\n")

    monkeypatch.setattr(api, "launch_or_run", workers_wrote)
    api.train(cfg)
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "config.yaml").is_file()  # a run that wrote: kept


@pytest.mark.parametrize("name", ["..", ".", "x" * 300])
def test_a_run_name_stays_one_folder_inside_the_output_folder(name, image_folder, capsys):
    from paratrain.cli import main

    code = main(["train", "--data", str(image_folder), "--name", name, "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "a run's name is one folder inside --output-dir" in err[0]


def test_a_missing_extra_is_told_once_before_any_worker_starts(image_folder, capsys, monkeypatch):
    import importlib.util

    from paratrain.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "timm" else real(name, *a)
    )
    code = main(["train", "--data", str(image_folder), "--opt", "lamb", "--nproc", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    from paratrain.version import install_extra

    assert code == 2 and err == [
        f"paratrain: error: --opt lars and lamb needs the timm package: {install_extra('timm')}"
    ]
