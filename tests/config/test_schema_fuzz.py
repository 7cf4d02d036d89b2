"""Every subcommand, every option, generated values: exit 0 or one line and exit 2.

Values are drawn per setting from what users get wrong — 0, negatives, nan, inf, huge
numbers, empty strings, text where a number belongs, unknown choices, missing and wrong
files — mixed with valid ones. Commands that do work run with --dry-run, so nothing
trains; the CLI runs in this process.
"""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from imagefolders import make_image_folder
from paratrain.cli import COMMANDS, main
from paratrain.config import TrainConfig, settings
from paratrain.config.schema import Setting
from paratrain.models.registry import create_model
from paratrain.parallel.checkpoint_io import save_atomic

JUNK = [
    "",
    "0",
    "-1",
    "nan",
    "inf",
    "-inf",
    "1e308",
    "9" * 40,
    "abc",
    "auto",
    "none",
    "1.5",
    " ",
    "-",
    "cuda:99",
    "16GB",
]
MODELS = ["resnet18", "squeezenet1_1", "vit_b_32", "mobilenet_v3_small", "nope", "../x"]
PATH_SETTINGS = {
    "checkpoint",
    "data",
    "config",
    "weights",
    "resume",
    "calibrate",
    "cache_dir",
    "csv",
    "out",
    "output_dir",
    "dir",
    "inputs",
}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("fuzz")
    data = make_image_folder(root / "data", classes=2, per_class=4)
    cfg = TrainConfig(data=str(data), model="squeezenet1_1", image_size=32)
    state = {
        "model": create_model(cfg.model, 2, 32).state_dict(),
        "config": cfg.to_dict(),
        "classes": ["class_0", "class_1"],
        "epoch": 1,
    }
    save_atomic(state, root / "run" / "checkpoints" / "last.pt")
    (root / "garbage.bin").write_bytes(os.urandom(64))
    (root / "settings.yaml").write_text("epochs: 2\nimage_size: 32\n")
    (root / "unknown.yaml").write_text("epochz: 2\n")
    (root / "times.csv").write_text("n,seconds\n1,10\n2,6\n4,3.5\n")
    (root / "empty").mkdir()
    os.environ["PARATRAIN_CACHE"] = str(root / "cache")
    return [
        str(data),
        str(root / "run" / "checkpoints" / "last.pt"),
        str(root / "garbage.bin"),
        str(root / "settings.yaml"),
        str(root / "unknown.yaml"),
        str(root / "times.csv"),
        str(root / "empty"),
        str(root / "missing"),
        str(data / "class_0"),
        "auto",
    ]


def _values(s: Setting, paths: list[str]) -> st.SearchStrategy[str]:
    junk = st.sampled_from(JUNK)
    text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
    if s.name in PATH_SETTINGS:
        return st.sampled_from(paths) | junk
    if s.name == "model":
        return st.sampled_from(MODELS) | junk
    if s.rule.choices:
        valid = st.sampled_from(s.rule.choices)
        return st.one_of(valid, valid, valid, text, junk)
    if s.kind is int:
        small = st.integers(0, 64).map(str)
        return st.one_of(
            small, small, st.integers(-(10**6), 10**6).map(str), st.integers().map(str), junk
        )
    if s.kind is float:
        fraction = st.floats(0, 1).map(repr)
        return st.one_of(
            fraction,
            fraction,
            st.floats(0.001, 1000).map(repr),
            st.floats(allow_nan=True, allow_infinity=True).map(repr),
            junk,
        )
    return text | junk


def _option(s: Setting, paths: list[str]) -> st.SearchStrategy[list[str]]:
    if s.kind is bool:
        return st.just([s.flag])
    if s.rule.positional:
        return st.lists(_values(s, paths), max_size=3)
    return _values(s, paths).map(lambda value: [s.flag, value])


def _baseline(name: str, paths: list[str]) -> list[str]:
    """Valid flags to start from (the generated ones follow and win): required options,
    and a small model, so that most examples get past the first check."""
    data, checkpoint = paths[0], paths[1]
    return {
        "train": ["--data", data, "--model", "squeezenet1_1", "--image-size", "32"],
        "eval": ["--checkpoint", checkpoint],
        "predict": ["--checkpoint", checkpoint, paths[-2]],
        "export": ["--checkpoint", checkpoint],
        "plan": ["--device-memory", "8GB", "--model", "squeezenet1_1", "--image-size", "32"],
        "bench": ["--model", "squeezenet1_1", "--image-size", "32"],
        "scale": ["--model", "squeezenet1_1", "--image-size", "32"],
        "slurm": ["--model", "squeezenet1_1", "--image-size", "32"],
    }.get(name, [])


def _argv(name: str, paths: list[str]) -> st.SearchStrategy[list[str]]:
    command = COMMANDS[name]
    base = _baseline(name, paths)
    offered = [s for s in settings(command.options) if s.name != "dry_run" and not s.rule.hidden]
    offered += [s for s in settings(TrainConfig) if s.name in command.train_settings]
    dry = ["--dry-run"] if any(s.name == "dry_run" for s in settings(command.options)) else []
    if not offered:
        return st.just([name])
    picks = st.lists(st.sampled_from(offered), max_size=4, unique_by=lambda s: s.name)
    return picks.flatmap(
        lambda chosen: st.tuples(*(_option(s, paths) for s in chosen)).map(
            lambda parts: [name, *base, *(x for part in parts for x in part), *dry]
        )
    )


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("name", list(COMMANDS))
def test_any_option_value_ends_in_exit_0_or_one_line_and_exit_2(name, paths):
    torch.set_num_threads(1)

    @hypothesis_settings(
        max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(argv=_argv(name, paths))
    def check(argv: list[str]) -> None:
        code, _, err = _run(argv)
        assert code in (0, 2), (argv, code, err)
        assert "Traceback" not in err, (argv, err)
        if code == 2:
            lines = [line for line in err.splitlines() if line.strip()]
            assert len(lines) == 1, (argv, err)
            assert lines[0].startswith("paratrain"), (argv, err)

    check()
