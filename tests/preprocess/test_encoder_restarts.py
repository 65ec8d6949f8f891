"""The encoder restart bound (``preprocess.max_restarts``): an encoder actor that dies each time
it starts (as one killed for memory would) is restarted that many times, then the preprocess
fails with one line naming why, instead of restarting it without end. `raytuner preprocess`
runs with its own local Ray; a thread here SIGKILLs every encoder actor process
("MapWorker(MapBatches(Encoder))") of it the moment it appears."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from raytuner.data import cache
from raytuner.tools.demo_images import make_demo_images

MAX_RESTARTS = 1
ENCODER = "MapBatches(Encoder)"  # in the process title of Ray Data's encoder actors

JOB = """
[model]
family = "sdxl"
pretrained = "tiny"
[data]
images = "{root}/images"
cache = "{root}/cache"
[preprocess]
resolution = 64
bucket_step = 16
batch_size = 2
min_actors = 1
max_actors = 1
max_restarts = {restarts}
[train]
output = "{root}/runs"
"""


def _kill_encoders(proc: subprocess.Popen, killed: list, stop: threading.Event) -> None:
    """SIGKILL each encoder actor process of ``proc`` as it appears (at most a few more than
    the bound allows: a pool that restarts without end shows as one kill too many)."""
    while not stop.is_set() and proc.poll() is None and len(killed) <= MAX_RESTARTS + 3:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for child in children:
            try:
                if child.pid not in killed and ENCODER in " ".join(child.cmdline()):
                    child.kill()
                    killed.append(child.pid)
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(600)  # about 20 s: the encoder dies before it has loaded its models
def test_an_encoder_killed_each_time_fails_the_preprocess_after_max_restarts(tmp_path):
    make_demo_images(tmp_path / "images", per_aspect=4)
    (tmp_path / "job.toml").write_text(JOB.format(root=tmp_path, restarts=MAX_RESTARTS))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray
    proc = subprocess.Popen(
        [sys.executable, "-m", "raytuner", "preprocess", "job.toml"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_encoders, args=(proc, killed, stop))
    killer.start()
    started = time.monotonic()
    try:
        _, err = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"the preprocess did not end ({len(killed)} encoders killed): {err[-3000:]}")
    finally:
        stop.set()
        killer.join()
    seconds = time.monotonic() - started
    print(f"{len(killed)} encoder processes killed; exit {proc.returncode} after {seconds:.0f} s")
    assert len(killed) == MAX_RESTARTS + 1, f"killed {killed}: {err[-3000:]}"
    assert proc.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("raytuner:")]
    assert len(lines) == 1 and lines[0].startswith("raytuner: preprocess failed: "), lines
    # the reason: the encoder actor died (Ray's ActorDiedError, not a wrapper of it)
    assert "ActorDiedError: The actor died" in lines[0], lines[0]
    assert not list((tmp_path / "cache").rglob(cache.MANIFEST))  # nothing committed
