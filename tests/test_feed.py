"""The worker feed and step without Ray: schedule order from any cursor across epochs, rank
slices that add up to the global batch, reading errors that name the cursor, and gradient
accumulation that matches one pass."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from torch import nn

from raytuner.data.cache import CachedDataset
from raytuner.data.sources import caption_key
from raytuner.data.tensors import to_cells
from raytuner.train.feed import Feed
from raytuner.train.loop import _step
from raytuner.train.schedule import epoch_batches

# bucket -> rows; 7 + 3 + 1 rows, one source row repeated twice
SIZES = {(16, 16): 7, (24, 16): 3, (16, 32): 1}


def dataset(drop_caption: str | None = None) -> CachedDataset:
    paths, keys, latents, widths, heights = [], [], [], [], []
    for (w, h), n in SIZES.items():
        for i in range(n):
            paths.append(f"{w}x{h}/{i}.png")
            keys.append(f"k{len(keys)}")
            latents.append(torch.full((4, h // 8, w // 8), float(len(latents))))
            widths.append(w)
            heights.append(h)
    cells = [to_cells(t[None], "float32") for t in latents]
    table = pa.table(
        {
            "key": keys,
            "latent": [c[0][0] for c in cells],
            "latent_shape": [c[1][0].tolist() for c in cells],
            "width": widths,
            "height": heights,
            "original_size": [[h, w] for w, h in zip(widths, heights, strict=True)],
            "crop_top_left": [[0, 0]] * len(keys),
        }
    )
    captions = [f"c{i % 2}" for i in range(len(keys))]
    index = pa.table(
        {
            "path": paths,
            "key": keys,
            "caption_key": captions,
            "repeats": [2] + [1] * (len(keys) - 1),
        }
    )
    text = {c: {"prompt_embeds": torch.full((3, 8), float(i))} for i, c in enumerate(["c0", "c1"])}
    text.pop(drop_caption, None)
    manifest = {"dtype": "float32", "text_tensors": ["prompt_embeds"]}
    return CachedDataset(manifest=manifest, index=index, latents=table, text=text)


def feed(data: CachedDataset, rank: int = 0, world: int = 1, gbs: int = 4) -> Feed:
    return Feed(
        data, seed=3, global_batch_size=gbs, remainder="pad", rank=rank, world=world,
        prefetch=2, pin=False,
    )  # fmt: skip


def test_batches_follow_the_schedule_from_a_mid_epoch_cursor_into_the_next_epoch():
    data = dataset()
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
    return data.index.column("path").to_pylist(), data.repeats


def test_rank_slices_add_up_to_the_global_batch_and_carry_their_own_seeds():
    data = dataset()
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


def test_a_row_that_cannot_be_read_fails_the_step_naming_the_cursor():
    f = feed(dataset(drop_caption="c1")).start(0, 0)
    try:
        with pytest.raises(RuntimeError, match=r"epoch 0, batch \d"):
            for index in range(4):
                f.next(0, index)
    finally:
        f.close()


def test_a_cursor_the_feed_did_not_start_from_is_refused():
    f = feed(dataset()).start(0, 1)
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
def test_gradient_accumulation_matches_one_pass(micro):
    f = feed(dataset(), gbs=5).start(0, 0)
    try:
        batch = f.next(0, 0)
    finally:
        f.close()
    grads = []
    for size in (0, micro):
        torch.manual_seed(0)
        model = Tiny()
        loss = _step(model, tiny_loss, batch, torch.device("cpu"), size, scale=1 / 5)
        grads.append((loss, model.proj.weight.grad.clone()))
    (one_loss, one_grad), (acc_loss, acc_grad) = grads
    torch.testing.assert_close(acc_loss, one_loss)
    torch.testing.assert_close(acc_grad, one_grad)
    assert one_grad.abs().sum() > 0


def test_caption_dropout_uses_the_empty_caption_the_same_way_on_any_world_size():
    data = dataset()
    data.text[caption_key("")] = {"prompt_embeds": torch.full((3, 8), -1.0)}

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
