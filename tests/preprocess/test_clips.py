"""Video clips through the preprocess stream (issue 40) on a real local Ray, the tiny Wan: clips
the test encodes with PyAV (mp4 and webm, several lengths, rates and sizes, one corrupt, one too
short) beside images; every clip in one report category, each sample's latent the VAE's own of
its decoded frames, a rerun encodes nothing and an edited clip alone is encoded again, an
unchanged clip is not read again; an image family reports the clips as not trained."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from clip_files import clip
from PIL import Image

from raytuner.config import DataConfig, ModelConfig, PreprocessConfig, SourceConfig
from raytuner.data import cache
from raytuner.data.reader import open_dataset
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.preprocess import clips
from raytuner.preprocess.job import update_cache
from raytuner.train import sample_log
from raytuner.train.feed import Feed

WAN = FAMILIES["wan"]
MODEL = ModelConfig(family="wan", pretrained="tiny")
PRE = PreprocessConfig(resolution=64, bucket_step=16, min_size=32, dtype="float32")


def make_folder(root: Path) -> tuple[Path, Path]:
    """A folder of clips and images with captions beside them, and a folder cut in chunks."""
    media, chunky = root / "media", root / "chunky"
    media.mkdir(), chunky.mkdir()
    files = {
        "long.mp4": clip(20, 24),  # head: 9 frames
        "mid.webm": clip(7, 12, (48, 64), "webm", "libvpx-vp9", seed=1),  # 5 frames
        "short.mp4": clip(3, 24, seed=2),  # too short for 5
        "bad.mp4": b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8,  # corrupt
    }
    for name, data in files.items():
        (media / name).write_bytes(data)
        (media / name).with_suffix(".txt").write_text(f"a clip called {name}")
    for i in range(2):
        Image.new("RGB", (64, 64), (40 * i, 90, 200)).save(media / f"img{i}.png")
        (media / f"img{i}.txt").write_text(f"an image {i}")
    (chunky / "run.mp4").write_bytes(clip(24, 30, seed=3))  # chunks: two of 9 frames
    (chunky / "run.txt").write_text("a clip in chunks")
    return media, chunky


def data_of(root: Path, media: Path, chunky: Path) -> DataConfig:
    return DataConfig(
        images=str(media),
        cache=str(root / "cache"),
        frames=[5, 9],
        sources=[SourceConfig(path=str(chunky), frame_selection="chunks", frames=[9])],
    )


class Said(logging.Handler):
    """The messages a logger says, kept."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def encoded(ray_local, tmp_path_factory):
    """The folders encoded once: (root, data, the report, the preprocess's log lines)."""
    root = tmp_path_factory.mktemp("clips")
    media, chunky = make_folder(root)
    data = data_of(root, media, chunky)
    logger, said = logging.getLogger("raytuner.preprocess"), Said()
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(said)
    try:
        first = update_cache(MODEL, data, PRE, family=WAN)
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    return root, data, first, said.messages


def index_rows(data: DataConfig, model=MODEL, pre=PRE) -> list[dict]:
    version = cache.Version(data.cache, cache.fingerprint(model, pre))
    return version.read(version.manifest()["index"]["path"]).to_pylist()


def test_every_clip_lands_in_exactly_one_category(encoded):
    _, _, report, said = encoded
    assert report["clips"] == {
        "files": 5, "trained": 3, "corrupt": 1, "too_short": 1, "codec": 0, "bomb": 0,
        "huge": 0, "not_trained": 0, "skipped": 0, "samples": 4, "frames": {"5": 1, "9": 3},
    }  # fmt: skip
    reasons = {s["path"]: s["reason"] for s in report["skipped"]}
    assert reasons["bad.mp4"].startswith("corrupt: ")
    assert reasons["short.mp4"].startswith("too_short: 3 frames give 3")
    assert report["total"] == 7 and report["encoded"] == 6  # 4 samples and 2 images
    # images and one-frame latents share "WxH"; clip samples: "WxH/T" (T latent frames)
    assert report["buckets"] == {"80x48/3": 3, "48x80/2": 1, "64x64": 2}
    # the progress line's last: 7 files, 4 clip samples and 2 images encoded
    last = [m for m in said if m.startswith("preprocess: ") and " files read " in m][-1]
    assert re.fullmatch(
        r"preprocess: images and clip samples encoded 6/6 in [\d.]+ s \([\d.]+/s\); "
        r"files read 7/7 \(0 cached, 2 skipped\)",
        last,
    ), last


