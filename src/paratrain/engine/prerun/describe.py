"""The description of a run: what `train --dry-run` prints and what a run says when it
starts, made by one function from the same facts.

The dry run finds the facts without running anything (the data listed, the cache
surveyed, the checkpoint --resume names read and checked); the run reads them off what
it built (its loaders, its cache, its model's parts).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import yaml

from paratrain.config import PRESETS, TrainConfig
from paratrain.data.folder import DataSplit
from paratrain.distributed.env import DistEnv
from paratrain.engine.run.schedule import describe_schedule
from paratrain.parallel.base import get as strategy_of
from paratrain.report.run_files import RunFacts, recipe_words


def _averaged(cfg: TrainConfig) -> TrainConfig:
    """--ema-decay auto said as off where it will keep no average (the decay itself is
    made concrete in the run, from its epoch's steps)."""
    from paratrain.engine.run.recipe import auto_keeps_average

    if cfg.ema_decay == "auto" and cfg.strategy != "auto" and not auto_keeps_average(cfg):
        return replace(cfg, ema_decay=0.0)
    return cfg


def run_facts(
    cfg: TrainConfig,
    *,
    processes: str,
    world: int,
    cuda: bool,
    backend: str | None,
    data: str,
    precision: str,
    cache: str,
    resume: str = "",
    chosen: list[str] | None = None,
    warning: str = "",
) -> RunFacts:
    """The facts of a run of ``cfg`` over ``world`` processes."""
    layout = strategy_of(cfg.strategy).layout(cfg, world)
    replicas = layout.dp_size
    accum = f" x {cfg.grad_accum} micro-batches" if cfg.grad_accum > 1 else ""
    return RunFacts(
        processes=processes,
        device=(
            f"{'cuda' if cuda else 'cpu'}, backend "
            f"{backend or 'none (one process)'}, strategy {cfg.strategy}"
        ),
        data=data,
        model=(
            f"{cfg.model}{' from ' + cfg.weights if cfg.weights else ''}, trained at "
            f"{cfg.train_size}px, evaluated at {cfg.eval_crop}px (resized to "
            f"{cfg.eval_resize}, {cfg.interpolation}); {preprocessing_words(cfg)}"
        ),
        global_batch=(
            f"{cfg.batch * replicas * cfg.grad_accum} ({cfg.batch} x {replicas} replica(s){accum})"
            + ("; order global: the same steps at any world size" if cfg.order == "global" else "")
        ),
        schedule=f"{cfg.opt}, {describe_schedule(cfg, replicas)}",
        recipe=recipe_words(_averaged(cfg)),
        precision=precision
        + (" (auto)" if cfg.precision == "auto" else "")
        + (f", torch.compile of {_compiled(cfg)} (the first steps compile)" if cfg.compile else "")
        + (", activation checkpointing" if cfg.activation_checkpointing else ""),
        cache=cache,
        resume=resume,
        chosen=chosen or [],
        warning=warning,
    )


def preprocessing_words(cfg: TrainConfig) -> str:
    """Where the normalisation and sizes came from: the named weights' metadata, the
    user's settings, or ImageNet's statistics."""
    values = cfg.to_dict()
    named = [p for p in PRESETS if p.name == "weights" and p.applies(values)]
    if not named:
        given = "your mean/std" if cfg.mean or cfg.std else "ImageNet's mean/std"
        return f"normalised with {given}"
    taken, kept = named[0].taken(values)
    words = f"{', '.join(taken) or 'nothing'} from the weights' metadata"
    return words + (f", yours: {', '.join(kept)}" if kept else "")


def data_words(cfg: TrainConfig, split: DataSplit) -> str:
    """The data as a run sees it: classes and images on each side of the split."""
    sets = split.label_sets
    several = f" (several labels an image, {len(sets)} combinations)" if sets is not None else ""
    return (
        f"{cfg.data}: {len(split.classes)} classes{several}, {len(split.train)} train / "
        f"{len(split.val)} val images ({split.layout})"
    )


def dry_run(
    cfg: TrainConfig,
    env: DistEnv,
    unwritten: Path | None = None,
    chosen: list[str] | None = None,
) -> str:
    """What `train --dry-run` prints: what would run, then the resolved config (its
    summary first: 10 lines before the 100 of YAML).
    ``unwritten``: where the embedded digits set would first be written."""
    import torch

    from paratrain.distributed.runtime import resolve_precision, runs_on_cuda
    from paratrain.engine.prerun.preflight import check_model_input, job_world, oversubscribed

    world = job_world(cfg, env)
    launched = env.source == "single" and world > 1
    cuda = runs_on_cuda(cfg.device)
    check_model_input(cfg, world)
    data, cache, resume = _what_it_reads(cfg, unwritten)
    facts = run_facts(
        cfg,
        processes=(
            f"{world} processes started here by torch's elastic launcher (c10d rendezvous)"
            if launched
            else f"{world} process(es) ({env.source})"
        ),
        world=world,
        cuda=cuda,
        backend=(cfg.backend or ("nccl" if cuda else "gloo")) if world > 1 else None,
        data=data,
        precision=resolve_precision(cfg.precision, torch.device("cuda" if cuda else "cpu")),
        cache=cache,
        resume=resume,
        chosen=chosen,
        warning=(oversubscribed(cfg) or "") if launched else "",
    )
    return "\n".join(
        [
            "paratrain train --dry-run: checked; nothing was run.",
            "would run:",
            *facts.lines(),
            "resolved config (what --config takes):",
            *("  " + line for line in yaml.safe_dump(cfg.to_dict(), sort_keys=False).splitlines()),
        ]
    )


def _what_it_reads(cfg: TrainConfig, unwritten: Path | None) -> tuple[str, str, str]:
    """(the data, the cache, what --resume continues) as the dry run says them."""
    from paratrain.data.cache.choose import survey
    from paratrain.data.loaders import read_split

    if unwritten is not None:
        data = f"the embedded digits set, written to {unwritten} by the first run"
        return data, "decided once the digits set is written", ""
    split = read_split(cfg)
    plan = survey(
        split.train + split.val,
        cfg.image_size,
        cfg.cache,
        cfg.cache_max_gb,
        cfg.cache_dir,
        short=cfg.stored_size,
        interpolation=cfg.interpolation,
    )
    size = f"{plan.kind}, about {plan.nbytes / 2**30:.2f} GB"
    cache = {
        "ready": f"ready: {plan.kind}, {plan.nbytes / 2**30:.2f} GB at {plan.directory}",
        "build": f"would be built: {plan.reason or size}, at {plan.directory}",
        "skip": f"off ({plan.reason})",
    }[plan.action]
    return data_words(cfg, split), cache, resumable(cfg, split.classes)


def resumable(cfg: TrainConfig, classes: list[str]) -> str:
    """What --resume would continue, checked as the run would check it."""
    from paratrain.engine.checkpointing import checkpoint, run_dir

    if cfg.resume is None:
        return "no (a new run)"
    if cfg.resume == "auto":
        found = run_dir.find_resumable(Path(cfg.output_dir), cfg.name)
        if found is None:
            return "auto: nothing to resume yet (a new run)"
    else:
        found = run_dir.resume_target(cfg.resume)
    saved = checkpoint.read_for_resume(found)
    _, changed = checkpoint.check_resumable(saved, cfg, classes, found)
    epoch, in_epoch = (int(saved.progress.get(k, 0)) for k in ("epoch", "step_in_epoch"))
    step = f", step {in_epoch}" if in_epoch else ""
    also = f"; changed: {', '.join(changed)}" if changed else ""
    if epoch >= cfg.epochs:
        also += f"; nothing left to train at --epochs {cfg.epochs}"
    return f"{found} at epoch {epoch + 1}{step}{also}"


def embedded_data(
    cfg: TrainConfig, env: DistEnv, dry: bool, say: Callable[[str], object]
) -> TrainConfig | None:
    """A run without --data trains on the embedded digits set: its presets told, the
    set written once; a dry run writes nothing, so it describes the set unwritten and
    None is returned (nothing more to do)."""
    from dataclasses import replace

    from paratrain.config import preset_notes
    from paratrain.data.builtin import digits_dir, digits_ready, ensure_digits
    from paratrain.engine.prerun.preflight import (
        already_checked,
        check_devices,
        check_settings,
        job_world,
    )

    if env.is_main and not already_checked():
        say("; ".join(preset_notes(cfg)))
    if dry and not digits_ready(cfg.cache_dir):
        if cfg.has_auto():
            say(
                "the embedded digits set is not written yet; auto settings are chosen on "
                "it by the first run (a dry run writes nothing)"
            )
            return None
        world = job_world(cfg, env)
        check_settings(cfg, world)
        check_devices(cfg, world)
        say(dry_run(cfg, env, unwritten=digits_dir(cfg.cache_dir)))
        return None
    return replace(cfg, data=str(ensure_digits(cfg.cache_dir)))


def _compiled(cfg: TrainConfig) -> str:
    """What --compile compiles (--compile-scope), in words."""
    return "each repeated block" if cfg.compile_scope == "blocks" else "the whole model"
