"""The machinery of the settings schema: a setting is declared once, as a dataclass field.

``setting(default, help, ...)`` puts a :class:`Rule` into the field's metadata: its help,
its group, its bounds or choices, whether it names a file. From the fields of an options
dataclass come its command-line flags (cli.py), its YAML keys, its checks and their
one-line messages (:func:`check`), and the docs' flag reference (:func:`markdown_table`).
Nothing else restates a default or a list of choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from paratrain.errors import UserError


@dataclass(frozen=True)
class Rule:
    """What a setting accepts, and how it is offered on the command line."""

    help: str
    group: str = ""
    choices: tuple[str, ...] | None = None
    low: float | None = None  # bounds of a number
    high: float | None = None
    low_open: bool = False  # low itself not allowed
    high_open: bool = False
    pattern: str | None = None  # a string must match this regular expression
    pattern_text: str = ""  # what the pattern means, for messages
    path: str | None = None  # "file", "dir", "entry" (either), "data" (a dir, or a
    # scheme: hf:NAME, wds:PATTERN) or "weights" (a file, or a name: looks_like_file):
    # must exist (check_paths)
    auto: bool = False  # also accepts the word "auto"
    empty_ok: bool = False  # a string may be empty
    default_text: str = ""  # how the default reads when it is computed, not a value
    required: bool = False
    positional: bool = False
    nargs: str | None = None  # for positional lists ("+", "?")
    metavar: str | None = None
    hidden: bool = False  # internal: not in --help nor in the flag reference
    # choices kept by another package, as "module:attribute" (a mapping of name to its
    # one-line summary, or a sequence of names): --strategy's registry, parallel/__init__
    choices_from: str | None = None
    listed: bool = False  # a comma-separated list of the options (--logger a,b), not one
    # on --resume: "told" (may change; said), "quiet" (may change unremarked), "fixed"
    # (refused: resume_why says why), "fixed_mid_epoch" (refused inside an epoch: it
    # makes the epoch's order)
    resume: str = "told"
    resume_why: str = ""
    short: str | None = None  # a one-letter flag besides the long one (-b)
    aliases: tuple[str, ...] = ()  # other long flags for the same setting

    @property
    def options(self) -> tuple[str, ...] | None:
        """The accepted words: ``choices``, or those of ``choices_from``."""
        if self.choices_from is None:
            return self.choices
        return tuple(_provided(self.choices_from))

    @property
    def option_help(self) -> str:
        """Each word and what it means, where ``choices_from`` says."""
        if self.choices_from is None:
            return ""
        provided = _provided(self.choices_from)
        if not isinstance(provided, Mapping):
            return ""
        return "; ".join(f"{name}: {summary}" for name, summary in provided.items())


def _provided(path: str) -> Mapping[str, str] | Sequence[str]:
    """What "module:attribute" names (imported on first use)."""
    import importlib

    module, attribute = path.split(":")
    found: Mapping[str, str] | Sequence[str] = getattr(importlib.import_module(module), attribute)
    return found


def _names_a_source(data: str) -> bool:
    import importlib

    module, attribute = NAMES_A_SOURCE.split(":")
    return bool(getattr(importlib.import_module(module), attribute)(data))


OptionsT = TypeVar("OptionsT", bound="Options")


class Options:
    """What every options dataclass shares: ``validate()`` checks each setting against
    its rule, then the rules between settings (``combinations``)."""

    def validate(self: OptionsT) -> OptionsT:
        check(self)
        self.combinations()
        return self

    def combinations(self) -> None:
        """Rules between settings; a UserError naming the flags. None by default."""


def setting(default: Any, help: str, **rules: Any) -> Any:
    """A dataclass field that is a setting: its default and its :class:`Rule`."""
    rule = Rule(help=help, **rules)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"rule": rule})
    return field(default=default, metadata={"rule": rule})


@dataclass(frozen=True)
class Setting:
    """One declared setting of an options class, as the CLI and the checks see it."""

    name: str
    kind: type  # int, float, str, bool or list
    optional: bool  # None is a value
    default: Any
    rule: Rule

    @property
    def flag(self) -> str:
        """The command-line spelling: --image-size for image_size; a positional's own name."""
        return self.name if self.rule.positional else "--" + self.name.replace("_", "-")

    @property
    def flags(self) -> list[str]:
        """Every spelling on the command line: the short flag, the long one, aliases."""
        if self.rule.positional:
            return [self.name]
        return [*([self.rule.short] if self.rule.short else []), self.flag, *self.rule.aliases]

    def help_text(self) -> str:
        """The help line, the default appended from the declaration (never written into the help by hand)."""
        text = self.rule.help
        if self.rule.option_help:
            text = f"{self.rule.option_help}; {text}"
        if self.rule.default_text:
            return f"{text} (default: {self.rule.default_text})"
        if self.default is not None and self.default is not False and self.default not in ([], ""):
            return f"{text} (default {self.default})"
        return text


