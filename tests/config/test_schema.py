"""The settings schema: each setting declared once, and everything made from it agrees."""

from __future__ import annotations

import ast
import contextlib
import io
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from imagefolders import make_image_folder
from paratrain.cli import COMMANDS, build_parser, flag_reference, main, resolve_train_args
from paratrain.config import PRESETS, TrainConfig, resolve_train, settings
from paratrain.config.schema import describe
from paratrain.engine.run.schedule import describe_schedule
from paratrain.errors import UserError
from paratrain.parallel import STRATEGIES

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "paratrain"


def _subparser(name: str):
    parser = build_parser()
    return parser._subparsers._group_actions[0].choices[name]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_flag_of_every_command_is_a_declared_setting(name):
    command = COMMANDS[name]
    declared = {f for s in settings(command.options) for f in s.flags}
    declared |= {
        f for s in settings(TrainConfig) if s.name in command.train_settings for f in s.flags
    }
    offered = set()
    for action in _subparser(name)._actions:
        if action.dest == "help":
            continue
        offered |= set(action.option_strings) or {action.dest}
    assert offered == declared


def test_the_docs_flag_reference_is_made_from_the_schema():
    """docs/reference.md holds only the markers; the docs hook fills them from the schema,
    so the built page is flag_reference() whatever the file held before."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "flag_reference_hook", ROOT / "docs" / "hooks" / "flag_reference.py"
    )
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = (ROOT / "docs" / "reference.md").read_text()
    assert hook.START in page and hook.END in page, "docs/reference.md lost its markers"
    stale = page.replace(hook.START, hook.START + "\n| stale | table |\n")
    built = hook.on_page_markdown(stale, page=None)
    assert built.split(hook.START, 1)[1].split(hook.END, 1)[0] == "\n" + flag_reference()
    assert "| stale | table |" not in built
    assert "`--batch-size N`" in built or "--batch-size" in built


def _string_sequences(tree: ast.AST) -> list[tuple[int, frozenset[str]]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Tuple | ast.List | ast.Set) and len(node.elts) >= 2:
            if all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts):
                found.append((node.lineno, frozenset(e.value for e in node.elts)))
    return found


def test_choices_and_defaults_are_written_once():
    every = [s for command in COMMANDS.values() for s in settings(command.options)]
    every += list(settings(TrainConfig))
    choices = {frozenset(s.rule.choices) for s in every if s.rule.choices}
    for path in SRC.rglob("*.py"):
        if "config" in path.relative_to(SRC).parts[:1]:
            continue
        text = path.read_text()
        for line, values in _string_sequences(ast.parse(text)):
            assert values not in choices, f"{path}:{line} restates the choices {sorted(values)}"
        assert "(default " not in text, f"{path} writes a default into a help text"
    for s in every:
        assert "default" not in s.rule.help.lower(), f"{s.flag}: the schema appends the default"


def test_strategy_names_are_the_strategy_table():
    from paratrain.parallel.base import get

    strategy = next(s for s in settings(TrainConfig) if s.name == "strategy")
    assert strategy.rule.options == tuple(STRATEGIES)  # --strategy takes the registry's names
    for name in STRATEGIES:
        assert get(name).name == name  # each module holds the strategy of its own name


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("data") / "d", classes=2, per_class=4)


@pytest.fixture(scope="module")
def large_folder(tmp_path_factory) -> Path:
    return make_image_folder(
        tmp_path_factory.mktemp("large") / "d", classes=2, per_class=4, size=(400, 300)
    )


def _other(value):
    """A valid value other than a preset's."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 3
    if isinstance(value, float):
        return round(value / 2, 6) if value else 0.25
    return {
        "resnet18": "resnet34",
        "linear": "cosine",
        "bilinear": "bicubic",
        "bicubic": "bilinear",
        "shifted": "resized",
        "0.485,0.456,0.406": "0.5,0.5,0.5",
        "0.229,0.224,0.225": "0.25,0.25,0.25",
    }[value]


