"""A job that asks for more than the cluster has fails within `scaling.resource_wait_s`, saying
what it asked for and what exists, instead of Ray Train retrying its start every minute."""

from __future__ import annotations

import time

import pytest

from raytuner.api import train
from raytuner.config import load_job
from raytuner.data import cache
from raytuner.tools import synthetic

JOB = """
[model]
family = "sdxl"
[data]
images = "{root}/images"
cache = "{root}/cache"
[train]
output = "{root}/runs"
global_batch_size = 8
[scaling]
workers = [3, 4]
cpus_per_worker = 1.0
resource_wait_s = 2
"""


def test_a_group_the_cluster_cannot_hold_fails_in_the_stated_time(ray_local, tmp_path):
    (tmp_path / "job.toml").write_text(JOB.format(root=tmp_path))
    job = load_job(tmp_path / "job.toml")
    version = cache.Version(job.data.cache, cache.fingerprint(job.model, job.preprocess))
    shapes = lambda w, h: {"latent": (4, h // 8, w // 8), "prompt_embeds": (3, 8)}  # noqa: E731
    synthetic.write_cache(
        version,
        buckets=[(64, 64)] * 8,
        captions=[0] * 8,
        repeats=[1] * 8,
        shapes=shapes,
        family="sdxl",
    )
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        train(job)
    assert time.monotonic() - started < 30
    message = str(caught.value)
    assert "3 training workers need 3 CPU" in message and "2 CPU in all" in message
    assert "scaling.resource_wait_s" in message


def test_every_ray_train_retry_is_bounded_and_a_job_sets_the_bounds(tmp_path):
    from raytuner.train.trainer import failure_config

    (tmp_path / "job.toml").write_text(JOB.format(root=tmp_path))
    bounded = failure_config(load_job(tmp_path / "job.toml").checkpoint)
    limits = (bounded.max_failures, bounded.max_preemption_failures)
    assert all(0 <= n < 1000 for n in (*limits, bounded.controller_failure_limit))
    overrides = ["checkpoint.max_preemption_failures=5", "checkpoint.controller_failure_limit=0"]
    chosen = failure_config(load_job(tmp_path / "job.toml", overrides).checkpoint)
    assert (chosen.max_preemption_failures, chosen.controller_failure_limit) == (5, 0)
