"""What needs CUDA: skipped without a GPU (CI has none). On a GPU machine:
`python -m pytest -m gpu tests/bench/test_gpu.py --noconftest` (no Ray needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raytuner.config import load_job
from raytuner.data import cache
from raytuner.data.reader import open_dataset
from raytuner.families import get_family
from raytuner.tools import synthetic
from raytuner.tools.bench.step import bench_step
from raytuner.train.feed import Feed
from raytuner.train.model import trainable_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
REPO = Path(__file__).resolve().parents[2]
CUDA = torch.device("cuda")


def test_frozen_weights_are_bfloat16_on_a_gpu_and_the_step_autocasts():
    job = load_job(REPO / "jobs" / "tiny.toml")
    family = get_family(job.model.family)
    denoiser, weights, source, amp, *_ = trainable_model(
        job.model, job.train, job.lora, family, CUDA
    )
    frozen = {p.dtype for p in denoiser.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16} and source.dtype == torch.bfloat16
    assert {p.dtype for p in weights.params} == {torch.float32} and amp == torch.bfloat16
    batch = family.example_batch(_tiny_shapes(), 2, (64, 64), CUDA, torch.float32)
    with torch.autocast("cuda", dtype=amp):
        loss_fn = family.loss(source, job.objective.for_family(family))
        loss = loss_fn(denoiser, batch, _generators(2)).mean()
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in weights.params]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)


def test_the_feed_hands_out_pinned_batches(tmp_path):
    version = cache.Version(str(tmp_path), "synthetic")
    synthetic.write_cache(
        version,
        buckets=[(16, 16)] * 8,
        captions=list(range(8)),
        repeats=[1] * 8,
        shapes=lambda w, h: {"latent": (4, h // 8, w // 8), "prompt_embeds": (3, 8)},
        family="test",
    )
    data = open_dataset(str(tmp_path), "synthetic")
    feed = Feed(
        data, seed=0, global_batch_size=4, remainder="drop", rank=0, world=1, prefetch=2,
        pin=True,
    )  # fmt: skip
    feed.start(0, 0)
    try:
        batch = feed.next(0, 0)
        assert all(t.is_pinned() for t in batch.tensors.values())
    finally:
        feed.close()
        data.close()


def test_plan_is_within_15_percent_of_the_measured_peak():
    """One full-size model (SD1.5 at 512 px, random weights): what ``raytuner plan`` traces for
    the step against ``torch.cuda.max_memory_allocated`` of the same step."""
    overrides = ['model.pretrained="random"', "train.micro_batch_size=2"]
    job = load_job(REPO / "jobs" / "sd15.toml", overrides)
    result = bench_step(job, get_family(job.model.family), steps=2, as_json=True)
    assert 0.85 <= result["planned_over_measured"] <= 1.15


def _tiny_shapes() -> dict:
    family = get_family(load_job(REPO / "jobs" / "tiny.toml").model.family)
    from raytuner.tools.plan import trace as plan

    job = load_job(REPO / "jobs" / "tiny.toml")
    return plan.trace_encoders(job, family, plan.largest_bucket(job, family))[1]


def _generators(n: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(i) for i in range(n)]
