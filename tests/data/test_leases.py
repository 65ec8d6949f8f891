"""Leases (``data/lease.py``), what keeps `raytuner cache gc` off a version in use: a preprocess
and a training run each hold one on their cache version while they run, renewed so that it
outlives its time to live, and released when they end; a job killed without cleaning up stops
renewing, and its lease expires. The time to live is shortened to one second here."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SKEWED_JOB

from raytuner import api
from raytuner.config import load_job
from raytuner.data import cache, lease
from raytuner.preprocess import job as preprocess_job
from raytuner.train import trainer

TTL_S = 1.0


@pytest.fixture
def short_leases(monkeypatch):
    """Every lease taken in this process lives ``TTL_S`` unless renewed (every third of it).
    (``Lease``'s default is bound when the class is made: ``lease.TTL_S`` alone is not read.)"""
    monkeypatch.setattr(lease, "TTL_S", TTL_S)
    monkeypatch.setattr(lease.Lease.__init__, "__defaults__", (TTL_S,))


class Stop(Exception):
    """Ends the training run before Ray Train starts (its lease is what is checked)."""


def _held_past_ttl(version: cache.Version, seen: dict, name: str, original, stop: bool):
    """``original`` (what runs inside the lease), first noting the version's live leases
    now and again three TTLs later: alive then only if renewed."""

    def wrapper(*args, **kwargs):
        first = version.leases()
        time.sleep(3 * TTL_S)
        seen[name] = (first, version.leases(), time.time())
        if stop:
            raise Stop
        return original(*args, **kwargs)

    return wrapper


def test_preprocess_and_training_hold_a_renewed_lease_while_they_run(
    job_file, tmp_path, monkeypatch, short_leases
):
    for folder in ("images", "cache"):  # the session's cache stays as it is
        shutil.copytree(job_file.parent / folder, tmp_path / folder)
    for old in tmp_path.glob("cache/*/leases"):  # expired ones of earlier tests' killed runs
        shutil.rmtree(old)
    (tmp_path / "job.toml").write_text(SKEWED_JOB.format(root=tmp_path))
    job = load_job(tmp_path / "job.toml", ['train.name="leased"'])
    version = cache.Version(job.data.cache, cache.fingerprint(job.model, job.preprocess))
    assert version.leases() == []
    seen: dict = {}
    original = preprocess_job._preprocess
    held = _held_past_ttl(version, seen, "preprocess", original, stop=False)
    monkeypatch.setattr(preprocess_job, "_preprocess", held)
    assert api.preprocess(job)["already_cached"] == 13
    held = _held_past_ttl(version, seen, "train", trainer._fit, stop=True)
    monkeypatch.setattr(trainer, "_fit", held)
    with pytest.raises(Stop):
        api.train(job)

    for name, holder in (("preprocess", "preprocess-leased"), ("train", "train-leased")):
        first, later, at = seen[name]
        assert [r["holder"] for r in first] == [holder], first
        assert [r["holder"] for r in later] == [holder], later  # three TTLs on: renewed
        assert later[0]["pid"] == first[0]["pid"] == os.getpid()  # the driver holds it
        assert first[0]["expires"] < at < later[0]["expires"]
    assert version.leases() == []  # released when each ended
    assert not list(Path(version.path(lease.LEASES)).iterdir())


KILLED = """
import sys, time
from raytuner.data import cache, lease
lease.Lease.__init__.__defaults__ = (float(sys.argv[2]),)
with cache.Version(sys.argv[1], "f" * 16).lease("killed"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_lease_its_holder_stops_renewing_expires_after_its_ttl(tmp_path):
    version = cache.Version(str(tmp_path), "f" * 16)
    holder = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(tmp_path), str(TTL_S)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        time.sleep(3 * TTL_S)
        assert [r["holder"] for r in version.leases()] == ["killed"]  # renewed meanwhile
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        killed_at = time.time()
        assert [r["holder"] for r in version.leases()] == ["killed"]  # its file stays
        while version.leases() and time.time() < killed_at + 10 * TTL_S:
            time.sleep(0.05)
        assert version.leases() == []
        assert time.time() - killed_at <= TTL_S + 1.0  # by its expiry (and a poll)
        # expired, not gone (a SIGKILL during a renewal may also leave the atomic write's
        # temporary file, which no reader takes for a lease)
        assert len(list(Path(version.path(lease.LEASES)).glob("*.json"))) == 1
    finally:
        holder.kill()
        holder.wait()