def _resolved(argv: list[str]) -> TrainConfig:
    return resolve_train_args(build_parser().parse_args(["train", *argv]))


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_a_preset_fills_what_was_not_given_by_flag_or_by_file_alike(
    preset, folder, large_folder, tmp_path
):
    trigger = {
        "adamw": {"opt": "adamw", "data": str(folder)},
        "digits": {},
        "weights": {"model": "resnet50", "weights": "IMAGENET1K_V2", "data": str(folder)},
        "small images": {"data": str(folder)},  # 40x30 images: trained at 32 px
        "large images": {"data": str(large_folder), "image_size": 32},  # cached at 114
        "budget": {"data": str(folder), "budget": "90s"},
    }[preset.name]
    trigger_flags = [x for k, v in trigger.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    left_out = _resolved(trigger_flags)
    offered = preset.values_for(left_out.to_dict())
    assert offered
    for key, preset_value in offered.items():
        assert getattr(left_out, key) == preset_value, key
        value = _other(preset_value)
        by_flag = _resolved([*trigger_flags, f"--{key.replace('_', '-')}", str(value)])
        file = tmp_path / f"{key}.yaml"
        file.write_text(yaml.safe_dump({**trigger, key: value}))
        by_file = _resolved(["--config", str(file)])
        assert by_flag == by_file, key
        assert getattr(by_file, key) == value, key
    # the same through Python's entry point
    assert resolve_train(trigger) == left_out


def test_a_file_without_data_keeps_the_digits_preset(tmp_path):
    file = tmp_path / "run.yaml"
    file.write_text("epochs: 3\nopt: adamw\n")
    cfg = _resolved(["--config", str(file)])
    assert (cfg.epochs, cfg.image_size, cfg.batch_size) == (3, 16, 32)  # the rest: digits
    # adamw's rate over the digits': 0.001 for 16 images, so 0.002 at the digits' 32
    assert (cfg.rate(1), cfg.weight_decay) == (0.002, 0.05)


def test_a_saved_config_reruns_exactly(folder, tmp_path):
    cfg = _resolved(["--data", str(folder), "--opt", "adamw", "--epochs", "2"])
    cfg.save(tmp_path / "config.yaml")
    assert _resolved(["--config", str(tmp_path / "config.yaml")]) == cfg


def test_unknown_keys_name_the_closest_setting(tmp_path):
    file = tmp_path / "bad.yaml"
    file.write_text("batchsize: 3\n")
    with pytest.raises(UserError, match="unknown key 'batchsize' \\(did you mean batch_size\\?\\)"):
        _resolved(["--config", str(file)])


@pytest.mark.parametrize(
    "text, told",
    [
        ("lr: -1\n", "lr must be positive, or auto, got -1.0"),
        ("opt: bogus\n", "opt must be one of sgd, adamw, lars, lamb, got 'bogus'"),
        ("epochs: 1.5\n", "epochs has the wrong type (float: 1.5)"),
        ("batchsize: 3\n", "unknown key 'batchsize'"),
    ],
)
def test_a_bad_value_in_a_file_is_named_with_the_file(tmp_path, text, told):
    file = tmp_path / "run.yaml"
    file.write_text(text)
    for flag in ("--config", "--recipe"):
        with pytest.raises(UserError) as raised:
            _resolved([flag, str(file)])
        assert str(raised.value).startswith(f"{flag} {file}: {told}")
    with pytest.raises(UserError, match="^--lr must be positive"):
        _resolved(["--lr", "-1"])  # a flag is named as the flag


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["train", "--momentum", "-0.5"], ["--momentum", "-0.5", "in [0, 1)"]),
        (["train", "--weight-decay", "-1"], ["--weight-decay", "at least 0"]),
        (["train", "--split-seed", "-3"], ["--split-seed", "-3"]),
        (["train", "--timeout", "nan"], ["--timeout", "nan"]),
        (["train", "--timeout", "1e300"], ["--timeout", "in (0, 2592000]"]),
        (["train", "--lr", "inf"], ["--lr", "inf", "positive"]),
        (["train", "--name", "a/b"], ["--name", "a folder name"]),
        (["eval", "--checkpoint", "x.pt", "--workers", "-1"], ["--workers", "-1"]),
        (["predict", "--checkpoint", "x.pt", "--batch-size", "0", "y.jpg"], ["--batch-size", "0"]),
        (["predict", "--checkpoint", "x.pt", "--batch-size", "-1", "y.jpg"], ["--batch-size"]),
        (["plan", "--device-memory", "8GB", "--microbatches", "0"], ["--microbatches", "0"]),
        (["plan", "--device-memory", "8GB", "--devices", "0"], ["--devices", "0"]),
        (["plan", "--device-memory", "lots"], ["--device-memory", "'lots'"]),
        (["scale", "--nproc-max", "0"], ["--nproc-max", "0"]),
        (["bench", "--steps", "0"], ["--steps", "0"]),
        (["check", "--nproc", "0"], ["--nproc", "0"]),
        (["slurm", "--epochs", "0", "--data", "D"], ["--epochs", "0"]),
        (["slurm", "--time", "tomorrow"], ["--time", "a SLURM time"]),
        (["runs", "/nowhere/at/all"], ["no such run folder: /nowhere/at/all"]),
        (["train", "--device", "cuda:99", "--dry-run"], ["--device cuda:99"]),  # any machine
        (["bench", "--device", "cuda:99", "--dry-run"], ["--device cuda:99"]),
        (
            ["train", "--model", "vit_b_32", "--image-size", "16", "--dry-run"],
            ["vit_b_32", "16px", "the smallest --image-size it takes is 32"],
        ),
        (
            ["train", "--model", "alexnet", "--image-size", "32", "--dry-run"],
            ["smallest --image-size it takes is 63"],
        ),
        (
            [
                "train",
                "--model",
                "resnet18",
                "--image-size",
                "32",
                "--batch-size",
                "1",
                "--dry-run",
            ],
            ["resnet18", "one image at a time", "2 or more", "--image-size of at least 33"],
        ),
        (
            [
                *("train", "--model", "resnet18", "--image-size", "32", "--dry-run"),
                *("--strategy", "pipeline", "--nproc", "2", "--batch-size", "4"),
                *("--microbatches", "4"),
            ],
            ["one image at a time", "per micro-batch"],
        ),
    ],
)
def test_a_bad_value_is_one_line_naming_flag_value_and_what_is_allowed(argv, needles, tmp_path):
    code, _, err = _run(argv)
    _one_line_error(code, err, *needles)