def settings(cls: type) -> Iterator[Setting]:
    """The declared settings of an options dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        rule = f.metadata.get("rule")
        if rule is None:
            continue
        kind, optional = _kind(hints[f.name])
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[operator]  # set where default is not
        yield Setting(f.name, kind, optional, default, rule)


def setting_of(cls: type, name: str) -> Setting:
    """The declared setting ``name`` of ``cls``."""
    for s in settings(cls):
        if s.name == name:
            return s
    raise KeyError(name)


def _kind(hint: Any) -> tuple[type, bool]:
    """(the type of a setting's values, whether None is one): ``int | Literal["auto"]``
    is an int that also takes the word auto (its rule says so)."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = typing.get_args(hint) if union else (hint,)
    optional = type(None) in options
    kinds = [
        typing.get_origin(o) or o
        for o in options
        if o is not type(None) and typing.get_origin(o) is not typing.Literal
    ]
    if not kinds:  # only literals: words
        return str, optional
    return kinds[0], optional


def describe(s: Setting) -> str:
    """What a setting accepts, in words: the end of "--flag must be ..."."""
    r = s.rule
    if r.options is not None and r.listed:
        words = "one or more of " + ", ".join(r.options) + ", comma-separated"
    elif r.options is not None:
        words = "one of " + ", ".join(r.options)
    elif r.pattern_text:
        words = r.pattern_text
    elif r.low is not None and r.high is not None:
        if r.low_open and r.high_open:
            words = f"between {_num(r.low)} and {_num(r.high)} (exclusive)"
        else:
            left, right = "(" if r.low_open else "[", ")" if r.high_open else "]"
            words = f"in {left}{_num(r.low)}, {_num(r.high)}{right}"
    elif r.low is not None:
        if r.low_open:
            words = "positive" if r.low == 0 else f"greater than {_num(r.low)}"
        else:
            words = f"at least {_num(r.low)}"
    elif r.high is not None:
        words = f"less than {_num(r.high)}" if r.high_open else f"at most {_num(r.high)}"
    elif s.kind is bool:
        words = "true or false"
    elif s.kind is int:
        words = "an integer"
    elif s.kind is float:
        words = "a finite number"
    else:
        words = "a non-empty string"
    if r.auto:
        words += ", or auto"
    return words


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def check_value(s: Setting, value: Any) -> None:
    """Raise a one-line UserError if ``value`` is not what ``s`` accepts."""
    if value is None:
        if s.rule.required:
            raise UserError(f"{s.flag} is required")
        if s.optional:
            return
    if s.rule.auto and value == "auto":
        return
    bad = UserError(f"{s.flag} must be {describe(s)}, got {value!r}")
    if s.kind is list:
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise bad
        if not all(v for v in value):
            raise UserError(f"{s.flag}: an empty name was given")
        return
    if s.kind is bool:
        if not isinstance(value, bool):
            raise bad
        return
    if s.kind in (int, float):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad
        if s.kind is int and not isinstance(value, int):
            raise bad
        if isinstance(value, float) and not math.isfinite(value):
            raise bad
        r = s.rule
        if r.low is not None and (value < r.low or (r.low_open and value == r.low)):
            raise bad
        if r.high is not None and (value > r.high or (r.high_open and value == r.high)):
            raise bad
        return
    if not isinstance(value, str):
        raise bad
    if not value and not s.rule.empty_ok:
        raise UserError(f"{s.flag} must not be empty")
    if s.rule.options is not None and s.rule.listed:
        if not all(word in s.rule.options for word in value.split(",")):
            raise bad
    elif s.rule.options is not None and value not in s.rule.options:
        raise bad
    if s.rule.pattern is not None and not re.fullmatch(s.rule.pattern, value):
        raise bad
    if "\0" in value:
        raise UserError(f"{s.flag} must not contain a NUL character")


def check(options: Any) -> None:
    """Every declared setting of ``options`` against its rule (values, not files)."""
    for s in settings(type(options)):
        check_value(s, getattr(options, s.name))


# whether --data names a source by its prefix (hf:, wds:, ...), each source declaring its own
NAMES_A_SOURCE = "paratrain.data.sources.base:names_a_source"
WEIGHTS_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".tar")


def looks_like_file(weights: str) -> bool:
    """Whether --weights names a file (else a name its model's registry resolves:
    DEFAULT, IMAGENET1K_V2, pretrained, timm/resnet50.a1_in1k)."""
    path = Path(weights).expanduser()
    if weights.startswith("timm/") and not path.exists():
        return False
    return (
        path.exists()
        or "/" in weights
        or os.sep in weights
        or weights.startswith(("~", "."))
        or path.suffix.lower() in WEIGHTS_SUFFIXES
    )


