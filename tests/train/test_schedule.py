"""The global per-bucket schedule: one bucket per global batch, the same for any world size."""

from __future__ import annotations

import pytest

from raytuner.train.schedule import epoch_batches, rank_slice, sample_seed

BUCKETS = ["64x64"] * 10 + ["48x80"] * 7 + ["80x48"] * 3


def test_each_global_batch_holds_one_bucket():
    for batch in epoch_batches(BUCKETS, seed=0, epoch=0, global_batch_size=4, remainder="drop"):
        assert len(batch) == 4
        assert len({BUCKETS[i] for i in batch}) == 1


def test_drop_and_pad_policies():
    dropped = epoch_batches(BUCKETS, 0, 0, 4, "drop")
    assert len(dropped) == 2 + 1  # 10 -> 2 batches, 7 -> 1, 3 -> 0
    assert len({i for b in dropped for i in b}) == 12
    padded = epoch_batches(BUCKETS, 0, 0, 4, "pad")
    assert len(padded) == 3 + 2 + 1
    assert {i for b in padded for i in b} == set(range(len(BUCKETS)))


def test_deterministic_per_epoch_and_different_across_epochs():
    assert epoch_batches(BUCKETS, 1, 0, 4, "pad") == epoch_batches(BUCKETS, 1, 0, 4, "pad")
    assert epoch_batches(BUCKETS, 1, 0, 4, "pad") != epoch_batches(BUCKETS, 1, 1, 4, "pad")


@pytest.mark.parametrize("size,world", [(4, 2), (5, 2), (5, 3), (7, 7), (9, 4)])
def test_rank_slices_partition_the_global_batch(size, world):
    slices = [rank_slice(list(range(size)), r, world) for r in range(world)]
    covered = [i for start, stop in slices for i in range(start, stop)]
    assert covered == list(range(size))
    lengths = [stop - start for start, stop in slices]
    assert max(lengths) - min(lengths) <= 1 and min(lengths) >= 1


def test_too_small_buckets_are_a_clear_error():
    with pytest.raises(ValueError, match='train.remainder = "pad"'):
        epoch_batches(["a", "b"], 0, 0, 4, "drop")


def test_sample_seeds_differ_by_position():
    seeds = {sample_seed(0, 0, 0, p) for p in range(100)}
    assert len(seeds) == 100