def test_a_batch_of_one_is_refused_only_where_batchnorm_would_see_one_value(tmp_path):
    common = ["train", "--model", "resnet18", "--batch-size", "1", "--dry-run"]
    code, _, err = _run([*common, "--image-size", "64"])  # a 2x2 map at the end: 4 values
    assert code == 0, err
    code, _, err = _run([*common, "--image-size", "32", "--nproc", "2", "--sync-bn"])
    assert code == 0, err  # SyncBN: both ranks' images together


def test_more_cpu_processes_than_cores_is_warned_in_the_dry_run(folder, monkeypatch):
    from paratrain.distributed import runtime

    monkeypatch.setattr(runtime, "usable_cores", lambda: 2)
    common = ["train", "--data", str(folder), "--image-size", "32", "--device", "cpu"]
    common += ["--dry-run"]
    code, out, err = _run([*common, "--nproc", "3"])
    assert code == 0, err
    assert "  warning: --nproc 3 on 2 CPU core(s): the processes take turns" in out
    code, out, err = _run([*common, "--nproc", "2"])
    assert code == 0 and "warning" not in out + err


def test_norm_batch_counts_the_images_one_batchnorm_sees():
    from paratrain.parallel.base import get

    def seen(world: int, gpus: int = 0, **values) -> int:
        cfg = TrainConfig(**values)
        return get(cfg.strategy).norm_batch(cfg, world, gpus)

    assert seen(4, batch_size=8) == 8
    assert seen(4, batch_size=8, sync_bn=True) == 32
    assert seen(4, batch_size=8, sync_bn=True, strategy="fsdp") == 32
    assert seen(2, batch_size=8, strategy="pipeline", microbatches=4) == 2
    assert seen(1, 2, batch_size=5, strategy="dp") == 2  # 3 + 2
    assert seen(1, 3, batch_size=7, strategy="dp") == 1  # 3+3+1
    assert seen(1, batch_size="auto") == 2  # decided later