def check_paths(options: Any) -> None:
    """Settings that name a file or folder: it must be there (the auto word aside)."""
    for s in settings(type(options)):
        value = getattr(options, s.name)
        if value is None or (s.rule.auto and value == "auto") or s.rule.path is None:
            continue
        if s.rule.path == "data" and _names_a_source(value):
            continue  # a dataset name or a shard pattern: its source checks it
        if s.rule.path == "weights" and not looks_like_file(value):
            continue  # a name: models/pretrained.py resolves it
        path = Path(value).expanduser()
        if s.rule.path in ("file", "weights") and not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise UserError(f"{s.flag} file {what}: {value}")
        if s.rule.path == "entry" and not path.exists():
            raise UserError(f"{s.flag} does not exist: {value}")
        if s.rule.path in ("dir", "data") and not path.is_dir():
            what = "is a file, not a directory" if path.exists() else "does not exist"
            raise UserError(f"{s.flag} directory {what}: {value}")


def coerce(s: Setting, value: Any, source: str) -> Any:
    """A value from YAML or Python as the setting's type (an int is a fine float)."""
    if value is None and (s.optional or s.rule.required):
        return None
    if s.rule.auto and value == "auto":
        return value
    if s.kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if s.kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if s.kind is list and isinstance(value, list):
        return value
    if s.kind in (str, bool) and isinstance(value, s.kind):
        return value
    raise UserError(
        f"{source}: {s.name} has the wrong type ({type(value).__name__}: {value!r}); "
        f"expected {describe(s)}"
    )


def coerce_all(
    cls: type, values: Mapping[str, Any], source: str, checked: bool = False
) -> dict[str, Any]:
    """``values`` checked against ``cls``'s settings: unknown keys and wrong types are
    UserErrors; the result holds exactly the keys given. ``checked``: each value is also
    held to its rule here, so a bad one is named with ``source`` (a file) rather than
    as the flag the user did not type."""
    if not isinstance(values, Mapping):
        raise UserError(f"{source}: expected a mapping of settings")
    declared = {s.name: s for s in settings(cls)}
    for key in values:
        if not isinstance(key, str) or key not in declared:
            close = difflib.get_close_matches(str(key), declared, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise UserError(f"{source}: unknown key {key!r}{hint}")
    coerced = {k: coerce(declared[k], v, source) for k, v in values.items()}
    for key, value in coerced.items() if checked else ():
        try:
            check_value(declared[key], value)
        except UserError as exc:
            told = str(exc).replace(declared[key].flag, key, 1)
            raise UserError(f"{source}: {told}") from None
    return coerced


def build(cls: type, values: Mapping[str, Any], source: str = "arguments") -> Any:
    """An options object from the values given; the rest take their defaults."""
    return cls(**coerce_all(cls, values, source))


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file of settings, as given (no defaults filled in)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        values = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: not valid YAML ({exc.__class__.__name__})") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise UserError(f"{path}: expected a mapping of settings, got {type(values).__name__}")
    return values


def to_argv(options: Any, only: tuple[str, ...] | None = None) -> list[str]:
    """The flags that make ``options`` again (every value that is not the default):
    what launched workers are given."""
    argv: list[str] = []
    for s in settings(type(options)):
        if (only is not None and s.name not in only) or s.rule.positional:
            continue
        value = getattr(options, s.name)
        if value == s.default or value is None:
            continue
        if s.kind is bool:
            argv += [s.flag] if value else []
        else:
            argv += [s.flag, repr(value) if isinstance(value, float) else str(value)]
    return argv


def markdown_table(cls: type, group: str | None = None, names: tuple[str, ...] = ()) -> str:
    """The flag reference's table of ``cls``'s flags (one group, or the names given)."""
    rows = ["| flag | default | what it does |", "| --- | --- | --- |"]
    for s in settings(cls):
        if s.rule.hidden or (group is not None and s.rule.group != group):
            continue
        if names and s.name not in names:
            continue
        if s.rule.positional:
            flag = (s.rule.metavar or s.name.upper()) + (" ..." if s.rule.nargs == "+" else "")
        else:
            flag = s.flag if s.kind is bool else f"{s.flag} {_metavar(s)}"
        default = s.rule.default_text or (
            "" if s.default is None or s.default is False or s.default == [] else str(s.default)
        )
        cells = [f"`{flag.strip()}`", default, s.rule.help]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def _metavar(s: Setting) -> str:
    if s.rule.metavar:
        return s.rule.metavar
    if s.rule.options:
        return "|".join(s.rule.options)
    return {int: "N", float: "X"}.get(s.kind, s.name.upper())
