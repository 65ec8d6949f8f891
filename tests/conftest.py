"""Shared fixtures: a local Ray for in-process tests, tiny image folders, the repo root."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
    from raytuner.demo_data import make_demo_images

    return make_demo_images(tmp_path / "images", per_aspect=4)
