import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DistributedSampler, SequentialSampler

from paratrain.data.samplers import ShardedEvalSampler, TrainSampler


def test_order_matches_torch_distributed_sampler():
    for world in (1, 2, 3):
        for rank in range(world):
            ours = TrainSampler(23, rank, world, seed=4)
            torchs = DistributedSampler(range(23), num_replicas=world, rank=rank, seed=4)
            for epoch in (0, 1):
                ours.set_epoch(epoch)
                torchs.set_epoch(epoch)
                assert [i for i, _ in ours] == list(torchs)
                assert len(ours) == len(torchs)


def test_resuming_mid_epoch_neither_repeats_nor_skips():
    world, batch = 2, 3
    full = [list(TrainSampler(20, r, world, seed=1)) for r in range(world)]
    done_steps = 2
    consumed = done_steps * batch * world
    for rank in range(world):
        resumed = TrainSampler(20, rank, world, seed=1)
        resumed.set_epoch(0, consumed)
        assert full[rank][done_steps * batch :] == list(resumed)
        assert len(resumed) == len(full[rank]) - done_steps * batch


def test_resuming_with_another_world_size_covers_the_rest_exactly_once():
    before = [list(TrainSampler(24, r, 2, seed=1)) for r in range(2)]
    consumed = 2 * 2 * 3  # two steps of batch 3 on 2 ranks
    seen = {key for shard in before for key in shard[:6]}
    after = []
    for rank in range(3):
        sampler = TrainSampler(24, rank, 3, seed=1)
        sampler.set_epoch(0, consumed)
        after += list(sampler)
    assert not seen & set(after)
    assert {i for i, _ in seen} | {i for i, _ in after} == set(range(24))


def test_augmentation_seeds_depend_on_position_not_rank():
    one = dict(TrainSampler(10, 0, 1, seed=2))
    split = dict(kv for r in range(2) for kv in TrainSampler(10, r, 2, seed=2))
    assert one == split
    epoch1 = TrainSampler(10, 0, 1, seed=2)
    epoch1.set_epoch(1)
    assert dict(epoch1) != one


def test_eval_shards_are_disjoint_and_unpadded():
    shards = [list(ShardedEvalSampler(1001, r, 4, 1)) for r in range(4)]
    assert sorted(i for s in shards for i in s) == list(range(1001))
    assert [len(s) for s in shards] == [251, 250, 250, 250]
    dealt = [len(ShardedEvalSampler(1001, r, 2, batch_size=16)) for r in range(2)]
    assert dealt == [505, 496]  # 63 batches, the last of 9: 32 and 31 of them


@given(
    images=st.integers(0, 60),
    world=st.integers(1, 5),
    batch=st.integers(1, 9),
)
def test_eval_shards_deal_one_process_batches_whole(images, world, batch):
    """Each rank's batches, as a loader of that batch size cuts them, are one process's
    batches: the same images at the same rows, every batch once."""
    one = [list(b) for b in BatchSampler(SequentialSampler(range(images)), batch, False)]
    seen = []
    for rank in range(world):
        shard = ShardedEvalSampler(images, rank, world, batch_size=batch)
        mine = [list(b) for b in BatchSampler(shard, batch, False)]
        assert mine == one[rank::world]
        seen += mine
    assert sorted(seen) == one


def test_eval_shards_refuse_an_empty_batch():
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        ShardedEvalSampler(10, 0, 2, batch_size=0)
