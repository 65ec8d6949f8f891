"""The preprocess job on a real local Ray over a hostile folder: every file accounted for, exact
latents, text once per caption, incremental re-runs, sources with repeats and metadata."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from hostile import make_hostile
from PIL import Image

from raytuner.config import DataConfig, ModelConfig, PreprocessConfig, SourceConfig
from raytuner.data import cache
from raytuner.data.keys import caption_key
from raytuner.data.reader import CachedDataset, open_dataset
from raytuner.families import FAMILIES
from raytuner.preprocess.job import update_cache
from raytuner.tools.bench.preprocess import _latent_bytes

MODEL = ModelConfig(family="sdxl", pretrained="tiny")
SDXL = FAMILIES["sdxl"]
PRE = PreprocessConfig(
    resolution=64, bucket_step=16, min_size=48, max_pixels=2_000_000, aspect_policy="skip"
)


def committed(data: DataConfig, name: str, pre: PreprocessConfig = PRE) -> list[dict]:
    """The rows of the committed manifest's ``index`` or ``captions`` table."""
    version = cache.Version(data.cache, cache.fingerprint(MODEL, pre))
    return version.read(version.manifest()[name]["path"]).to_pylist()


def outcome(report: dict, path: str) -> str:
    if any(d["path"] == path for d in report["duplicate_files"]):
        return "duplicate"
    reasons = [s["reason"] for s in report["skipped"] if s["path"] == path]
    return f"skipped:{reasons[0]}" if reasons else "encoded"


