"""Property tests of the global per-bucket schedule (hypothesis): whatever the buckets, world
size and batch size, every rank runs the same steps on one bucket, every row once per epoch."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from raytuner.train.schedule import epoch_batches, rank_slice


@st.composite
def bucket_lists(draw):
    """Row buckets with the awkward shapes: 1-row buckets, one huge bucket, up to 100 buckets."""
    shape = draw(st.sampled_from(["random", "singletons", "one_huge", "many"]))
    if shape == "singletons":
        sizes = [1] * draw(st.integers(1, 30)) + [draw(st.integers(1, 200))]
    elif shape == "one_huge":
        sizes = [draw(st.integers(200, 1000))] + draw(st.lists(st.integers(1, 5), max_size=5))
    elif shape == "many":
        sizes = draw(st.lists(st.integers(1, 12), min_size=100, max_size=100))
    else:
        sizes = draw(st.lists(st.integers(1, 80), min_size=1, max_size=12))
    return [f"b{i}" for i, n in enumerate(sizes) for _ in range(n)]


SETTINGS = settings(max_examples=150, deadline=None)


def schedule_or_none(buckets, gbs, remainder, epoch=0):
    try:
        return epoch_batches(
            buckets, seed=7, epoch=epoch, global_batch_size=gbs, remainder=remainder
        )
    except ValueError:  # no bucket can fill a global batch under "drop"
        assert remainder == "drop" and max(Counter(buckets).values()) < gbs
        return None


@SETTINGS
@given(bucket_lists(), st.integers(1, 64), st.sampled_from(["drop", "pad"]))
def test_one_bucket_per_global_batch_and_full_batches(buckets, gbs, remainder):
    batches = schedule_or_none(buckets, gbs, remainder)
    if batches is None:
        return
    for batch in batches:
        assert len(batch) == gbs
        assert len({buckets[i] for i in batch}) == 1


@SETTINGS
@given(bucket_lists(), st.integers(1, 64))
def test_drop_trains_every_kept_row_exactly_once(buckets, gbs):
    batches = schedule_or_none(buckets, gbs, "drop")
    if batches is None:
        return
    seen = Counter(i for b in batches for i in b)
    assert set(seen.values()) == {1}
    per_bucket = Counter(buckets)
    kept = sum(n // gbs * gbs for n in per_bucket.values())
    assert len(seen) == kept  # only each bucket's last partial batch is dropped


@SETTINGS
@given(bucket_lists(), st.integers(1, 64))
def test_pad_trains_every_row_at_least_once_and_pads_within_the_bucket(buckets, gbs):
    batches = epoch_batches(buckets, seed=7, epoch=0, global_batch_size=gbs, remainder="pad")
    seen = Counter(i for b in batches for i in b)
    assert set(seen) == set(range(len(buckets)))
    per_bucket = Counter(buckets)
    assert len(batches) == sum(-(-n // gbs) for n in per_bucket.values())


@SETTINGS
@given(bucket_lists(), st.integers(1, 64), st.integers(1, 8), st.sampled_from(["drop", "pad"]))
def test_every_rank_runs_the_same_steps_on_the_same_bucket(buckets, gbs, world, remainder):
    if gbs < world:
        world = gbs  # the config refuses a global batch smaller than the world
    batches = schedule_or_none(buckets, gbs, remainder)
    if batches is None:
        return
    per_rank = [
        [batch[slice(*rank_slice(batch, r, world))] for batch in batches] for r in range(world)
    ]
    assert len({len(steps) for steps in per_rank}) == 1  # equal step counts
    for step, batch in enumerate(batches):
        slices = [per_rank[r][step] for r in range(world)]
        assert all(slices)  # nobody idles while the others wait in a collective
        assert sum(slices, []) == batch  # the ranks together train exactly the global batch
        assert len({buckets[i] for s in slices for i in s}) == 1


@SETTINGS
@given(bucket_lists(), st.integers(1, 64), st.integers(0, 5))
def test_schedule_is_a_pure_function_of_rows_seed_epoch_and_batch_size(buckets, gbs, epoch):
    once = schedule_or_none(buckets, gbs, "pad", epoch)
    assert once == schedule_or_none(buckets, gbs, "pad", epoch)
