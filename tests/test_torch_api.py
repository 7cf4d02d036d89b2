"""An older torch, or one lacking an API a strategy calls, is one line naming what to
install (torch_api.py), not an ImportError from inside a strategy."""

from __future__ import annotations

import importlib

import pytest

from paratrain import torch_api
from paratrain.cli import main


def test_every_api_named_is_in_this_torch():
    for module, name, _ in torch_api.FEATURES.values():
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"
    torch_api.check_torch()  # this torch is above the floor


def test_releases_compare_by_major_and_minor():
    assert torch_api.release("2.14.1+cu130") == (2, 14)
    assert torch_api.release("2.7.0a0+git12ab") == (2, 7)
    assert torch_api.release("2.10.0rc1") == (2, 10) > torch_api.FLOOR


def test_a_torch_below_the_floor_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch_api, "installed", lambda: "2.5.1")
    assert main(["runs", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "paratrain: error: paratrain needs torch 2.7 or newer, found 2.5.1: pip install "
        "'torch>=2.7' (and the torchvision that matches)"
    )


@pytest.mark.parametrize(
    "strategy, module, name",
    [
        ("fsdp", "torch.distributed.fsdp", "fully_shard"),
        ("hsdp", "torch.distributed.tensor", "DTensor"),
        ("pipeline", "torch.distributed.pipelining", "ScheduleGPipe"),
    ],
)
def test_a_strategy_whose_torch_api_is_missing_is_one_line(
    monkeypatch, capsys, strategy, module, name
):
    monkeypatch.delattr(importlib.import_module(module), name)
    assert main(["train", "--strategy", strategy, "--nproc", "2", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"paratrain: error: --strategy {strategy} needs {module}.{name} (torch ")
    assert "pip install 'torch>=2.7'" in err and "\n" not in err
