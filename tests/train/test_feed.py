"""The worker feed and step without Ray: schedule order from any cursor across epochs, rank
slices that add up to the global batch, reading errors that name the cursor, gradient
accumulation that matches one pass, and each row's source's frame rate in the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from raytuner.data import cache
from raytuner.data.reader import CachedDataset, open_dataset
from raytuner.tools import synthetic
from raytuner.train.feed import Feed
from raytuner.train.schedule import epoch_batches
from raytuner.train.step import forward_backward

# bucket -> rows; 7 + 3 + 1 rows, one source row repeated twice
SIZES = {(16, 16): 7, (24, 16): 3, (16, 32): 1}


def dataset(root: Path) -> CachedDataset:
    """A committed cache (float32 cells) of 11 rows with two captions, c0 and c1, written in
    the real format; row i's latent holds i, a caption's embedding its number (empty: -1)."""
    buckets = [size for size, n in SIZES.items() for _ in range(n)]
    version = cache.Version(str(root), "synthetic")
    synthetic.write_cache(
        version,
        buckets=buckets,
        captions=[i % 2 for i in range(len(buckets))],
        repeats=[2] + [1] * (len(buckets) - 1),
        shapes=lambda w, h: {"latent": (4, h // 8, w // 8), "prompt_embeds": (3, 8)},
        family="test",
        dtype="float32",
        rows_per_file=4,
    )
    return open_dataset(str(root), "synthetic")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> CachedDataset:
    return dataset(tmp_path_factory.mktemp("feed"))


def feed(data: CachedDataset, rank: int = 0, world: int = 1, gbs: int = 4) -> Feed:
    return Feed(
        data, seed=3, global_batch_size=gbs, remainder="pad", rank=rank, world=world,
        prefetch=2, pin=False,
    )  # fmt: skip


def test_batches_follow_the_schedule_from_a_mid_epoch_cursor_into_the_next_epoch(data):
    appearances = [p for p, n in zip(*_paths_and_repeats(data), strict=True) for _ in range(n)]
    f = feed(data)
    count = len(f.epoch(0))  # 12 appearances: 2 + 1 + 1 batches of 4 (padded)
    assert count == 4
    f.start(0, 2)
    cursor, seen = (0, 2), []
    try:
        for _ in range(count):  # the 2 left of epoch 0, then 2 of epoch 1
            batch = f.next(*cursor)
            assert (batch.epoch, batch.index) == cursor and batch.count == count
            assert len({tuple(t.shape) for t in batch.tensors["latent"]}) == 1  # one bucket
            seen.append((cursor, batch.ids))
            cursor = batch.after()
    finally:
        f.close()
    assert cursor == (1, 2)
    for (epoch, index), ids in seen:
        expected = epoch_batches(f.buckets, 3, epoch, 4, "pad")[index]
        assert ids == [appearances[j] for j in expected]
    epoch_one = [i for (e, _), ids in seen if e == 1 for i in ids]
    assert len(epoch_one) == 8


def _paths_and_repeats(data: CachedDataset) -> tuple[list[str], list[int]]:
    return data.paths, data.repeats


def test_rank_slices_add_up_to_the_global_batch_and_carry_their_own_seeds(data):
    whole = feed(data, gbs=5).start(0, 0)
    ranks = [feed(data, rank=r, world=3, gbs=5).start(0, 0) for r in range(3)]
    try:
        for index in range(3):
            full = whole.next(0, index)
            parts = [f.next(0, index) for f in ranks]
            assert [len(p.ids) for p in parts] == [2, 2, 1]
            assert [i for p in parts for i in p.ids] == full.ids
            assert [s for p in parts for s in p.seeds] == full.seeds
            latents = torch.cat([p.tensors["latent"] for p in parts])
            assert torch.equal(latents, full.tensors["latent"])
    finally:
        for f in [whole, *ranks]:
            f.close()


def test_a_row_that_cannot_be_read_fails_the_step_naming_the_cursor(tmp_path):
    data = dataset(tmp_path)
    version = cache.Version(str(tmp_path), "synthetic")
    (text,) = version.manifest()["text"]  # both captions and the empty one
    Path(version.path(text["path"])).write_bytes(b"")  # cut short, as by a full disk
    f = feed(data).start(0, 0)
    try:
        with pytest.raises(RuntimeError, match=r"epoch 0, batch \d"):
            for index in range(4):
                f.next(0, index)
    finally:
        f.close()


def test_a_cursor_the_feed_did_not_start_from_is_refused(data):
    f = feed(data).start(0, 1)
    try:
        with pytest.raises(RuntimeError, match="out of step"):
            f.next(0, 0)
    finally:
        f.close()


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 1)


def tiny_loss(model, batch, generators):
    noise = torch.stack([torch.randn(4, generator=g) for g in generators])
    x = batch["latent"].flatten(1)[:, :4] + noise
    x = torch.cat([x, batch["prompt_embeds"][:, 0, :4]], dim=1)
    return model.proj(x).squeeze(1) ** 2


@pytest.mark.parametrize("micro", [1, 2, 3])
def test_gradient_accumulation_matches_one_pass(micro, data):
    f = feed(data, gbs=5).start(0, 0)
    try:
        batch = f.next(0, 0)
    finally:
        f.close()
    grads = []
    for size in (0, micro):
        torch.manual_seed(0)
        model = Tiny()
        loss = forward_backward(model, tiny_loss, batch, torch.device("cpu"), size, scale=1 / 5)
        grads.append((loss, model.proj.weight.grad.clone()))
    (one_loss, one_grad), (acc_loss, acc_grad) = grads
    torch.testing.assert_close(acc_loss, one_loss)
    torch.testing.assert_close(acc_grad, one_grad)
    assert one_grad.abs().sum() > 0


def test_caption_dropout_uses_the_empty_caption_the_same_way_on_any_world_size(data):

    def dropped(world: int, p: float) -> list[list[bool]]:
        """Per global batch of the first two epochs: which samples got the empty caption."""
        out = []
        feeds = [
            Feed(
                data,
                seed=3,
                global_batch_size=4,
                remainder="pad",
                rank=r,
                world=world,
                prefetch=1,
                pin=False,
                caption_dropout=p,
            )
            for r in range(world)
        ]
        for epoch in (0, 1):
            batches = feeds[0].epoch(epoch)
            for index in range(len(batches)):
                flags = []
                for f in feeds:
                    text = f.assemble(epoch, index, batches).tensors["prompt_embeds"]
                    flags += [bool((t == -1).all()) for t in text]
                out.append(flags)
        return out

    assert not any(map(any, dropped(1, 0.0)))
    assert all(map(all, dropped(1, 1.0 - 1e-9)))
    half = dropped(1, 0.5)
    assert half == dropped(2, 0.5)  # the decision belongs to the sample, not to the rank
    share = sum(map(sum, half)) / sum(map(len, half))
    assert 0.2 < share < 0.8


def test_a_cache_with_posterior_std_trains_on_a_draw_of_the_sample_the_same_on_any_rank(
    tmp_path,
):
    """preprocess.store_std: each sample's latent is mean + std * eps, eps from the sample's
    own seed: the same draw on any world size and after a resume, another draw next epoch."""
    version = cache.Version(str(tmp_path), "synthetic")
    synthetic.write_cache(
        version,
        buckets=[(16, 16)] * 4,
        captions=[0, 1, 0, 1],
        repeats=[1] * 4,
        shapes=lambda w, h: {"latent": (4, h // 8, w // 8), "prompt_embeds": (3, 8)},
        family="test",
        dtype="float32",
        std=0.5,
    )
    data = open_dataset(str(tmp_path), "synthetic")

    def latents(world: int, epoch: int) -> torch.Tensor:
        feeds = [
            Feed(data, seed=3, global_batch_size=4, remainder="pad", rank=r, world=world,
                 prefetch=1, pin=False)
            for r in range(world)
        ]  # fmt: skip
        batches = feeds[0].epoch(epoch)
        parts = [f.assemble(epoch, 0, batches) for f in feeds]
        assert all("latent_std" not in p.tensors for p in parts)
        means = torch.tensor([float(data.paths.index(i) % 251) for p in parts for i in p.ids])
        return torch.cat([p.tensors["latent"] for p in parts]), means

    drawn, means = latents(1, 0)
    again, _ = latents(2, 0)
    torch.testing.assert_close(again, drawn)  # a resume or another world: the same draw
    residual = (drawn - means.view(-1, 1, 1, 1)) / 0.5  # the eps of each sample
    assert 0.6 < residual.std() < 1.4 and residual.abs().max() > 0.1
    assert not torch.allclose(latents(1, 1)[0], drawn)  # next epoch: another draw


def test_each_row_carries_its_sources_sampling_fps_as_the_job_and_a_bare_reader_read_it(
    tmp_path,
):
    """A batch's "fps" [B] float32 is each row's source's sampling rate (a source at -1 takes
    data.fps; 0: each clip's own, unknown), from a per-source table: no index column."""
    from raytuner.config import DataConfig, SourceConfig
    from raytuner.data import datasets
    from raytuner.data.reader import for_readers

    data = DataConfig(cache=str(tmp_path), fps=24.0, sources=[
        SourceConfig(path=str(tmp_path / "a"), fps=16.0),
        SourceConfig(path=str(tmp_path / "b")),  # -1: data.fps
        SourceConfig(path=str(tmp_path / "c"), fps=0.0),
    ])  # fmt: skip
    source_of = [0, 1, 2, 1, 0, 2, 1]
    manifest = synthetic.write_cache(
        cache.Version(str(tmp_path), "synthetic"),
        buckets=[(16, 16)] * len(source_of),
        captions=[0] * len(source_of),
        repeats=[1] * len(source_of),
        shapes=lambda w, h: {"latent": (4, h // 8, w // 8), "prompt_embeds": (3, 8)},
        family="test",
        dtype="float32",
        sources=data.all_sources(),
        source_of=source_of,
    )
    rate = {0: 16.0, 1: 24.0, 2: 0.0}
    job = for_readers(manifest, datasets.entry(manifest, data.all_sources(), str(tmp_path)))
    assert job["source_fps"] == [16.0, 24.0, 0.0]
    for readers in (job, None):  # the job's dataset; a reader naming none: the newest commit's
        read = open_dataset(str(tmp_path), "synthetic", readers)
        expected = [rate[source_of[int(p[-11:-4])]] for p in read.paths]
        assert sorted(expected) == sorted(rate[s] for s in source_of)
        f = feed(read, gbs=len(source_of))
        batch = f.assemble(0, 0, f.epoch(0))
        fps = batch.tensors["fps"]
        assert fps.dtype == torch.float32 and fps.shape == (len(source_of),)
        assert fps.tolist() == [expected[read.paths.index(i)] for i in batch.ids]