def test_each_sample_is_the_vaes_latent_of_its_decoded_frames(encoded):
    """The cached latent of a clip's head sample and of a chunk: the tiny VAE run directly on
    the frames decoded and cut again here (the dataset's rows are the index's, in order)."""
    root, data, *_ = encoded
    rows = index_rows(data)
    chunks = sorted((r for r in rows if r["path"] == "run.mp4"), key=lambda r: r["key"])
    assert [r["key"].rsplit(":", 1)[1] for r in chunks] == ["0", "1"]
    head = next(r for r in rows if r["path"] == "long.mp4")
    encode = WAN.image_encoder(Source("tiny"), "cpu")
    dataset = open_dataset(data.cache, cache.fingerprint(MODEL, PRE))
    try:
        for row, folder, frames, selection in [
            (head, root / "media", [5, 9], "head"),
            (chunks[1], root / "chunky", [9], "chunks"),
        ]:
            raw = (folder / row["path"]).read_bytes()
            _, n, samples = clips.samples_of(raw, frames, selection, 0.0, {})
            decoded = list(clips.decode_samples(raw, samples))[int(row["key"].rsplit(":")[-1])]
            seed = int(row["key"][:8], 16) ^ PRE.seed
            cut = clips.fit_clip(decoded, [(row["width"], row["height"])], PRE.crop, seed)
            shape = (n, row["height"], row["width"], 3)
            pixels = np.frombuffer(cut["pixels"], np.uint8).reshape(shape).astype(np.float32)
            x = torch.from_numpy(pixels).permute(3, 0, 1, 2)[None] / 127.5 - 1
            direct, _ = encode(x)
            cached = dataset.batch([rows.index(row)])["latent"]
            assert cached.shape == direct.shape == (1, 16, (n - 1) // 4 + 1, 6, 10)
            torch.testing.assert_close(cached, direct, rtol=1e-5, atol=1e-5)
    finally:
        dataset.close()


def test_the_sample_log_names_each_sample_once_a_chunk_by_its_place(encoded, tmp_path):
    """An epoch's sample log (``train.sample_log``, as a worker writes it from its feed) names
    each sample once: the two chunks of ``run.mp4`` as ``run.mp4#0`` and ``run.mp4#1`` (one
    path for both before), an image and a one-sample clip by its path as before."""
    _, data, *_ = encoded
    dataset = open_dataset(data.cache, cache.fingerprint(MODEL, PRE))
    feed = Feed(
        dataset, seed=0, global_batch_size=1, remainder="drop", rank=0, world=1, prefetch=1,
        pin=False,
    )  # fmt: skip
    log = sample_log.SampleLog(str(tmp_path), "0", rank=0, world=1)
    cursor, step = (0, 0), 0
    feed.start(*cursor)
    try:
        while cursor[0] == 0:
            batch = feed.next(*cursor)
            step, cursor = step + 1, batch.after()
            log.add(step, batch.epoch, batch.index, batch.ids)
    finally:
        feed.close()
        dataset.close()
    log.flush()
    ids = [i for step_ids in sample_log.trained(str(tmp_path)).values() for i in step_ids]
    assert sorted(ids) == [
        "img0.png", "img1.png", "long.mp4", "mid.webm", "run.mp4#0", "run.mp4#1"
    ]  # fmt: skip


@pytest.mark.slow
def test_a_rerun_encodes_nothing_and_an_edited_clip_alone_again(encoded):
    root, data, *_ = encoded
    again = update_cache(MODEL, data, PRE, family=WAN)
    assert again["encoded"] == 0 and again["already_cached"] == 6
    assert again["clips"]["trained"] == 3
    (root / "media" / "long.mp4").write_bytes(clip(20, 24, seed=9))
    edited = update_cache(MODEL, data, PRE, family=WAN)
    assert edited["encoded"] == 1 and edited["already_cached"] == 5
    keys = {r["path"]: r["key"] for r in index_rows(data)}
    assert keys["long.mp4"].split(":")[0] != keys["mid.webm"].split(":")[0]


@pytest.mark.slow
def test_an_image_family_reports_clips_as_not_trained(encoded, tmp_path):
    """Its images are encoded, each clip reported ``not_trained`` (no decode, no crash)."""
    root, *_ = encoded
    media = tmp_path / "media"
    shutil.copytree(root / "media", media)
    data = DataConfig(images=str(media), cache=str(tmp_path / "cache"))
    sd15 = ModelConfig(family="sd15", pretrained="tiny")
    report = update_cache(sd15, data, PRE, family=FAMILIES["sd15"])
    assert report["encoded"] == 2 and report["clips"]["not_trained"] == 4
    assert report["clips"]["trained"] == 0 and report["clips"]["samples"] == 0
    reasons = {s["path"]: s["reason"] for s in report["skipped"]}
    assert reasons["long.mp4"] == "a video clip: the model family trains images only"


def test_a_stream_block_holds_one_clip_where_a_sample_is_over_64_mib():
    """81 frames at 832 px (a 97 MB+ sample): a listed clip a block, not a batch of 8; small
    clips share a block, within 64 MiB of samples and without rounding up to a batch."""
    from raytuner.preprocess.pipeline import BLOCK_PIXEL_BYTES, rows_per_block

    assert rows_per_block(100, 8, 832, 1, frames=81) == 1
    rows = rows_per_block(1000, 8, 64, 1, frames=9)  # not rounded to 256
    assert rows * 64 * 64 * 3 * 9 <= BLOCK_PIXEL_BYTES and rows == 250  # a quarter: 2 actors + 2
    assert rows_per_block(1000, 8, 64, 1) % 8 == 0  # images: whole batches, as before


def other_bytes_same_size_and_mtime(path: Path) -> bytes:
    """Overwrite a file with zeros of its size and put its mtime back: what a rerun trusting
    its size and mtime cannot notice, and one reading it reports ``corrupt``. Its old bytes."""
    old, stat = path.read_bytes(), path.stat()
    path.write_bytes(bytes(len(old)))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    return old


def stable(report: dict) -> dict:
    """A report less its times (and the text bytes, which a new caption changes)."""
    times = {"seconds", "images_per_s", "first_encoded_s", "stages", "text"}
    return {k: v for k, v in report.items() if k not in times}


@pytest.mark.slow
def test_a_rerun_trusts_an_unchanged_clip_by_size_and_mtime_as_an_image(encoded):
    """A clip listed with the committed index's size and mtime, under the same frame settings
    and with every sample cached, is not read again (100,000 clips of 10 to 50 MB on S3 are 1 to
    5 TB a rerun would download); its caption is. Proof: other bytes of the same size with the
    mtime put back go unnoticed, as for an image. A changed mtime, or other frame settings of
    its source, read the clip again: zeros are then found corrupt, new content encoded."""
    root, data, *_ = encoded
    media, chunky = root / "media", root / "chunky"
    rerun = update_cache(MODEL, data, PRE, family=WAN)  # nothing changed: today's counts
    assert (rerun["total"], rerun["encoded"], rerun["already_cached"]) == (7, 0, 6)
    assert rerun["clips"] == {
        "files": 5, "trained": 3, "corrupt": 1, "too_short": 1, "codec": 0, "bomb": 0,
        "huge": 0, "not_trained": 0, "skipped": 0, "samples": 4, "frames": {"5": 1, "9": 3},
    }  # fmt: skip
    before = {(r["path"], r["key"]) for r in index_rows(data)}
    long_clip = other_bytes_same_size_and_mtime(media / "long.mp4")  # a head sample
    run_clip = other_bytes_same_size_and_mtime(chunky / "run.mp4")  # two chunks
    (chunky / "run.txt").write_text("a clip in chunks, captioned again")
    trusted = update_cache(MODEL, data, PRE, family=WAN)
    assert stable(trusted) == stable(rerun)  # not read: the same report, nothing encoded
    rows = index_rows(data)
    assert {(r["path"], r["key"]) for r in rows} == before
    assert {r["caption"] for r in rows if r["path"] == "run.mp4"} == {
        "a clip in chunks, captioned again"
    }

    mid_clip = (media / "mid.webm").read_bytes()
    os.utime(media / "long.mp4")  # its mtime changed: read, its zeros found
    (chunky / "run.mp4").write_bytes(run_clip)  # rewritten as it was: read, nothing to encode
    (media / "mid.webm").write_bytes(clip(7, 12, (48, 64), "webm", "libvpx-vp9", seed=5))
    touched = update_cache(MODEL, data, PRE, family=WAN)
    assert (touched["encoded"], touched["already_cached"]) == (1, 4)  # mid.webm's new sample
    assert (touched["clips"]["trained"], touched["clips"]["corrupt"]) == (2, 2)
    reasons = {s["path"]: s["reason"] for s in touched["skipped"]}
    assert reasons["long.mp4"].startswith("corrupt: ")

    (media / "long.mp4").write_bytes(long_clip)
    other_bytes_same_size_and_mtime(media / "mid.webm")  # trusted under data.frames [5, 9] only
    other_bytes_same_size_and_mtime(chunky / "run.mp4")  # its source's settings are the same
    fewer = dataclasses.replace(data, frames=[5])  # long.mp4 takes 5 frames, mid.webm's read
    try:
        changed = update_cache(MODEL, fewer, PRE, family=WAN)
    finally:
        (media / "mid.webm").write_bytes(mid_clip)
        (chunky / "run.mp4").write_bytes(run_clip)
    assert (changed["encoded"], changed["already_cached"]) == (1, 4)  # long.mp4's 5 frames
    assert (changed["clips"]["corrupt"], changed["clips"]["frames"]) == (2, {"5": 1, "9": 2})
    keys = {r["path"]: r["key"] for r in index_rows(fewer)}
    assert keys["long.mp4"].split(":")[2] == "5" and "mid.webm" not in keys
