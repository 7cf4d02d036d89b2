"""The `paratrain` command: flags made from the settings schema, one api call a command.

Nothing here trains, evaluates or formats a result: each subcommand's flags come from
its options class (config/), the values the user gave become those options, and one
function of ``paratrain.api`` does the rest.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import yaml

from paratrain.config import (
    BENCH_SETTINGS,
    PLAN_SETTINGS,
    STEP_SETTINGS,
    BenchOptions,
    CheckOptions,
    EvalOptions,
    ExportOptions,
    ModelsOptions,
    PlanOptions,
    PredictOptions,
    RecipesOptions,
    RunsOptions,
    ScaleOptions,
    SlurmOptions,
    TrainCommand,
    TrainConfig,
    build,
    read_yaml,
    resolve_train,
    settings,
)
from paratrain.config.schema import Setting, coerce_all
from paratrain.config.train import migrate_settings, read_recipe
from paratrain.errors import UserError
from paratrain.log import mark_start
from paratrain.version import __version__

# seconds a rank other than 0 waits, after an error every rank raised, for rank 0 to
# tell it and end (its end stops the wait: the launcher then ends the other ranks)
AGREED_GRACE = 10.0
S = argparse.SUPPRESS  # a flag the user did not give stays absent: defaults and presets fill it


@dataclass(frozen=True)
class Command:
    help: str
    options: type  # the command's own options
    train_settings: tuple[str, ...] = ()  # TrainConfig settings it takes too
    description: str = ""


TRAIN_SETTINGS = tuple(s.name for s in settings(TrainConfig))

COMMANDS: dict[str, Command] = {
    "train": Command("train a classifier on an image folder", TrainCommand, TRAIN_SETTINGS),
    "eval": Command("evaluate a checkpoint on the validation images", EvalOptions),
    "predict": Command("class probabilities for images or folders of images", PredictOptions),
    "export": Command(
        "write a checkpoint as a torch.export program, ONNX or safetensors", ExportOptions
    ),
    "runs": Command("a table of the runs in a folder", RunsOptions),
    "models": Command("list the model names --model accepts", ModelsOptions),
    "recipes": Command("list the shipped recipes --recipe NAME takes", RecipesOptions),
    "bench": Command(
        "training-step speed on synthetic data: images/s, time per phase",
        BenchOptions,
        BENCH_SETTINGS,
    ),
    "scale": Command(
        "scaling report: measure 1..N processes, fit the link, predict larger clusters",
        ScaleOptions,
        STEP_SETTINGS,
        "Weak scaling measured at 1..N processes (images/s, speedup, efficiency), "
        "all-reduce latency and bandwidth fitted, and a ring all-reduce cost model that "
        "predicts N = 1 to 1024 on a link preset or given values. With --calibrate, your "
        "own epoch times are fitted instead and nothing is measured.",
    ),
    "plan": Command(
        "memory per device for ddp, fsdp, pipeline and split; which fit, which to use",
        PlanOptions,
        PLAN_SETTINGS,
        "Estimates, per device, the memory of parameters, gradients, optimizer state and "
        "activations (fp32) for every strategy, from one profiled step at batch 2 scaled to "
        "--batch-size; says which fit --device-memory and recommends the fastest that fits.",
    ),
    "slurm": Command(
        "print an sbatch script that runs `paratrain train` on SLURM nodes",
        SlurmOptions,
        (),
        "Print an sbatch script: srun starts one torchrun agent per node, c10d rendezvous "
        "on the first node, USR1 before the time limit saves and requeues. Every flag not "
        "listed here goes to `paratrain train`, and is checked now.",
    ),
    "check": Command("self-test: backends, collectives, SyncBatchNorm, bandwidth", CheckOptions),
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _parse_as(s: Setting) -> Callable[[str], object]:
    """The text of a flag as the setting's type; its bounds are the schema's to check."""
    kind = s.kind

    def parse(text: str) -> object:
        if s.rule.auto and text == "auto":
            return text
        if kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                word = "an integer" if kind is int else "a number"
                raise argparse.ArgumentTypeError(f"expected {word}, got {text!r}") from None
        return text

    return parse


def add_settings(
    parser: argparse.ArgumentParser, cls: type, names: Sequence[str] | None = None
) -> None:
    """One flag per setting of ``cls`` (those in ``names``), in its help group."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for s in settings(cls):
        if names is not None and s.name not in names:
            continue
        target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
        if s.rule.group:
            if s.rule.group not in groups:
                groups[s.rule.group] = parser.add_argument_group(s.rule.group)
            target = groups[s.rule.group]
        shown = S if s.rule.hidden else s.help_text()
        options = None if s.rule.listed else s.rule.options  # a list: the schema checks it
        metavar = s.rule.metavar or ("{" + ",".join(options) + "}" if options else None)
        if s.rule.positional:
            default = s.default if s.rule.nargs == "?" else S
            target.add_argument(
                s.name, nargs=s.rule.nargs, default=default, help=shown, metavar=metavar
            )
        elif s.kind is bool:
            target.add_argument(*s.flags, dest=s.name, action="store_true", default=S, help=shown)
        else:
            target.add_argument(
                *s.flags,
                dest=s.name,
                type=_parse_as(s),
                default=S,
                help=shown,
                choices=(*options, "auto") if options and s.rule.auto else options,
                metavar=metavar or s.name.upper(),
            )


