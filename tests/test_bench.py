"""`raytuner bench …` prints the figures the README records (no timing assertions here)."""

from __future__ import annotations

import json
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
