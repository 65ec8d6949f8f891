"""Shared fixtures: a local Ray for in-process tests, tiny image folders, the repo root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Local Rays (in process and in `raytuner` subprocesses) start without their dashboard: ~3 s
# and a busy process less each on the 2-core machine. The job-submission test's cluster has one.
os.environ.setdefault("RAYTUNER_LOCAL_DASHBOARD", "0")
# Ray Train's controller polls its workers every 2 s: it takes a report, and sees a run end, at
# the next poll. Every 0.5 s makes each tiny run seconds shorter (measured: 93 -> 73 s for two
# training tests); the behaviour tested is the same. Subprocesses and test clusters inherit it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster (2 CPUs) shared by the in-process tests, shut down at the end."""
    import ray

    from raytuner import runtime

    os.environ.pop("RAY_ADDRESS", None)  # never attach to somebody else's cluster
    runtime.connect(num_cpus=2)
    yield ray
    ray.shutdown()


@pytest.fixture
def demo_images(tmp_path: Path) -> Path:
    from raytuner.tools.demo_images import make_demo_images

    return make_demo_images(tmp_path / "images", per_aspect=4)


# The skewed job of the training tests: 9 + 3 + 1 rows. With 4 samples per global batch and
# per-rank bucketing, two ranks would end the epoch after different numbers of steps; the global
# schedule pads the small buckets (5 global batches an epoch).
SKEWED_SHAPES = {"square": ((64, 64), 9), "wide": ((96, 64), 3), "tall": ((64, 112), 1)}

SKEWED_JOB = """
[model]
family = "sdxl"
pretrained = "tiny"

[data]
images = "{root}/images"
cache = "{root}/cache"

[preprocess]
resolution = 64
bucket_step = 16
batch_size = 16

[train]
output = "{root}/runs"
max_steps = 12
global_batch_size = 4
remainder = "pad"
learning_rate = 1e-2
log_every = 1
sample_log = true

[lora]
save_dtype = "float32"  # runs' exports are compared to float rounding (the default rounds)

[scaling]
workers = 2
cpus_per_worker = 0.5

[checkpoint]
every_steps = 4
keep = 2
max_failures = 2
"""


@pytest.fixture(scope="session")
def job_file(ray_local, tmp_path_factory) -> Path:
    """The skewed job, its images drawn and its cache committed once per session."""
    import numpy as np
    from PIL import Image

    from raytuner.api import preprocess
    from raytuner.config import load_job

    root = tmp_path_factory.mktemp("skewed")
    rng = np.random.default_rng(0)
    (root / "images").mkdir()
    for kind, (size, count) in SKEWED_SHAPES.items():
        for i in range(count):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "images" / f"{kind}{i}.png")
            (root / "images" / f"{kind}{i}.txt").write_text(f"a noisy {kind} picture {i}")
    path = root / "job.toml"
    path.write_text(SKEWED_JOB.format(root=root))
    job = load_job(path)
    report = preprocess(job)
    assert report["encoded"] == sum(n for _, n in SKEWED_SHAPES.values())
    return path
