"""A run on GPUs takes plan's fastest step settings that fit the GPU a worker gets (gradient
checkpointing off before on, the largest micro-batch), keeps what the job names, and says so
(``tools/plan/adopt.py``). Traced on the tiny SDXL job, with GPU sizes chosen between the
peaks plan traces for each setting."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from raytuner.config import load_job
from raytuner.families import FAMILIES
from raytuner.tools.plan import adopt
from raytuner.tools.plan.trace import MARGIN, Traces, largest_bucket, trace_encoders

REPO = Path(__file__).resolve().parents[2]
SDXL = FAMILIES["sdxl"]


def _job(*settings: str):
    # 16 samples over 2 workers: a slice of 8 a worker; replicated (what a run adopts for is
    # the decided strategy: auto is decided first, test_plan_auto.py)
    sets = ["train.global_batch_size=16", 'scaling.strategy="ddp"', *settings]
    return load_job(REPO / "jobs" / "tiny.toml", sets)


@pytest.fixture(scope="module")
def peaks() -> dict:
    """The tiny job's worker peak for each (checkpointing, micro-batch)."""
    job = _job()
    size = largest_bucket(job, SDXL)
    traces = Traces(SDXL, trace_encoders(job, SDXL, size)[1], size)
    return {(c, m): traces.step(job, m, c)["peak_bytes"] for c in (False, True) for m in (1, 8)}


def _gpu(peak: int) -> tuple[str, int]:
    """A GPU whose usable part (plan's margin kept free) holds ``peak`` bytes and no more."""
    return "a test GPU", int(peak / (1 - MARGIN)) + 1024


def test_a_job_whose_defaults_fit_runs_as_it_is_and_nothing_is_said(peaks):
    job = _job()
    adopted, line = adopt.adopt(job, SDXL, _gpu(peaks[(False, 8)]))
    assert adopted is job and line == ""


def test_a_job_too_big_for_the_gpu_takes_the_fastest_setting_that_fits_and_says_so(peaks):
    # checkpointing off fits only one sample a forward: off and 1 before on and 8
    assert peaks[(False, 1)] < peaks[(False, 8)] and peaks[(True, 8)] < peaks[(False, 8)]
    job = _job()
    adopted, line = adopt.adopt(job, SDXL, _gpu(peaks[(False, 1)]))
    assert adopted.train.gradient_checkpointing is False
    assert adopted.train.micro_batch_size == 1
    assert "train.micro_batch_size = " in line and "name them in the job" in line
    assert "a test GPU" in line and "gradient_checkpointing" not in line
    # everything else as the job says
    assert dataclasses.replace(adopted.train, micro_batch_size=0) == job.train


def test_what_the_job_names_is_kept(peaks):
    small = _gpu(peaks[(True, 8)])  # 8 a forward fits with checkpointing only
    job = _job("train.micro_batch_size=8")  # named: kept, so checkpointing is what can change
    adopted, line = adopt.adopt(job, SDXL, small)
    assert adopted.train.micro_batch_size == 8 and adopted.train.gradient_checkpointing is True
    assert line.count("train.") == 1 and "train.gradient_checkpointing = true" in line
    both = _job("train.micro_batch_size=8", "train.gradient_checkpointing=false")
    assert adopt.free_keys(both) == ()
    assert adopt.adopt(both, SDXL, small) == (both, "")


def test_nothing_that_fits_keeps_the_job_and_points_to_plan(peaks):
    job = _job()
    adopted, line = adopt.adopt(job, SDXL, _gpu(min(peaks.values()) // 2))
    assert adopted is job and "`raytuner plan`" in line


def test_block_swap_and_offload_keep_their_checkpointing():
    offload = _job("memory.activation_offload=true", "train.gradient_checkpointing=true")
    assert adopt.free_keys(offload) == ("train.micro_batch_size",)
    assert adopt.free_keys(_job()) == adopt.KEYS


def test_a_cpu_run_adopts_nothing():
    job = _job()
    ran = adopt.before_workers(job, SDXL)  # its strategy decided (auto: a replica on CPUs)
    assert not job.scaling.use_gpu and ran.train == job.train and ran.memory == job.memory
