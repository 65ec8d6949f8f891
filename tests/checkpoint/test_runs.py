"""The run folder's owner (``raytuner/layout.py``): a run started with ``checkpoint.resume =
false`` gets a timestamped name beside the old run, and `sample --checkpoint latest` renders
that new run's newest complete checkpoint, not the old run's (the bug this module fixed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytuner.checkpoint import layout
from raytuner.render.sample import latest_checkpoint


def checkpoint(run: Path, stamp: str, complete: bool = True) -> Path:
    folder = run / f"{layout.CHECKPOINT_PREFIX}{stamp}"
    (folder / layout.EXPORT / layout.LORA_DIR).mkdir(parents=True)
    if complete:
        (folder / layout.STATE).write_text(json.dumps({"step": 1}))
    return folder


def test_resume_false_starts_a_run_beside_the_old_one_and_latest_is_the_new_ones(tmp_path):
    out = tmp_path / "runs"
    assert layout.choose_run(str(out), "job", resume=False) == "job"  # nothing there yet
    checkpoint(out / "job", "2026-11-20_10-00-00.000000")
    old_newest = checkpoint(out / "job", "2026-11-20_11-00-00.000000")
    assert layout.choose_run(str(out), "job", resume=True) == "job"
    fresh = layout.choose_run(str(out), "job", resume=False)
    assert fresh.startswith("job-") and fresh != "job"
    assert latest_checkpoint(str(out), "job")[1] == str(old_newest)

    new = checkpoint(out / fresh, "2026-11-21_09-00-00.000000")
    checkpoint(out / fresh, "2026-11-21_09-30-00.000000", complete=False)  # being written
    checkpoint(out / "jobless-20261122-000000", "2026-11-22_00-00-00.000000")  # another job
    assert latest_checkpoint(str(out), "job")[1] == str(new)
    assert [Path(r).name for r in layout.job_runs(str(out), "job")] == sorted(["job", fresh])


def test_latest_without_a_checkpoint_says_to_train_first(tmp_path):
    with pytest.raises(FileNotFoundError, match="train the job first"):
        latest_checkpoint(str(tmp_path / "runs"), "job")
