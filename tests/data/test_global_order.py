"""--order global: the same global batches at any world size, each rank's loss weighed
by its share, and a resume under another world size that continues where it stopped."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paratrain.data.samplers import BalancedSampler, GlobalBatches, TrainSampler


def _ranks(n: int, world: int, batch: int, accum: int = 1, consumed: int = 0, epoch: int = 0):
    """Every rank's GlobalBatches over a TrainSampler of ``n`` images, set to ``epoch``."""
    out = []
    for rank in range(world):
        sampler = TrainSampler(n, rank, world, seed=5, padded=False)
        sampler.set_epoch(epoch, consumed)
        out.append(GlobalBatches(sampler, batch, accum))
    return out


def _steps(ranks: list[GlobalBatches]) -> list[list[tuple[int, float]]]:
    """Each step's (index, gradient weight) of every real image over the ranks: an image
    of rank r's micro-batch j weighs 1 / (world x real x divisor) in the averaged gradient."""
    world, accum = len(ranks), ranks[0].accum
    micro = [list(r) for r in ranks]
    assert len({len(m) for m in micro}) == 1  # every rank as many micro-batches
    steps, done, step = [], 0, 0
    while done < len(micro[0]):
        plans = [r.step_plan(step) for r in ranks]
        count = len(plans[0].real)
        assert count == min(accum, len(micro[0]) - done)
        assert len({p.images for p in plans}) == 1
        weighed = []
        for rank, plan in enumerate(plans):
            for j in range(count):
                batch = micro[rank][done + j]
                real = plan.real[j]
                if real == 0:  # a stand-in: one image, weighted zero
                    assert len(batch) == 1 and plan.divisors[j] == math.inf
                    continue
                assert len(batch) == real
                weighed += [(i, 1 / (world * real * plan.divisors[j])) for i, _ in batch]
        assert len(weighed) == plans[0].images
        steps.append(weighed)
        done, step = done + count, step + 1
    return steps


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 70),
    batch=st.integers(1, 6),
    accum=st.integers(1, 3),
    worlds=st.sampled_from([(1, 2), (1, 4), (2, 4), (1, 3)]),
)
def test_the_global_steps_and_their_weights_do_not_depend_on_the_world_size(
    n, batch, accum, worlds
):
    """World sizes that share a global batch (1 x 4b, 2 x 2b, 4 x b): each step holds the
    same images, every image of a step weighs 1/images in the gradient, and the epoch
    holds every image exactly once."""
    small, large = worlds
    global_batch = large * batch
    results = []
    for world in (small, large):
        steps = _steps(_ranks(n, world, global_batch // world, accum))
        for step in steps:
            assert all(math.isclose(w, 1 / len(step)) for _, w in step)
        results.append([sorted(i for i, _ in step) for step in steps])
        assert sorted(i for step in steps for i, _ in step) == list(range(n))
    assert results[0] == results[1]


def test_a_short_last_step_weighs_each_rank_by_its_share():
    """38 images at 4 x 4: steps of 16, 16 and 6; in the last, ranks 0 and 1 hold 2
    images each and ranks 2 and 3 one, so their losses count 2/6 and 1/6."""
    ranks = _ranks(38, 4, 4)
    plans = [r.step_plan(2) for r in ranks]
    assert [p.images for p in plans] == [6] * 4
    assert [p.real for p in plans] == [(2,), (2,), (1,), (1,)]
    # the mean loss of rank r is divided by 6 / (4 x real): x4/6 x2 for 2 images
    assert [p.divisors[0] for p in plans] == [6 / 8, 6 / 8, 6 / 4, 6 / 4]
    assert [p.images for p in (ranks[0].step_plan(0), ranks[0].step_plan(1))] == [16, 16]


def test_a_rank_without_an_image_takes_a_stand_in_weighted_zero():
    ranks = _ranks(18, 4, 4)  # the last step: 2 images for 4 ranks
    last = [list(r)[-1] for r in ranks]
    plans = [r.step_plan(1) for r in ranks]
    assert [p.real for p in plans] == [(1,), (1,), (0,), (0,)]
    assert last[2] == last[3] == last[0]  # the micro-batch's first image
    assert [p.divisors[0] for p in plans][2:] == [math.inf, math.inf]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(8, 80), done=st.integers(0, 6), batch=st.integers(1, 4))
def test_resumed_on_another_world_size_no_image_is_seen_twice_or_skipped(n, done, batch):
    """4 processes train ``done`` steps; 2 processes resume from the consumed count, at
    the same or another per-process batch: the epoch holds every image exactly once."""
    before = _ranks(n, 4, batch)
    steps = _steps(before)[:done]
    consumed = sum(len(step) for step in steps)
    seen = [i for step in steps for i, _ in step]
    after = _steps(_ranks(n, 2, batch + 1, consumed=consumed))
    seen += [i for step in after for i, _ in step]
    assert Counter(seen) == Counter(range(n))


def test_same_as_one_process_after_a_resume_on_another_world_size():
    """The steps after a 4 -> 2 resume at the same global batch are one process's."""
    one = _steps(_ranks(50, 1, 8))
    consumed = sum(len(step) for step in one[:3])
    two = _steps(_ranks(50, 2, 4, consumed=consumed))
    assert [sorted(i for i, _ in s) for s in two] == [sorted(i for i, _ in s) for s in one[3:]]


def test_balanced_draws_keep_their_global_order():
    labels = [0] * 40 + [1] * 4
    steps = []
    for world in (1, 4):
        ranks = []
        for rank in range(world):
            sampler = BalancedSampler(labels, rank, world, seed=1, power=1.0, padded=False)
            sampler.set_epoch(2)
            ranks.append(GlobalBatches(sampler, 8 // world))
        steps.append([sorted(i for i, _ in s) for s in _steps(ranks)])
        assert sum(len(s) for s in steps[-1]) == 44
    assert steps[0] == steps[1]


def test_augmentation_seeds_follow_the_position_at_any_world_size():
    one = {kv for batch in _ranks(21, 1, 6)[0] for kv in batch}
    four = {kv for r in _ranks(21, 3, 2) for batch in r for kv in batch}
    assert one == four  # (index, seed) pairs; the stand-ins are copies of real ones


def _loaders(tmp_path, **kw):
    import torch

    from imagefolders import make_image_folder
    from paratrain.config import TrainConfig
    from paratrain.data.folder import build_split
    from paratrain.data.loaders import make_loaders
    from paratrain.distributed.env import DistEnv
    from paratrain.distributed.runtime import Runtime

    data = make_image_folder(tmp_path / "data", classes=2, per_class=5)
    cfg = TrainConfig(data=str(data), image_size=16, batch_size=2, workers=0, order="global")
    runtime = Runtime(env=DistEnv(), device=torch.device("cpu"), backend=None)
    return make_loaders(cfg, build_split(data), runtime, None, 0, 1, **kw)


def test_a_pipeline_or_shards_per_node_refuse_the_global_order(tmp_path, monkeypatch):
    from paratrain.data import loaders
    from paratrain.errors import UserError

    made = _loaders(tmp_path)
    assert isinstance(made.train.batch_sampler, GlobalBatches)
    assert made.step_plan(0).images == 2
    with pytest.raises(UserError, match="--order global: --strategy ddp's fixed micro-batches"):
        _loaders(tmp_path, fixed_batch=True)
    monkeypatch.setattr(loaders, "node_local", lambda split, runtime: (0, 1))
    monkeypatch.setattr(loaders.comm, "all_gather_object", lambda value: [value])
    with pytest.raises(UserError, match="--order global: shards read per node give each"):
        _loaders(tmp_path)
