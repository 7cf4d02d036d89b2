"""The README's commands are true: every command in its code blocks parses, every
`paratrain train` among them dry-runs on data laid out as the command names it, and its
other lines are the install, test and docs commands CI runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from imagefolders import make_image_folder, make_shards
from paratrain.cli import build_parser, main, resolve_train_args

ROOT = Path(__file__).parents[2]
# Lines a README block may hold besides paratrain's own commands: the installs, the
# test command and the docs build, which .ci/run runs itself.
OTHER_PROGRAMS = ("python -m pip install ", "python -m pytest", "mkdocs build", "sbatch ")
# What needs the network (a dataset or weights from a hub): such a command is parsed and
# every value checked, but not dry-run in this offline suite (the fetch has tests of its
# own, with the files laid out where the hubs put them).
NETWORK_DATA = ("hf:",)


def needs_network(cfg) -> bool:
    weights_by_name = cfg.weights is not None and not Path(str(cfg.weights)).exists()
    return str(cfg.data).startswith(NETWORK_DATA) or weights_by_name


def readme_lines() -> list[str]:
    """Every command line of the README's fenced code blocks, continuations joined."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line:
                lines.append(line)
    return lines


def paratrain_argv(line: str) -> list[str] | None:
    """The arguments after `paratrain` (direct, `-m paratrain` or under srun), or None."""
    words = shlex.split(line)
    for i, word in enumerate(words):
        if word == "paratrain" and (i == 0 or words[i - 1] in ("-m",) or words[0] == "srun"):
            return words[i + 1 :]
    return None


def _commands() -> list[list[str]]:
    return [argv for line in readme_lines() if (argv := paratrain_argv(line)) is not None]


def test_every_readme_line_is_a_paratrain_command_or_one_ci_runs():
    lines = readme_lines()
    assert len(_commands()) >= 12, "the README lost its recipes"
    strays = [
        line
        for line in lines
        if paratrain_argv(line) is None and not line.startswith(OTHER_PROGRAMS)
    ]
    assert strays == []
    for program in ("python -m pip install -e", "python -m pytest", "mkdocs build --strict"):
        assert any(line.startswith(program) for line in lines), program
        ci = (ROOT / ".ci" / "run").read_text()
        assert any(line.startswith(program) for line in ci.splitlines()), program


def test_the_readme_install_and_test_commands_are_those_ci_runs():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    lines = readme_lines()
    develop = next(line for line in lines if line.startswith("python -m pip install -e"))
    assert develop in ci
    assert "python -m pytest -q" in lines and "python -m pytest -q" in ci


@pytest.fixture
def readme_data(tmp_path, monkeypatch) -> Path:
    """The data the README's commands name, small, in a working folder of their own."""
    make_image_folder(tmp_path / "flower_photos", classes=5, per_class=8)
    make_image_folder(tmp_path / "my_images", classes=3, per_class=8)
    make_shards(tmp_path / "shards", shards=4, per_shard=8, prefix="train")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("argv", _commands(), ids=lambda argv: " ".join(argv)[:60])
def test_a_readme_command_parses_and_a_training_command_dry_runs(argv, readme_data, capsys):
    if argv[0] == "slurm":  # its own flags, then train's, checked as the script is written
        code = main(argv)
        out = capsys.readouterr()
        assert code == 0, out.err
        assert "#SBATCH --nodes=2" in out.out and "paratrain train" in out.out
        return
    args = build_parser().parse_args(argv)  # exits 2 on a flag it does not know
    if argv[0] == "train":
        cfg = resolve_train_args(args)  # every value checked, as before a run
        if needs_network(cfg):
            return
        code = main([*argv, "--dry-run"])
        out = capsys.readouterr()
        assert code == 0, out.err
        assert "global batch" in out.out
    else:
        assert args.command == argv[0]
