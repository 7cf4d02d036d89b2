"""A strategy is one object that owns all of its knowledge (parallel/<name>.py): nothing
outside parallel/ asks for one by name, and each answers every question the rest asks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from paratrain.config import TrainConfig
from paratrain.errors import UserError
from paratrain.parallel import STRATEGIES
from paratrain.parallel.base import Layout, get

SRC = Path(__file__).resolve().parents[2] / "src" / "paratrain"


def _mentions_strategy(node: ast.AST) -> bool:
    return any(
        (isinstance(n, ast.Attribute) and n.attr == "strategy")
        or (isinstance(n, ast.Name) and n.id == "strategy")
        for n in ast.walk(node)
    )


def _names(node: ast.AST) -> set[str]:
    return {
        n.value
        for n in ast.walk(node)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in STRATEGIES
    }


def test_nothing_outside_parallel_branches_on_a_strategys_name():
    found = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "parallel":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(SRC)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Compare) and _mentions_strategy(node):
                words = {
                    n.value
                    for n in ast.walk(node)
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)
                }
                if words - {"auto"}:  # auto is not a strategy: it asks for one to be chosen
                    found.append(f"{where} compares the strategy with {sorted(words)}")
            elif isinstance(node, ast.Compare) and _names(node):
                found.append(f"{where} compares with strategy names {sorted(_names(node))}")
            elif isinstance(node, ast.Dict):
                keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
                if len(keys & set(STRATEGIES)) >= 2:
                    found.append(f"{where} dispatches on strategy names {sorted(keys)}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_answers_every_question(name):
    strategy = get(name)
    cfg = TrainConfig(strategy=name, batch_size=8, microbatches=2, devices="cpu,cpu")
    world = 1 if strategy.one_process else 4
    strategy.check_settings(cfg, world)
    layout = strategy.layout(cfg, world, rank=world - 1, per_node=2)
    assert layout.world == world and 0 <= layout.dp_rank < layout.dp_size
    assert strategy.norm_batch(cfg, world) >= 2
    assert strategy.why and strategy.speed_order >= 0


def test_layouts_say_which_rank_reads_which_batch():
    ddp, fsdp, hsdp, pipeline = (get(n) for n in ("ddp", "fsdp", "hsdp", "pipeline"))
    cfg = TrainConfig(stages=2, microbatches=2)
    assert ddp.layout(cfg, 4, 3) == Layout(4, 3, replicate=4)
    assert fsdp.layout(cfg, 4, 3).dp_size == 4  # every rank its own batches, shared weights
    assert hsdp.layout(cfg, 4, 3, per_node=2) == Layout(4, 3, replicate=2, shard=2)
    piped = pipeline.layout(cfg, 4, 3)
    assert (piped.dp_size, piped.dp_rank, piped.stage) == (2, 1, 1)
    assert piped.stage_ranks(1) == [2, 3] and piped.dp_ranks(0) == [0, 2]
    with pytest.raises(ValueError):
        Layout(4, 0, replicate=3)


def test_a_strategy_refuses_what_it_does_not_take_in_one_line():
    with pytest.raises(UserError, match="--ema-decay works with --strategy ddp, dp, not fsdp"):
        get("fsdp").check_settings(TrainConfig(strategy="fsdp", ema_decay=0.9), 2)
    with pytest.raises(UserError, match="--sync-bn works with --strategy ddp, fsdp, hsdp"):
        get("pipeline").check_settings(TrainConfig(strategy="pipeline", sync_bn=True), 2)
    with pytest.raises(UserError, match="--strategy hsdp: 6 processes are not whole nodes of 4"):
        get("hsdp").layout(TrainConfig(), 6, per_node=4)
    with pytest.raises(UserError, match="start 2 or more"):
        get("hsdp").check_settings(TrainConfig(strategy="hsdp"), 1)
    with pytest.raises(
        UserError,
        match="--activation-checkpointing works with --strategy ddp, fsdp, hsdp, not pipeline",
    ):
        get("pipeline").check_settings(
            TrainConfig(strategy="pipeline", activation_checkpointing=True), 2
        )
    blocks = TrainConfig(strategy="dp", compile=True, compile_scope="blocks")
    with pytest.raises(UserError, match="--compile-scope blocks does not work with --strategy dp"):
        get("dp").check_settings(blocks, 1)
    get("dp").check_settings(TrainConfig(strategy="dp", compile=True), 1)  # model: taken


@pytest.mark.parametrize("name", ["fsdp", "hsdp"])
def test_a_sharded_strategy_in_one_process_names_the_one_process_way(name):
    """--strategy fsdp --nproc 1 is refused, and says what runs in one process; on a
    resume, that ddp takes the sharded checkpoint (resharded on load)."""
    with pytest.raises(UserError) as fresh:
        get(name).check_settings(TrainConfig(strategy=name), 1)
    assert str(fresh.value).endswith("or in one process use --strategy ddp")
    with pytest.raises(UserError) as resumed:
        get(name).check_settings(TrainConfig(strategy=name, resume="runs/x"), 1)
    assert str(resumed.value).endswith(
        "or in one process use --strategy ddp (it resumes this run's checkpoint, resharded)"
    )