def build_parser() -> _Parser:
    """The `paratrain` parser: one subcommand per COMMANDS entry, its flags made from the schema."""
    parser = _Parser(
        prog="paratrain",
        description="Train image classifiers in parallel with "
        "PyTorch: one CPU or GPU, several GPUs, or many machines.",
    )
    parser.add_argument("--version", action="version", version=f"paratrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.description or None)
        add_settings(p, command.options)
        if command.train_settings:
            add_settings(p, TrainConfig, command.train_settings)
    return parser


def flag_reference() -> str:
    """The flag reference, made from the schema: `train`'s flags by group, then every other
    command's (the docs hook fills docs/reference.md with it at build time)."""
    from paratrain.config.schema import markdown_table

    groups = list(dict.fromkeys(s.rule.group for s in settings(TrainConfig)))
    parts = ["### `paratrain train`", "", markdown_table(TrainCommand)]
    for group in groups:
        parts += ["", f"**{group}**", "", markdown_table(TrainConfig, group)]
    for name, command in COMMANDS.items():
        if name == "train":
            continue
        parts += ["", f"### `paratrain {name}`", "", command.help]
        if any(not s.rule.hidden for s in settings(command.options)):
            parts += ["", markdown_table(command.options)]
        if command.train_settings:
            flags = ", ".join(f"`--{n.replace('_', '-')}`" for n in command.train_settings)
            parts += ["", f"and these of `train`: {flags}"]
    return "\n".join(parts) + "\n"


def _given(args: argparse.Namespace, cls: type, names: Sequence[str] | None = None) -> dict:
    """The values the user gave for ``cls``'s settings (argparse left the rest out)."""
    picked = {}
    for s in settings(cls):
        if (names is None or s.name in names) and hasattr(args, s.name):
            picked[s.name] = getattr(args, s.name)
    return picked


def resolve_train_args(args: argparse.Namespace) -> TrainConfig:
    """`train`'s config from its parsed flags: the --config file's keys, the flags over
    them, presets for what neither gave."""
    config_file = getattr(args, "config", None)
    source = f"--config {config_file}"  # a wrong value in the file is named with it
    given = (
        coerce_all(TrainConfig, migrate_settings(read_yaml(config_file), source), source, True)
        if config_file
        else {}
    )
    recipe = getattr(args, "recipe", None)
    return resolve_train(
        {**given, **_given(args, TrainConfig)},
        recipe=read_recipe(recipe) if recipe else None,
        recipe_source=f"--recipe {recipe}",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the exit code (2 for a user's mistake, told in one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    mark_start()
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 0
    if argv[0] == "slurm":
        return _guarded(lambda: _slurm(argv[1:]))
    args = parser.parse_args(argv)
    return _guarded(lambda: _dispatch(args, argv))


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    from paratrain import api
    from paratrain.torch_api import check_torch

    check_torch()  # before any command imports what an older torch lacks
    command = COMMANDS[args.command]
    options = build(command.options, _given(args, command.options)).validate()
    if args.command == "train":
        cfg = resolve_train_args(args)
        if getattr(options, "print_config", False):
            print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
            return 0
        api.train(cfg, dry_run=options.dry_run)
        return 0
    if command.train_settings:  # bench, scale, plan: a training step's settings
        cfg = build(TrainConfig, _given(args, TrainConfig, command.train_settings)).validate()
        result = api.COMMANDS[args.command](cfg, options)
    else:
        result = api.COMMANDS[args.command](options)
    return result if isinstance(result, int) else 0  # check's verdict; the rest say theirs


def _slurm(argv: list[str]) -> int:
    """The script's own flags are slurm's; every other one goes to `paratrain train`,
    which checks them now, so a typo fails here and not after hours in the queue."""
    from paratrain import api
    from paratrain.torch_api import check_torch

    check_torch()
    parser = _Parser(prog="paratrain slurm", description=COMMANDS["slurm"].description)
    add_settings(parser, SlurmOptions)
    known, train_args = parser.parse_known_args(argv)
    train_parser = _Parser(prog="paratrain slurm")
    add_settings(train_parser, TrainCommand, ("config", "recipe"))
    add_settings(train_parser, TrainConfig)
    train = train_parser.parse_args(train_args)
    job = build(SlurmOptions, _given(known, SlurmOptions)).validate()
    return api.slurm(job, resolve_train_args(train), train_args)


def _guarded(call: Callable[[], int]) -> int:
    """Run a command; a user's mistake is one line and its exit code, never a traceback."""
    from paratrain.engine.run.preempt import Preempted

    try:
        return call()
    except UserError as exc:
        if not exc.agreed or os.environ.get("RANK", "0") == "0":
            _report(str(exc))  # an error every rank agreed on is told once, by rank 0
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # rank 0 tells it: a rank that ended first would have the launcher stop rank 0
            # before its line was out (seen once: exit 2 and nothing said); rank 0's end
            # stops this wait, as the launcher then ends the others
            time.sleep(AGREED_GRACE)
        return exc.exit_code
    except Preempted as exc:
        print(f"paratrain: {_where()}{exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:  # Ctrl-C reaches every rank: rank 0 tells it
        if os.environ.get("RANK", "0") == "0":
            print(f"paratrain: {exc or 'interrupted'}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:
        from paratrain.errors import DiskFull, is_disk_full

        if not is_disk_full(exc):  # a full disk at a write no caller named: still one line
            return _unexpected(exc)
        named = getattr(exc, "filename", None)
        _report(str(DiskFull(named)) if named else f"no space left on a disk: {exc}")
        return DiskFull.exit_code


def _unexpected(exc: Exception) -> int:
    """A lost peer told as a consequence; anything else with its traceback and rank."""
    from paratrain.distributed.launch import PEER_LOST, is_peer_loss

    if is_peer_loss(exc):  # a consequence of another rank's failure, not a cause
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(
            f"paratrain: error: {_where()}lost contact with another rank: {first}",
            file=sys.stderr,
        )
        return PEER_LOST
    # not the user's doing: keep the traceback, and say which rank it came from
    import traceback

    traceback.print_exc()
    print(f"paratrain: error: {_where()}{type(exc).__name__}: {exc}", file=sys.stderr)
    return 1


def _where() -> str:
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    return f"[rank {rank}] " if rank is not None and world not in (None, "1") else ""


def _report(message: str) -> None:
    print(f"paratrain: error: {_where()}{one_line(message)}", file=sys.stderr)


def one_line(message: str) -> str:
    """A UserError re-raised by a DataLoader worker carries the worker's traceback in its
    message; the user needs only the original message, its last line."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    if len(lines) > 1 and "Original Traceback" in message:
        last = lines[-1]
        return last.split(": ", 1)[1] if last.startswith(("paratrain.", "UserError")) else last
    return lines[0] if lines else message


def forked_worker(argv: list[str]) -> None:
    """A worker forked from the `paratrain` command's launcher (distributed/launch.py):
    what `python -m paratrain <argv>` does in a new interpreter. A failure ends the
    process at once with its code, as run() does; success returns to torch's launcher,
    which waits for every worker's return.

    Of forked workers torch's launcher reports one failure, the first it finds (where
    it reports every worker started afresh): a worker that failed because another rank
    went away (PEER_LOST) ends a while after it, so that the launcher finds and tells
    the cause first."""
    from paratrain.distributed.launch import MONITOR_S, PEER_LOST, as_forked_worker

    as_forked_worker()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = _code_of(exc)
    if code == PEER_LOST:
        time.sleep(4 * MONITOR_S)
    if code:
        _exit_now(code)
    _end_loader_workers()


def _end_loader_workers() -> None:
    """Kill the daemonic child processes a forked worker still has when its command
    has returned: loader workers whose loader outlived the run (persistent workers held
    by a reference cycle until a collection that never came). The process returns into
    multiprocessing's exit, which ends daemonic children with SIGTERM and then joins
    them; loader workers ignore SIGTERM (data/folder.leave_stop_signals_to_the_rank:
    it is their rank's to act on), so that join would wait for ever, and the launcher
    with it. Their work is done: every file is written by now."""
    import multiprocessing

    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()  # SIGKILL; one that has already ended is only reaped
            child.join()


def _code_of(exc: SystemExit) -> int:
    """A SystemExit's exit code (a message's: 1, none: 0)."""
    return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)


def _exit_now(code: int) -> None:
    """The process's end without Python's teardown, once what it wrote is out."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run() -> None:
    """The `paratrain` command and `python -m paratrain`: main(), then a prompt exit.

    By then every file is written and closed, so the process ends without Python's
    teardown, which takes 1.7 s once torch and torchvision are loaded (paid by every
    worker and by the launcher). A failed launched worker must end this way in any case:
    it leaves its process group open on purpose (its peers must not report a lost
    connection before it reports the cause), and tearing that down during shutdown can
    abort with "terminate called without an active exception"."""
    from paratrain import api
    from paratrain.log import mark_process_start

    mark_process_start()  # before anything else: its imports are the command's time too
    api.fork_into = forked_worker  # this process is the command: its workers may be forked
    try:
        code = main()
    except SystemExit as exc:  # argparse, or a launcher passing on its workers' code
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = _code_of(exc)
    _exit_now(code)
