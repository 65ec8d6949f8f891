"""Clips in real Ray Train runs (2 gloo workers on CPU, the tiny Wan): two frame buckets (5 and 9
frames: 2 and 3 latent frames) and images train in batches of one bucket each on every rank,
and a SIGKILLed worker resumes exactly (the uninterrupted run's rows, step by step, and its
weights)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from clip_files import clip
from PIL import Image
from run_checks import committed
from safetensors.torch import load_file
from test_train_exact import _workers_of_this_test

from raytuner.api import preprocess, train
from raytuner.config import load_job
from raytuner.data import cache
from raytuner.data.reader import open_dataset
from raytuner.train import sample_log

STEPS = 16  # room after the kill's step: a loaded machine trains on while the kill is set up
JOB = """
[model]
family = "wan"
pretrained = "tiny"

[data]
images = "{root}/media"
cache = "{root}/cache"
frames = [5, 9]

[preprocess]
resolution = 64
bucket_step = 16
min_size = 32

[train]
output = "{root}/runs"
max_steps = {steps}
global_batch_size = 2
remainder = "pad"
learning_rate = 1e-2
log_every = 1
sample_log = true

[lora]
save_dtype = "float32"

[scaling]
workers = 2
cpus_per_worker = 0.5

[checkpoint]
every_steps = 4
keep = 2
max_failures = 2
"""


@pytest.fixture(scope="module")
def clip_job(ray_local, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clip-train")
    media = root / "media"
    media.mkdir()
    for i in range(3):
        (media / f"long{i}.mp4").write_bytes(clip(12, 24, seed=10 + i))  # 9 frames
        (media / f"short{i}.mp4").write_bytes(clip(6, 24, seed=20 + i))  # 5 frames
        (media / f"long{i}.txt").write_text(f"a long clip {i}")
        (media / f"short{i}.txt").write_text(f"a short clip {i}")
    for i in range(2):
        Image.new("RGB", (80, 48), (60 * i, 90, 200)).save(media / f"img{i}.png")
        (media / f"img{i}.txt").write_text(f"an image {i}")
    path = root / "job.toml"
    path.write_text(JOB.format(root=root, steps=STEPS))
    report = preprocess(load_job(path))
    assert report["buckets"] == {"80x48": 2, "80x48/2": 3, "80x48/3": 3}
    return path


def _run(job_file: Path, name: str) -> tuple[dict, str]:
    job = load_job(job_file, [f'train.name="{name}"'])
    return train(job), f"{job.train.output}/{name}"


def _kill_after(run_dir: str, step: int, killed: list) -> None:
    """SIGKILL a worker once the first attempt logged ``step`` and a checkpoint is committed."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not killed:
        attempts = sample_log.read_attempts(run_dir)
        if attempts and max(attempts[0], default=0) >= step and committed(run_dir):
            workers = _workers_of_this_test()
            if workers:
                for worker in workers:  # held still: a loaded machine would train on to the end
                    worker.suspend()
                at = max(sample_log.read_attempts(run_dir)[0])
                workers[-1].kill()
                for worker in workers[:-1]:
                    worker.resume()
                killed.append(at)
                return
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_frame_buckets_train_on_every_rank_and_resume_exactly_after_a_kill(clip_job):
    expected, reference_dir = _run(clip_job, "reference")
    assert expected["step"] == STEPS
    job = load_job(clip_job)
    data = open_dataset(job.data.cache, cache.fingerprint(job.model, job.preprocess))
    bucket = dict(zip(data.ids, data.buckets, strict=True))  # the sample log's ids
    data.close()
    (attempt,) = sample_log.read_attempts(reference_dir)
    seen = set()
    for step, ranks in attempt.items():
        assert sorted(ranks) == [0, 1], f"step {step}: ranks {sorted(ranks)}"
        shapes = {bucket[i] for r in (0, 1) for i in ranks[r]["ids"]}
        assert len(shapes) == 1, f"step {step} mixes buckets {shapes}"
        seen |= shapes
    assert {"80x48/2", "80x48/3"} <= seen

    run_dir = str(Path(job.train.output) / "killed")
    killed: list = []
    killer = threading.Thread(target=_kill_after, args=(run_dir, 5, killed))
    killer.start()
    summary, _ = _run(clip_job, "killed")
    killer.join()
    assert killed, "the run finished before a worker could be killed"
    assert killed[0] < STEPS, f"the worker was killed after the last step ({killed[0]})"
    first, second = sample_log.read_attempts(run_dir)[:2]
    resumed = min(second) - 1  # at the newest checkpoint Ray had registered (every 4 steps)
    assert resumed % 4 == 0 and 4 <= resumed <= killed[0], (resumed, killed[0])
    assert summary["step"] == STEPS
    assert sample_log.trained(run_dir) == sample_log.trained(reference_dir)
    wa, wb = load_file(summary["lora"]), load_file(expected["lora"])
    assert wa.keys() == wb.keys()
    for key in wa:
        change = (wa[key] - wb[key]).norm() / wa[key].norm().clamp_min(1e-12)
        assert change <= 1e-5, f"{key}: relative difference {change:.2e}"
