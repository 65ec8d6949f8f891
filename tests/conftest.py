"""Shared fixtures: a local Ray for in-process tests, tiny image folders, the repo root; and
the suite's Ctrl-C: one stops the whole run, and every process the suite started is stopped on
the way out."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
# Every process this run starts (a `raytuner` subprocess, a Ray cluster's GCS, raylet, agents
# and workers, started in process or by `ray start`) inherits this mark; on the way out, those
# still running are stopped by PID. Other suites on the machine carry marks of their own. A run
# on several processes (pytest-xdist's `-n 2`, the README's test command) has one mark: each
# worker takes its controller's (``pytest_configure_node``), and the controller, the last to
# end, stops what all of them left.
SUITE_MARK = "RAYTUNER_TEST_SUITE"
_WORKER_MARK = "raytuner_suite_mark"  # the controller's mark, in each xdist worker's input
os.environ[SUITE_MARK] = f"{os.getpid()}-{time.time_ns()}"
# Local Rays (in process and in `raytuner` subprocesses) start without their dashboard: ~3 s
# and a busy process less each on the 2-core machine. The job-submission test's cluster has one.
os.environ.setdefault("RAYTUNER_LOCAL_DASHBOARD", "0")
# Ray Train's controller polls its workers every 2 s: it takes a report, and sees a run end, at
# the next poll. Every 0.5 s makes each tiny run seconds shorter (measured: 93 -> 73 s for two
# training tests); the behaviour tested is the same. Subprocesses and test clusters inherit it.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# Ray's log monitor reads every log file it holds open ten times a second, and closes (and moves
# out of its folder) those of ended processes only once it holds 200: in a session's Ray, which
# outlives hundreds of actors, that was 1.5 s of CPU a minute after 60 ended actors, 0.5 s with
# at most 16 open (measured: a local Ray, 60 actors started and ended, then a minute idle).
# What reaches the driver is the same; each test Ray (and subprocess) inherits it.
os.environ.setdefault("RAY_LOG_MONITOR_MAX_OPEN_FILES", "16")


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
    from raytuner.tools.demo_images import make_demo_images

    return make_demo_images(tmp_path / "images", per_aspect=4)


# The skewed job of the training tests: 9 + 3 + 1 rows. With 4 samples per global batch and
# per-rank bucketing, two ranks would end the epoch after different numbers of steps; the global
# schedule pads the small buckets (5 global batches an epoch).
SKEWED_SHAPES = {"square": ((64, 64), 9), "wide": ((96, 64), 3), "tall": ((64, 112), 1)}

SKEWED_JOB = """
[model]
family = "sdxl"
pretrained = "tiny"

[data]
images = "{root}/images"
cache = "{root}/cache"

[preprocess]
resolution = 64
bucket_step = 16
batch_size = 16

[train]
output = "{root}/runs"
max_steps = 12
global_batch_size = 4
remainder = "pad"
learning_rate = 1e-2
log_every = 1
sample_log = true

[lora]
save_dtype = "float32"  # runs' exports are compared to float rounding (the default rounds)

[scaling]
workers = 2
cpus_per_worker = 0.5

[checkpoint]
every_steps = 4
keep = 2
max_failures = 2
"""


@pytest.fixture(scope="session")
def job_file(ray_local, tmp_path_factory) -> Path:
    """The skewed job, its images drawn and its cache committed once per session."""
    import numpy as np
    from PIL import Image

    from raytuner.api import preprocess
    from raytuner.config import load_job

    root = tmp_path_factory.mktemp("skewed")
    rng = np.random.default_rng(0)
    (root / "images").mkdir()
    for kind, (size, count) in SKEWED_SHAPES.items():
        for i in range(count):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / "images" / f"{kind}{i}.png")
            (root / "images" / f"{kind}{i}.txt").write_text(f"a noisy {kind} picture {i}")
    path = root / "job.toml"
    path.write_text(SKEWED_JOB.format(root=root))
    job = load_job(path)
    report = preprocess(job)
    assert report["encoded"] == sum(n for _, n in SKEWED_SHAPES.values())
    return path


# One Ctrl-C stops the run. A test that calls `raytuner.cli.main` in process gets exit 130 from
# it, as a user of the command does (the CLI turns KeyboardInterrupt into one line and 130),
# and a training run's own handler (`train/trainer.py`) replaces Python's while it runs: either
# way the test failed and the next one would start. Every SIGINT the process gets, whichever
# Python handler takes it, is also written to a wakeup fd; once one is seen, the run stops
# after the test in progress.
_INTERRUPTED = threading.Event()
_WAKEUP: list[int] = []


def _watch_sigint(read_fd: int) -> None:
    while data := os.read(read_fd, 64):
        if signal.SIGINT in data:
            _INTERRUPTED.set()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """(pytest-xdist's controller, for each worker it starts) the run's one mark."""
    node.workerinput[_WORKER_MARK] = os.environ[SUITE_MARK]


def _is_xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config) -> None:
    if _is_xdist_worker(config):
        os.environ[SUITE_MARK] = config.workerinput[_WORKER_MARK]
    if threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    _WAKEUP.append(write_fd)
    threading.Thread(target=_watch_sigint, args=(read_fd,), daemon=True).start()
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)


def pytest_runtest_setup(item) -> None:
    if _WAKEUP:  # set again: a library may have set one of its own (asyncio does)
        signal.set_wakeup_fd(_WAKEUP[0], warn_on_full_buffer=False)


def pytest_runtest_logreport(report) -> None:
    if _INTERRUPTED.is_set():
        pytest.exit("interrupted (Ctrl-C): the run stops here", returncode=130)


def _suite_processes() -> list[psutil.Process]:
    """Live processes that carry this run's mark: its own process excepted, and the resource
    tracker that multiprocessing keeps beside it (`torch.multiprocessing.spawn`'s), which ends
    with it."""
    mark, found = os.environ[SUITE_MARK], []
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid() or p.environ().get(SUITE_MARK) != mark:
                continue
            if "multiprocessing.resource_tracker" not in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:  # gone, a zombie, or not ours to read
            continue
    return found


def pytest_unconfigure(config) -> None:
    """Stop (SIGTERM, then SIGKILL 10 s later) every process this run started that is still
    running: after a Ctrl-C, a `raytuner` subprocess in a session of its own and the local Ray
    it started; after any run, a Ray agent a cluster's shutdown left behind. Of a run on
    several processes, only its controller does, once its workers have ended: a worker that
    finished first would stop the others' processes."""
    if _is_xdist_worker(config):
        return
    left = _suite_processes()
    # a cluster just shut down is still exiting: 5 s for it to go by itself (the suite's own
    # Ctrl-C test, whose leftover never would, sets 0)
    grace_s = float(os.environ.get("RAYTUNER_TEST_EXIT_GRACE_S", "5"))
    _, left = psutil.wait_procs(left, timeout=grace_s)
    if not left:
        return
    names = []
    for p in left[:8]:
        with contextlib.suppress(psutil.Error):
            names.append(f"{p.pid} {p.name()}")
    print(f"\nconftest: stopping {len(left)} processes this run left running: {', '.join(names)}")
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(left, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
