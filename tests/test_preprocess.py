"""The Ray Data encode job on a real local Ray: complete report, exact latents, manifest last."""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest
import torch

from raytuner import storage
from raytuner.config import DataConfig, ModelConfig, PreprocessConfig
from raytuner.data import cache
from raytuner.data.buckets import make_buckets
from raytuner.data.decode import DecodeSpec, caption_key, decode_row
from raytuner.data.preprocess import preprocess
from raytuner.families import get_family

MODEL = ModelConfig(family="sdxl", pretrained="tiny")
PRE = PreprocessConfig(resolution=64, bucket_step=16)


@pytest.fixture(scope="module")
def encoded(ray_local, tmp_path_factory):
    from raytuner.demo_data import make_demo_images

    root = tmp_path_factory.mktemp("pp")
    images = make_demo_images(root / "images", per_aspect=4)
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (images / "nested" / "deeper").mkdir(parents=True)
    (images / "portrait" / "portrait_00.png").rename(images / "nested/deeper/no caption.png")
    (images / ".DS_Store").write_bytes(b"junk")
    data = DataConfig(images=str(images), cache=str(root / "cache"))
    report = preprocess(MODEL, data, PRE)
    return data, report, cache.load_cached(data.cache, cache.fingerprint(MODEL, PRE))


def test_report_accounts_for_every_image(encoded):
    _, report, _ = encoded
    assert report["total"] == 13  # 12 drawn + broken.png; .DS_Store and .txt are not images
    assert report["encoded"] == 12
    assert report["skipped"] == [{"path": "broken.png", "reason": report["skipped"][0]["reason"]}]
    assert "not a readable image" in report["skipped"][0]["reason"]
    assert report["total"] == report["encoded"] + len(report["skipped"])
    assert report["buckets"] == {"48x80": 4, "64x64": 4, "80x48": 4}


def test_missing_caption_falls_back_to_the_file_stem(encoded):
    _, _, dataset = encoded
    rows = dataset.latents.to_pydict()
    i = rows["path"].index("nested/deeper/no caption.png")
    assert rows["caption"][i] == "no caption"


def test_each_latent_is_stored_with_exactly_its_own_bytes(encoded):
    _, _, dataset = encoded
    rows = dataset.latents.to_pydict()
    for cell, shape, w, h in zip(
        rows["latent"], rows["latent_shape"], rows["width"], rows["height"], strict=True
    ):
        assert shape == [4, h // 8, w // 8]
        assert len(cell) == math.prod(shape) * 2  # bfloat16, one row, not the batch


def test_cached_latent_equals_a_direct_encode(encoded):
    data, _, dataset = encoded
    rows = dataset.latents.to_pydict()
    i = rows["path"].index("landscape/landscape_01.png")
    spec = DecodeSpec(
        root=data.images,
        buckets=make_buckets(64, 16, 0.5, 2.0),
        crop="center",
        seed=0,
        caption_fallback="stem",
    )
    row = decode_row({"path": "landscape/landscape_01.png", "caption_path": ""}, spec)
    pixels = torch.frombuffer(bytearray(row["pixels"]), dtype=torch.uint8)
    x = pixels.reshape(1, row["height"], row["width"], 3).permute(0, 3, 1, 2).float() / 127.5 - 1
    direct = get_family("sdxl").image_encoder("tiny", "", "cpu")(x)[0]
    cached = dataset.batch([i])["latent"][0]
    # equal up to bfloat16 rounding (a batched convolution is not bit-identical to a single one)
    torch.testing.assert_close(cached, direct, rtol=1e-2, atol=1e-3)
    assert not torch.equal(cached, torch.zeros_like(cached))


def test_text_is_encoded_once_per_distinct_caption_plus_empty(encoded):
    _, report, dataset = encoded
    distinct = set(dataset.latents.column("caption_key").to_pylist())
    assert report["captions"]["distinct"] == len(distinct)
    assert set(dataset.text) == distinct | {caption_key("")}
    batch = dataset.batch([0, 1])
    assert batch["prompt_embeds"].shape == (2, 32, 64)
    assert batch["pooled_prompt_embeds"].shape == (2, 32)


def test_manifest_lists_every_data_file_with_row_counts(encoded):
    data, report, _ = encoded
    fs, root = storage.resolve(cache.version_dir(data.cache, cache.fingerprint(MODEL, PRE)))
    manifest = storage.read_json(fs, f"{root}/manifest.json")
    assert manifest["report"] == report
    assert manifest["fingerprint"] == cache.fingerprint(MODEL, PRE)
    rows = sum(pq.ParquetFile(f"{root}/{f['path']}").metadata.num_rows for f in manifest["latents"])
    assert rows == sum(f["rows"] for f in manifest["latents"]) == report["encoded"]


def test_fingerprint_changes_with_encoding_settings_only():
    base = cache.fingerprint(MODEL, PRE)
    assert (
        cache.fingerprint(
            MODEL, PreprocessConfig(resolution=64, bucket_step=16, max_actors=4, batch_size=2)
        )
        == base
    )
    assert cache.fingerprint(MODEL, PreprocessConfig(resolution=128, bucket_step=16)) != base
    assert cache.fingerprint(ModelConfig(family="sdxl", pretrained="x/y"), PRE) != base


def test_training_refuses_a_global_batch_no_bucket_can_fill(encoded, tmp_path):
    from raytuner.config import ConfigError, JobConfig, TrainConfig
    from raytuner.train.trainer import train

    data, _, _ = encoded  # 4 rows per bucket
    job = JobConfig(
        model=MODEL,
        data=data,
        preprocess=PRE,
        train=TrainConfig(output=str(tmp_path), name="big", global_batch_size=8),
    )
    with pytest.raises(ConfigError, match=r'lower it or set train.remainder = "pad".*48x80'):
        train(job)
    assert not (tmp_path / "big").exists()  # refused before any worker started
