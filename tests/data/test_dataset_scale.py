"""Training at dataset scale: a worker's memory does not grow with the cache, and what the
resume refusal tells a user when the dataset changed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import SKEWED_JOB

from raytuner.api import train
from raytuner.config import load_job
from raytuner.data import cache
from raytuner.data.datasets import describe_change
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.tools import synthetic

TINY = Source("tiny")

# the session's skewed job, as one worker training 3 steps on 64x64 float32 latents
OVERRIDES = [
    "preprocess.resolution=512",
    'preprocess.dtype="float32"',
    "train.max_steps=3",
    "train.global_batch_size=2",
    "train.log_every=3",
    "train.sample_log=false",
    "train.tensorboard=false",
    "scaling.workers=1",
    "scaling.cpus_per_worker=1.0",
    "checkpoint.every_steps=3",
]


def tiny_shapes(width: int, height: int) -> dict[str, tuple[int, ...]]:
    """What the tiny SDXL's encoders store for an image of this bucket."""
    family = FAMILIES["sdxl"]
    latent = family.image_encoder(TINY, "cpu")(torch.zeros(1, 3, 64, 64))[0]
    factor = 64 // latent.shape[-1]
    text = family.text_encoder(TINY, "cpu")([""])
    return {"latent": (latent.shape[1], height // factor, width // factor)} | {
        name: tuple(t.shape[1:]) for name, t in text.items()
    }


def trained_on(root: Path, rows: int, shapes: dict) -> tuple[int, int]:
    """Train the job on a synthetic cache of ``rows`` 64x64 float32 latents (64 KiB each):
    (the worker's peak RSS, the cache's bytes)."""
    (root / "images").mkdir(parents=True)
    (root / "job.toml").write_text(SKEWED_JOB.format(root=root))
    job = load_job(root / "job.toml", OVERRIDES)
    version = cache.Version(job.data.cache, cache.fingerprint(job.model, job.preprocess))
    manifest = synthetic.write_cache(
        version,
        buckets=[(512, 512)] * rows,
        captions=[i % 8 for i in range(rows)],
        repeats=[1] * rows,
        shapes=lambda w, h: shapes,
        family="sdxl",
        dtype="float32",
        sources=job.data.all_sources(),  # the job's own dataset: train() trains it
    )
    summary = train(job)
    assert summary["step"] == 3
    files = manifest["latents"] + manifest["text"] + [manifest["index"], manifest["captions"]]
    return summary["metrics"]["peak_rss_bytes"], sum(f["bytes"] for f in files)


@pytest.mark.slow  # two training runs: ~70 s
@pytest.mark.timeout(600)
def test_a_workers_memory_does_not_grow_with_the_cache(ray_local, tmp_path):
    shapes = tiny_shapes(512, 512)
    small_rss, small_bytes = trained_on(tmp_path / "small", 160, shapes)
    large_rss, large_bytes = trained_on(tmp_path / "large", 3200, shapes)  # 20x: ~200 MiB more
    extra = large_bytes - small_bytes
    growth = large_rss - small_rss
    print(f"cache {small_bytes} -> {large_bytes} bytes; worker peak RSS {small_rss} -> {large_rss}")
    assert extra > 190 * 2**20
    assert growth < extra / 4, f"peak RSS grew by {growth} bytes for {extra} more cache bytes"


def test_a_changed_dataset_is_described_by_what_changed():
    def row(path, key="k", caption="c", repeats=1, source=0):
        return {"source_index": source, "path": path, "key": key, "caption_key": caption} | {
            "repeats": repeats
        }

    old = [row("a.png"), row("b.png"), row("c.png"), row("d.png"), row("e.png", repeats=2)]
    old.append(row("a.png", source=1))  # the same path in another source
    new = [row("a.png", key="k2"), row("b.png", caption="c2"), row("c.png"), row("e.png")]
    new.append(row("a.png", source=1))
    new += [row(f"new{i}.png") for i in range(7)]
    text = describe_change(old, new)
    assert text.startswith("7 added (new0.png, new1.png, new2.png, new3.png, new4.png, … 2 more)")
    for part in ("1 removed (d.png)", "1 edited (a.png)", "1 caption changed (b.png)"):
        assert part in text
    assert "1 repeats changed (e.png)" in text
    assert describe_change(old, old) == "the same images in another order"
