"""A run folder written by an older raytuner (``tests/fixtures/resume_before_move``: a tiny SDXL
LoRA stopped at its step-2 checkpoint, with the cache it trained on) resumes with today's code:
the moves of issue 38 kept the checkpoint's files and the run's identity readable."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from raytuner.api import train
from raytuner.config import load_job
from raytuner.train import sample_log

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "resume_before_move"
SAVED_STEP = 2  # its newest checkpoint
# where it was written: the cache keys a job's dataset by its image folder's absolute path, and
# training reads no image, so the resumed job names that folder as it was
WRITTEN_AT = "/tmp/raytuner-fixture/resume_before_move"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_checkpoint_written_before_the_moves_resumes_at_its_step(ray_local, tmp_path):
    root = tmp_path / "before-move"
    shutil.copytree(FIXTURE, root)
    overrides = [f'data.images="{WRITTEN_AT}/images"', f'data.cache="{root / "cache"}"',
                 f'train.output="{root / "runs"}"']  # fmt: skip
    job = load_job(root / "job.toml", [*overrides, "train.max_steps=4", "train.sample_log=true"])

    summary = train(job)

    assert summary["step"] == 4
    # the only attempt (this one) trained steps 3 and 4: it went on from the saved step 2
    (attempt,) = sample_log.read_attempts(str(root / "runs" / job.train.name))
    assert sorted(attempt) == [SAVED_STEP + 1, 4]