@pytest.fixture(scope="module")
def hostile(ray_local, tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    expect = make_hostile(root / "images", tmp_path_factory.mktemp("outside"))
    meta = root / "meta"
    meta.mkdir()
    for i in range(3):
        Image.new("RGB", (96, 96), (i * 80, 10, 10)).save(meta / f"m{i}.png")
    (meta / "metadata.jsonl").write_text(
        "\n".join(json.dumps({"file_name": f"m{i}.png", "text": f"metadata {i}"}) for i in range(3))
    )
    data = DataConfig(
        images=str(root / "images"),
        cache=str(root / "cache"),
        sources=[SourceConfig(path=str(meta), repeats=3)],
    )
    report = update_cache(MODEL, data, PRE, family=SDXL)
    return data, expect, report, open_dataset(data.cache, cache.fingerprint(MODEL, PRE))


def test_every_file_lands_in_exactly_one_category(hostile):
    _, expect, report, _ = hostile
    assert report["total"] == len(expect) + 3  # junk and hidden files are not inputs
    assert report["total"] == (
        report["encoded"] + report["already_cached"] + report["duplicates"] + len(report["skipped"])
    )
    for path, wanted in expect.items():
        got = outcome(report, path)
        category, _, words = wanted.partition(":")
        assert got.split(":")[0] == category and words in got, f"{path}: {wanted} != {got}"
    assert report["encoded"] == sum(v == "encoded" for v in expect.values()) + 3


def test_report_is_kept_beside_the_manifest(hostile):
    data, _, report, _ = hostile
    version = cache.Version(data.cache, cache.fingerprint(MODEL, PRE))
    kept = json.loads((Path(version.root) / "report.json").read_text())
    assert kept == report == version.manifest()["report"]


def test_report_times_each_stage(hostile):
    """Where a preprocess spent its time, stage by stage (``bench preprocess`` compares them
    with its bare loop's): the stream's steps summed over their blocks, the driver's own."""
    _, _, report, _ = hostile
    stages = report["stages"]
    # "load": what the encoder waited for its models, when it did (they load on a thread)
    assert (
        {"list", "decode", "encode", "write", "locate"}
        <= set(stages)
        <= {"list", "decode", "encode", "write", "locate", "load"}
    )
    for name, times in stages.items():
        assert times["seconds"] >= 0 and times["cpu_seconds"] >= 0, name
    assert all(stages[name]["blocks"] >= 1 for name in ("decode", "encode", "write"))
    assert stages["encode"]["seconds"] > 0 and stages["decode"]["seconds"] > 0


def test_captions_fallbacks_and_tolerant_decoding(hostile):
    data, _, report, _ = hostile
    rows = {r["path"]: r for r in committed(data, "index")}
    assert rows["no caption here.png"]["caption"] == "no caption here"
    assert rows["empty-caption.png"]["caption"] == "empty-caption"
    assert rows["latin1-caption.png"]["caption"] == "caf\ufffd cr\ufffdme"
    assert rows["m1.png"]["caption"] == "metadata 1"
    assert rows["日本 ü/写真 1.png"]["caption"] == "unicode path"
    assert rows["animated.gif"]["caption"] == "animated"
    assert report["captions"]["fallback"] == 3  # no caption here, empty-caption, animated
    assert report["captions"]["distinct"] == len({r["caption"] for r in rows.values()})


def test_repeats_are_a_row_weight_not_copies(hostile):
    data, _, _, dataset = hostile
    rows = committed(data, "index")
    assert [r["repeats"] for r in rows if r["path"].startswith("m")] == [3, 3, 3]
    assert len({r["key"] for r in rows}) == len(rows)  # one row, one latent, per image
    manifest = dataset.manifest
    assert sum(manifest["appearances"].values()) == len(rows) + 2 * 3


def test_each_latent_is_exactly_its_own_bytes(hostile):
    data, _, _, dataset = hostile
    version = cache.Version(data.cache, cache.fingerprint(MODEL, PRE))
    cells = {}
    for entry in version.manifest()["latents"]:
        for row in version.read(entry["path"], ["key", "latent", "latent_shape"]).to_pylist():
            assert len(row["latent"]) == math.prod(row["latent_shape"]) * 2  # bf16, one row
            cells[row["key"]] = row["latent"]
    stored, tensor = _latent_bytes(version, dataset.manifest)
    # each cell costs its bytes plus its page's header and length: ~30 bytes (0.02 % of an
    # SDXL latent; 6 % of the tiny model's 480-byte ones)
    assert tensor <= stored <= tensor + 40 * len(cells)
    # the index says where each latent lies: exactly its bytes, read from the file itself
    for row in committed(data, "index"):
        raw = Path(version.path(row["latent_file"])).read_bytes()
        cell = cells[row["key"]]
        assert raw[row["latent_at"] : row["latent_at"] + len(cell)] == cell


def test_conditioning_follows_exif_and_buckets(hostile):
    _, _, _, dataset = hostile
    i = dataset.paths.index("exif-rotated.jpg")
    batch = dataset.batch([i])
    assert batch["original_size"].tolist() == [[128, 80]]  # (h, w) after the EXIF rotation
    assert batch["target_size"].tolist() == [[80, 48]]  # the portrait bucket
    assert batch["latent"].shape == (1, 4, 10, 6)
    assert torch.isfinite(batch["latent"]).all()


def test_text_once_per_distinct_caption_plus_empty(hostile):
    data, _, _, dataset = hostile
    captions = {r["caption_key"] for r in committed(data, "index")}
    assert [r["caption_key"] for r in committed(data, "captions")] == sorted(
        captions | {caption_key("")}
    )
    square = [i for i, b in enumerate(dataset.buckets) if b == "64x64"][:2]
    batch = dataset.batch(square)
    assert batch["prompt_embeds"].shape == (2, 77, 64)
    assert batch["pooled_prompt_embeds"].shape == (2, 32)


def wide_images(folder: Path) -> Path:
    """3 wide images: the 80x48 bucket leaves ~70 columns of each to crop."""
    folder.mkdir(parents=True)
    for i in range(3):
        Image.new("RGB", (220, 70), (i * 90, 0, 0)).save(folder / f"wide{i}.png")
    return folder


def crops(dataset: CachedDataset, paths: list[str] | None = None) -> list:
    rows = range(len(dataset)) if paths is None else map(dataset.paths.index, paths)
    return [dataset.batch([i])["crop_top_left"].tolist() for i in rows]


# the centre crop of each wide image: (151 - 80) // 2 (an image is scaled to 48 rows)
CENTRED = [[[0, 35]]] * 3


@pytest.mark.slow
def test_incremental_reruns(ray_local, tmp_path):
    """Also the centre crop, and the posterior std stored (``store_std``), on its first run:
    one preprocess less than a run of their own (test_random_crop_is_reproducible below)."""
    from raytuner.tools.demo_images import make_demo_images

    images = make_demo_images(tmp_path / "images", per_aspect=2)
    wide = [f"wide/wide{i}.png" for i in range(3)]
    wide_images(images / "wide")
    data = DataConfig(images=f"file://{images}", cache=f"file://{tmp_path / 'cache'}")
    pre = PreprocessConfig(resolution=64, bucket_step=16, crop="center", store_std=True)
    first = update_cache(MODEL, data, pre, family=SDXL)
    assert (first["encoded"], first["already_cached"]) == (9, 0)
    dataset = open_dataset(data.cache, cache.fingerprint(MODEL, pre))
    assert crops(dataset, wide) == CENTRED
    batch = dataset.batch([dataset.paths.index(wide[0])])  # the std, shaped like the latent
    assert batch["latent_std"].shape == batch["latent"].shape
    assert (batch["latent_std"] > 0).all()
    # nothing changed: probed only, no encoder starts
    again = update_cache(MODEL, data, pre, family=SDXL)
    assert (again["encoded"], again["already_cached"]) == (0, 9)
    (images / "wide" / "wide0.txt").write_text("only this caption is new")  # images unchanged
    captioned = update_cache(MODEL, data, pre, family=SDXL)
    assert (captioned["encoded"], captioned["already_cached"]) == (0, 9)
    assert "only this caption is new" in [r["caption"] for r in committed(data, "index", pre)]

    Image.new("RGB", (96, 96), (1, 2, 3)).save(images / "square" / "square_00.png")
    (images / "portrait" / "portrait_01.png").unlink()
    (images / "portrait" / "portrait_00.txt").write_text("a brand new caption")
    edited = update_cache(MODEL, data, pre, family=SDXL)
    assert (edited["total"], edited["encoded"], edited["already_cached"]) == (8, 1, 7)
    rows = committed(data, "index", pre)
    assert len(rows) == 8 and "portrait/portrait_01.png" not in [r["path"] for r in rows]
    assert "a brand new caption" in [r["caption"] for r in rows]

    # another resolution is another cache version (its re-encode is exercised by the cache-ops
    # gc test, which commits a second version beside the first)
    bigger = PreprocessConfig(resolution=96, bucket_step=16)
    assert cache.fingerprint(MODEL, bigger) != cache.fingerprint(MODEL, pre)


@pytest.mark.slow
def test_random_crop_is_reproducible(ray_local, tmp_path):
    """The centre crops of the same images (CENTRED) are checked by test_incremental_reruns."""
    images = wide_images(tmp_path / "images")

    def encode(pre: PreprocessConfig, cache_dir: Path) -> tuple[dict, CachedDataset]:
        data = DataConfig(images=str(images), cache=str(cache_dir))
        report = update_cache(MODEL, data, pre, family=SDXL)
        return report, open_dataset(data.cache, cache.fingerprint(MODEL, pre))

    seeded = PreprocessConfig(resolution=64, bucket_step=16, crop="random", seed=3)
    first = crops(encode(seeded, tmp_path / "a")[1])
    # The next run encodes every image again: their latents are lost (the captions' text
    # embeddings are kept, which saves encoding them again).
    version = cache.Version(str(tmp_path / "a"), cache.fingerprint(MODEL, seeded))
    for latents in Path(version.path("parts")).glob("*/latents"):
        shutil.rmtree(latents)
    report, dataset = encode(seeded, tmp_path / "a")
    assert report["encoded"] == 3
    second = crops(dataset)

    assert first == second  # seeded: the same crops on every run
    assert first != CENTRED


def test_sources_reject_missing_folders(ray_local, tmp_path):
    data = DataConfig(images=str(tmp_path / "nope"), cache=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="is not a folder"):
        update_cache(MODEL, data, PRE, family=SDXL)
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize(
    ("files", "batch", "side", "actors"),
    [
        (2000, 8, 64, 1),
        (12, 8, 64, 1),
        (100_000, 8, 1024, 8),
        (100_000, 4, 2048, 32),
        (7, 3, 64, 2),
    ],
)
def test_stream_blocks_hold_whole_batches_and_keep_every_actor_fed(files, batch, side, actors):
    """Blocks of several encoder batches (each block costs a task per step), never more pixels
    than about 64 MiB, and enough blocks that decoding overlaps encoding on every actor."""
    from raytuner.preprocess.pipeline import BLOCK_PIXEL_BYTES, rows_per_block

    rows = rows_per_block(files, batch, side, actors)
    assert rows % batch == 0 and rows >= batch
    if rows > batch:  # a single batch may exceed the targets; a larger block never does
        assert rows * side * side * 3 <= BLOCK_PIXEL_BYTES + batch * side * side * 3
        assert math.ceil(files / rows) >= min(2 * actors + 2, math.ceil(files / batch))
