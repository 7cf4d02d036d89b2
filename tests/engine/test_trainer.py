"""The loop's outline stays an outline: under 300 lines, and no branch in it on a single
feature (a setting, the budget, the EMA weights, the freezing, the trackers): each is
asked of the piece that owns it (engine/end.py, the recipe, the loggers)."""

from __future__ import annotations

import ast
from pathlib import Path

from paratrain.config import TrainConfig
from paratrain.config.schema import settings

TRAINER = Path(__file__).resolve().parents[2] / "src" / "paratrain" / "engine" / "trainer.py"
FEATURES = {"budget", "ema", "freezing", "active", "scaler", "mixer", "trackers", "planned"}


def _branches(tree: ast.AST) -> list[ast.expr]:
    return [
        node.test
        for node in ast.walk(tree)
        if isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert)
    ] + [
        cond for node in ast.walk(tree) if isinstance(node, ast.comprehension) for cond in node.ifs
    ]


def test_the_loop_is_an_outline_without_feature_branches():
    text = TRAINER.read_text()
    assert len(text.splitlines()) < 300
    named = {s.name for s in settings(TrainConfig)} | FEATURES
    found = []
    for test in _branches(ast.parse(text)):
        words = {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)}
        words |= {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
        if words & named:
            found.append(f"line {test.lineno}: {ast.unparse(test)}")
    assert not found, "\n".join(found)


def test_the_guard_sees_a_feature_branch():
    branchy = "if run.budget is not None:\n    pass\nwhile cfg.max_steps:\n    pass\n"
    words = [
        {n.attr for n in ast.walk(t) if isinstance(n, ast.Attribute)}
        for t in _branches(ast.parse(branchy))
    ]
    assert words == [{"budget"}, {"max_steps"}]