def test_messages_say_what_is_allowed():
    s = {x.name: x for x in settings(TrainConfig)}
    assert describe(s["val_fraction"]) == "between 0 and 1 (exclusive)"
    assert describe(s["hflip"]) == "in [0, 1]"
    assert describe(s["lr"]) == "positive, or auto"
    assert describe(s["opt"]) == "one of sgd, adamw, lars, lamb"
    assert describe(s["resume"]).endswith(", or auto")


def test_dry_run_checks_and_describes_without_running(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "cache"
    code, out, err = _run(
        [
            "train",
            "--data",
            str(folder),
            "--nproc",
            "2",
            "--dry-run",
            "--warmup-epochs",
            "1",
            "--cache-dir",
            str(cache),
        ]
    )
    assert code == 0, err
    assert "resolved config (what --config takes):" in out
    assert "  image_size: 32" in out  # the folder's 40x30 images: trained near their size
    assert out.index("would run:") < out.index("resolved config")  # the summary first
    assert "2 processes started here by torch's elastic launcher" in out
    assert "global batch: 32 (16 x 2 replica(s))" in out
    assert (
        "peak lr 0.02 (--lr-base 0.16 x global batch 32 / 256), warm-up 1 epoch(s) from 0.0002"
        in out
    )
    assert "decoded-image cache: would be built" in out
    assert not (tmp_path / "runs").exists() and not cache.exists()  # nothing written


def test_the_budgets_schedule_is_told_once_with_or_without_data(folder, tmp_path, monkeypatch):
    from paratrain.data.builtin import ensure_digits

    monkeypatch.chdir(tmp_path)
    ensure_digits(tmp_path)  # written: a dry run goes on to the checks
    for data in ([], ["--data", str(folder)]):  # the embedded digits' line tells the rest
        argv = ["train", *data, "--budget", "30s", "--dry-run", "--cache-dir", str(tmp_path)]
        code, out, err = _run(argv)
        assert code == 0, err
        told = (out + err).count("--budget: a schedule that falls to zero at its end")
        assert told == 1, out + err
        assert ("images are small" in out + err) == bool(data), out + err  # not the digits
        assert "linearly to 0 at the end of --budget 30s" in out


def test_the_start_line_gives_the_peak_rate_and_the_warm_up_apart():
    cfg = TrainConfig(
        lr_base=0.01, lr_base_size=16, batch_size=16, warmup_epochs=2, epochs=10, lrf=0.1
    )
    text = describe_schedule(cfg, 4)
    assert text == (
        "peak lr 0.04 (--lr-base 0.01 x global batch 64 / 16), warm-up 2 epoch(s) from 0.0004, "
        "cosine to 0.004 by epoch 10"
    )
    budgeted = describe_schedule(replace(cfg, sched="linear", lrf=0.0, budget="90s"), 4)
    assert budgeted.endswith("linearly to 0 at the end of --budget 90s (the epochs that "
                             "fit, measured in the first steps)")  # fmt: skip


def test_paratrain_alone_lists_its_commands_and_version_prints():
    code, out, _ = _run([])
    assert code == 0 and all(name in out for name in COMMANDS)
    code, out, _ = _run(["--version"])
    assert code == 0 and out.startswith("paratrain ")


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_has_help(name):
    code, out, _ = _run([name, "--help"])
    assert code == 0 and out.startswith("usage: paratrain")


def test_an_error_every_rank_raised_is_told_by_rank_0_while_the_others_wait(monkeypatch, capsys):
    """Seen once under load: rank 1 ended first with exit 2, the launcher stopped rank 0
    before its line was out, and the run ended with exit 2 and nothing said. The other
    ranks now wait for rank 0 (whose end has the launcher stop them)."""
    from paratrain import cli
    from paratrain.errors import AgreedUserError

    waited: list[float] = []
    monkeypatch.setattr(cli.time, "sleep", waited.append)

    def agreed() -> int:
        raise AgreedUserError("--split-points: 'layer9' does not begin a unit")

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert cli._guarded(agreed) == 2
    assert waited == [cli.AGREED_GRACE] and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert cli._guarded(agreed) == 2
    assert waited == [cli.AGREED_GRACE]  # rank 0 does not wait: it tells
    assert capsys.readouterr().err.count("--split-points: 'layer9'") == 1
