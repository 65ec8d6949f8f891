"""`raytuner bench …` prints the figures the README records (no timing assertions here)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_preprocess_prints_one_json_object():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "raytuner",
            "bench",
            "preprocess",
            "jobs/tiny.toml",
            "--images",
            "12",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("pipeline_images_per_s", "bare_images_per_s", "ratio", "bytes_per_latent_ratio"):
        assert figures[key] > 0, key
    assert figures["images"] == 12
    # each latent is stored as exactly its own bytes plus a length prefix and page headers
    assert 1.0 <= figures["bytes_per_latent_ratio"] <= 1.05


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_train_prints_one_json_object(tmp_path):
    shutil.copytree(REPO / "jobs", tmp_path / "jobs")  # its cache lands in tmp_path/runs
    result = subprocess.run(
        [sys.executable, "-m", "raytuner", "bench", "train", "jobs/tiny.toml", "--steps", "5"]
        + ["--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    for key in ("samples_per_s", "bare_samples_per_s", "ratio"):
        assert figures[key] > 0, key
    assert 0 <= figures["data_wait_fraction"] < 1
    assert figures["measured_steps"] == 5 and figures["global_batch_size"] == 4
    assert (tmp_path / "runs" / "cache").is_dir()  # the cache it trained on was made first
    assert not (tmp_path / "runs" / "bench").exists()  # the bench run stays out of the job's runs
