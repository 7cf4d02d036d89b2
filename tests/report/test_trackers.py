"""A tracker is one module of report/trackers/ plus one registry line: nothing outside
that package names a tracker to dispatch on it, and each answers what the run asks
before opening it (its package, its extra, its server, what it writes)."""

from __future__ import annotations

import ast
import re
from importlib.metadata import requires
from pathlib import Path

import pytest

from paratrain.report.trackers import TRACKERS
from paratrain.report.trackers.base import TrackerKind, kind

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "paratrain"


def test_nothing_outside_the_trackers_package_dispatches_on_a_trackers_name():
    found = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "trackers":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(SRC)}:{getattr(node, 'lineno', '?')}"
            literals = {
                n.value
                for n in ast.walk(node)
                if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in TRACKERS
            }
            if isinstance(node, ast.Dict | ast.List | ast.Tuple | ast.Set) and len(literals) >= 2:
                found.append(f"{where} lists tracker names {sorted(literals)}")
            elif isinstance(node, ast.Compare) and literals and _about_loggers(node):
                found.append(f"{where} compares with tracker names {sorted(literals)}")
    assert not found, "\n".join(found)


def _extra(name: str) -> set[str]:
    """The distributions paratrain's extra ``name`` installs (from its metadata)."""
    found = set()
    for requirement in requires("paratrain") or []:
        if re.search(rf"extra == ['\"]{name}['\"]", requirement):
            found.add(re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower())
    return found


def _about_loggers(node: ast.Compare) -> bool:
    return any(
        isinstance(n, ast.Attribute | ast.Name)
        and getattr(n, "attr", getattr(n, "id", "")) in ("loggers", "logger", "name")
        for n in ast.walk(node)
    )


@pytest.mark.parametrize("name", list(TRACKERS))
def test_every_tracker_answers_what_the_run_asks(name):
    tracker = kind(name)
    assert isinstance(tracker, TrackerKind) and tracker.name == name
    assert callable(tracker.open) and tracker.writes  # each leaves a trace in the run folder
    assert (tracker.package is None) == (tracker.extra is None)
    if tracker.extra is not None:  # an extra of this package, also in the test extra
        wanted, tested = _extra(tracker.extra), _extra("test")
        assert wanted and wanted <= tested, (tracker.extra, wanted, tested)
    assert TRACKERS[name]  # a summary for --help


def test_an_unknown_tracker_name_is_a_key_error_naming_the_known_ones():
    with pytest.raises(KeyError, match="the trackers are tensorboard, mlflow"):
        kind("comet")


def test_a_run_folder_holding_only_what_trackers_opened_is_a_folder_that_trained_nothing():
    """run_dir removes a folder that trained nothing; what the trackers open before the
    first step comes from their registry entries, a new tracker's included."""
    from paratrain.engine.checkpointing.run_dir import STARTED_FILES

    for name in TRACKERS:
        assert set(kind(name).writes) <= STARTED_FILES
    assert "trackers.jsonl" in STARTED_FILES
