"""Sharded checkpoints (fsdp, pipeline) through torch.distributed.checkpoint: each rank
writes its own shards, and loading reshards: fsdp at 2 processes into fsdp again, into
a pipeline of 2 stages, and consolidated into one process, each holding the same model
and optimizer state as the run that saved it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from paratrain.config import TrainConfig
from paratrain.distributed.env import detect
from paratrain.distributed.runtime import Runtime
from paratrain.engine.checkpointing.checkpoint import load
from paratrain.engine.run.recipe import build_optimizer
from paratrain.models.registry import build_model
from paratrain.parallel import optim_state, sharded
from paratrain.parallel.parallelize import parallelize
from spawn import run_distributed

pytestmark = pytest.mark.slow
SIZE, CLASSES, BATCH = 32, 4, 8


def _cfg(strategy: str, **extra) -> TrainConfig:
    return TrainConfig(
        model="resnet18",
        image_size=SIZE,
        precision="32",
        lr=0.05,
        seed=5,
        batch_size=BATCH,
        strategy=strategy,
        microbatches=2,
        memory_format="contiguous",
        **extra,
    )


def _parts(cfg: TrainConfig):
    runtime = Runtime(env=detect(os.environ), device=torch.device("cpu"), backend="gloo")
    parts = parallelize(build_model(cfg, CLASSES), cfg, runtime)
    return parts, build_optimizer(parts, cfg, parts.replicas)


def _train_steps(parts, optimizer, steps: int = 2) -> None:
    generator = torch.Generator().manual_seed(11)
    parts.train()
    for _ in range(steps):
        x = torch.randn(BATCH, 3, SIZE, SIZE, generator=generator)
        y = torch.randint(0, CLASSES, (BATCH,), generator=generator)

        class _Plain:
            def autocast(self):
                import contextlib

                return contextlib.nullcontext()

            def backward(self, loss):
                loss.backward()

        parts.forward_backward(x, y, torch.nn.CrossEntropyLoss(), _Plain(), 1)
        parts.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _save_fsdp(rank: int, world: int, folder: str) -> dict:
    parts, optimizer = _parts(_cfg("fsdp"))
    _train_steps(parts, optimizer)
    sharded.save(Path(folder), parts, optimizer, {"epoch": 1, "config": {}, "classes": []})
    # the whole state the old way (gathered), to compare against
    return {"model": parts.state_dict(), "optimizer": parts.optimizer_state_dict(optimizer)}


def _load(rank: int, world: int, folder: str, strategy: str) -> dict:
    parts, optimizer = _parts(_cfg(strategy))
    state = sharded.read_state(Path(folder))
    sharded.load_into(Path(folder), parts, optimizer, state["optimizer_groups"])
    loaded = {
        "model": {k: v.clone() for k, v in parts.state_dict().items()},
        "optimizer": parts.optimizer_state_dict(optimizer),
    }
    _train_steps(parts, optimizer, steps=1)  # trains on, and saves again
    sharded.save(Path(folder).with_name(f"again-{strategy}"), parts, optimizer, state)
    return loaded


def test_fsdp_saves_shards_and_loads_into_fsdp_pipeline_and_one_process(tmp_path):
    folder = tmp_path / "last"
    saved = run_distributed(_save_fsdp, 2, str(folder))[0]
    assert len(list(folder.glob("*.distcp"))) == 2  # each rank wrote its own shards
    assert (folder / sharded.STATE).is_file()
    whole = sum(t.numel() * t.element_size() for t in saved["model"].values())
    biggest = max(p.stat().st_size for p in folder.glob("*.distcp"))
    assert biggest < 0.75 * 2 * whole  # no rank wrote the whole model and optimizer

    for strategy in ("fsdp", "pipeline"):
        loaded = run_distributed(_load, 2, str(folder), strategy)[0]
        for key, value in saved["model"].items():
            torch.testing.assert_close(loaded["model"][key], value, rtol=0, atol=0, msg=key)
        for index, slots in saved["optimizer"]["state"].items():
            for slot, value in slots.items():
                got = loaded["optimizer"]["state"][index][slot]
                torch.testing.assert_close(got, value, rtol=0, atol=0, msg=f"{index} {slot}")

    consolidated = load(folder)  # one process, no process group
    for key, value in saved["model"].items():
        torch.testing.assert_close(consolidated.model[key], value, rtol=0, atol=0)
    assert consolidated.optimizer["state"].keys() == saved["optimizer"]["state"].keys()
    for index, slots in saved["optimizer"]["state"].items():
        torch.testing.assert_close(
            consolidated.optimizer["state"][index]["momentum_buffer"], slots["momentum_buffer"]
        )
    assert consolidated.optimizer["param_groups"][0]["params"] == list(
        range(len(optim_state.trainable_names(build_model(_cfg("ddp"), CLASSES))))
    )


def test_a_checkpoint_folder_that_would_run_code_is_refused(tmp_path):
    import pickle

    from paratrain.errors import UserError

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(Evil()))
    torch.save({"sharded": True, "optimizer_groups": []}, folder / sharded.STATE)
    with pytest.raises(UserError, match="not loaded \\(nothing in it ran\\)"):
        load(folder)
    assert not (tmp_path / "ran").exists()


def _save(rank: int, world: int, folder: str, strategy: str) -> dict:
    parts, optimizer = _parts(_cfg(strategy))
    _train_steps(parts, optimizer)
    sharded.save(Path(folder), parts, optimizer, {"epoch": 1, "config": {}, "classes": []})
    return {"model": parts.state_dict(), "optimizer": parts.optimizer_state_dict(optimizer)}


def test_a_pipeline_checkpoint_loads_into_fsdp_which_saves_again(tmp_path):
    folder = tmp_path / "pipe"
    saved = run_distributed(_save, 2, str(folder), "pipeline")[0]
    loaded = run_distributed(_load, 2, str(folder), "fsdp")[0]
    for key, value in saved["model"].items():
        torch.testing.assert_close(loaded["model"][key], value, rtol=0, atol=0, msg=key)
    for index, slots in saved["optimizer"]["state"].items():
        torch.testing.assert_close(
            loaded["optimizer"]["state"][index]["momentum_buffer"], slots["momentum_buffer"]
        )


def _save_fsdp_in_background(rank: int, world: int, folder: str) -> dict:
    """A background save, then a step that changes every weight before it is finished:
    the folder holds the weights as they were when the save returned."""
    parts, optimizer = _parts(_cfg("fsdp"))
    _train_steps(parts, optimizer)
    saved = {"model": {k: v.clone() for k, v in parts.state_dict().items()}}
    rest = {"lr": 0.125, "config": {}, "classes": []}
    pending = sharded.save_async(Path(folder), parts, optimizer, rest)
    _train_steps(parts, optimizer, steps=1)
    written_before = (Path(folder) / sharded.STATE).exists()
    pending.finish()
    return {**saved, "state_before_finish": written_before}


def test_a_background_fsdp_save_keeps_the_weights_of_when_it_returned(tmp_path):
    folder = tmp_path / "last"
    saved = run_distributed(_save_fsdp_in_background, 2, str(folder))[0]
    assert not saved["state_before_finish"]  # the folder moves into place once finished
    assert len(list(folder.glob("*.distcp"))) == 2
    consolidated = load(folder)
    assert consolidated.lr == 0.125 and consolidated.sharded
    for key, value in saved["model"].items():
        torch.testing.assert_close(consolidated.model[key], value, rtol=0, atol=0, msg=key)
