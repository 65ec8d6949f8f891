"""The global schedule in real Ray Train runs (2 gloo workers on CPU): a skewed bucket
distribution cannot hang DDP, a SIGKILLed worker resumes exactly, and the world size changes
neither the samples trained at each step nor the weights.

Every run writes the sample log (`train.sample_log`): which cache rows each rank trained at
each step, per attempt (a restart is a new attempt). An uninterrupted 2-worker run is the
reference the other runs are compared with, step by step.
"""

from __future__ import annotations

import re
import shutil
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from conftest import SKEWED_JOB
from PIL import Image
from run_checks import committed, lora_changes_the_pipeline
from safetensors.torch import load_file

from raytuner.config import ConfigError, load_job
from raytuner.data import cache
from raytuner.data.preprocess import preprocess
from raytuner.data.reader import open_dataset
from raytuner.train import samples
from raytuner.train.trainer import train

STEPS = 12  # the skewed job of conftest.py: 5 global batches an epoch


_RUNS: dict[str, tuple[dict, str]] = {}


def run(job_file: Path, name: str, *overrides: str) -> tuple[dict, str]:
    """Train (or resume) run ``name``; returns the summary and the run directory."""
    job = load_job(job_file, [f'train.name="{name}"', *overrides])
    summary = train(job)
    return summary, f"{job.train.output}/{name}"


def reference(job_file: Path) -> tuple[dict, str]:
    """The uninterrupted 2-worker run, trained once per module."""
    if "reference" not in _RUNS:
        _RUNS["reference"] = run(job_file, "reference")
    return _RUNS["reference"]


def weights(summary: dict) -> dict[str, torch.Tensor]:
    return load_file(summary["lora"])


def assert_same_weights(a: dict, b: dict, tolerance: float) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        change = (wa[key] - wb[key]).norm() / wa[key].norm().clamp_min(1e-12)
        assert change <= tolerance, f"{key}: relative difference {change:.2e}"


def buckets_of(job_file: Path) -> dict[str, str]:
    job = load_job(job_file)
    data = open_dataset(job.data.cache, cache.fingerprint(job.model, job.preprocess))
    return dict(zip(data.paths, data.buckets, strict=True))


@pytest.mark.timeout(300)  # a rank waiting in a collective for the other would hang: fail instead
def test_skewed_buckets_give_every_rank_the_same_steps_and_shapes(job_file):
    summary, run_dir = reference(job_file)
    assert summary["step"] == STEPS
    bucket = buckets_of(job_file)
    assert sorted(Counter(bucket.values()).values()) == [1, 3, 9]

    (attempt,) = samples.read_attempts(run_dir)  # no restart
    assert sorted(attempt) == list(range(1, STEPS + 1))
    for step, ranks in attempt.items():
        assert sorted(ranks) == [0, 1], f"step {step}: ranks {sorted(ranks)}"
        assert [len(ranks[r]["ids"]) for r in (0, 1)] == [2, 2]
        shapes = {bucket[i] for r in (0, 1) for i in ranks[r]["ids"]}
        assert len(shapes) == 1, f"step {step} mixes buckets {shapes}"

    # 9, 3 and 1 rows padded to whole batches of 4: 3 + 1 + 1 = 5 global batches per epoch
    trained = samples.trained(run_dir)
    epochs = [[i for s in range(e * 5 + 1, e * 5 + 6) for i in trained[s]] for e in (0, 1)]
    for ids in epochs:
        assert set(ids) == set(bucket), "a row was never trained in an epoch"
        padding = Counter(ids) - Counter(bucket.keys())
        assert sum(padding.values()) == 20 - 13
    assert epochs[0] != epochs[1], "the second epoch should be reshuffled"


def _workers_of_this_test() -> list[psutil.Process]:
    """The Ray Train worker processes of the local Ray this test process started."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _kill_a_worker_after(run_dir: str, step: int, killed: list) -> None:
    """SIGKILL a worker once the first attempt logged ``step`` and Ray registered a checkpoint;
    then time until the restarted group has trained its first step."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        attempts = samples.read_attempts(run_dir)
        # a checkpoint Ray has registered: a kill before it would restart from step 0
        ready = attempts and max(attempts[0], default=0) >= step and committed(run_dir)
        if not killed and ready:
            victim = _workers_of_this_test()[-1]
            victim.send_signal(signal.SIGKILL)
            killed.append((victim.pid, max(attempts[0]), time.monotonic()))
        if killed and len(attempts) > 1:
            killed.append(time.monotonic() - killed[0][2])
            return
        time.sleep(0.02)


@pytest.mark.timeout(600)
def test_sigkilled_worker_resumes_exactly_where_the_checkpoint_left_off(job_file):
    expected, reference_dir = reference(job_file)
    run_dir = str(load_job(job_file).train.output) + "/killed"
    killed: list = []
    killer = threading.Thread(target=_kill_a_worker_after, args=(run_dir, 6, killed))
    killer.start()
    summary, _ = run(job_file, "killed")
    killer.join()
    assert killed, "the run finished before a worker could be killed"
    (pid, at_step, _), *recovery = killed
    assert recovery, "no step was trained after the kill"
    print(f"killed worker pid {pid} after step {at_step}; training again {recovery[0]:.1f} s later")

    first, second = samples.read_attempts(run_dir)[:2]
    resumed_from = min(second) - 1
    assert resumed_from % 4 == 0 and 0 < resumed_from <= at_step, "resume not at a checkpoint"
    assert summary["step"] == STEPS
    assert samples.trained(run_dir) == samples.trained(reference_dir)
    # the redone steps trained the same rows as before the kill
    for step in set(first) & set(second):
        assert first[step] == second[step] or len(first[step]) < 2
    assert_same_weights(summary, expected, tolerance=1e-6)
    assert lora_changes_the_pipeline(str(Path(summary["lora"]).parent))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_workers_train_the_same_rows_and_weights_as_two(job_file):
    """Slices of 2, 1 and 1 samples, and rank 0 accumulates its 2 in micro-batches of 1 (the
    elastic test covers 1 worker against the schedule)."""
    expected, reference_dir = reference(job_file)
    three, three_dir = run(job_file, "three", "scaling.workers=3", "train.micro_batch_size=1")
    assert samples.trained(three_dir) == samples.trained(reference_dir)
    assert_same_weights(three, expected, tolerance=1e-4)
    slices = samples.read_attempts(three_dir)[0][1]
    assert [len(slices[r]["ids"]) for r in (0, 1, 2)] == [2, 1, 1]


@pytest.mark.slow  # a preprocess beside a 2-worker run on 2 cores: ~2 min
@pytest.mark.timeout(600)
def test_a_running_job_keeps_its_dataset_and_a_changed_one_refuses_the_resume(job_file, tmp_path):
    """While the run trains, a preprocess commits an added image; a worker is then SIGKILLed.
    The restarted group still reads the dataset the job started with (the reference run's rows,
    step by step). Submitting the run again is refused before any worker starts, naming the
    added image."""
    for folder in ("images", "cache"):
        shutil.copytree(job_file.parent / folder, tmp_path / folder)
    job_path = tmp_path / "job.toml"
    job_path.write_text(SKEWED_JOB.format(root=tmp_path))
    _, reference_dir = reference(job_file)
    run_dir = str(tmp_path / "runs" / "changing")
    done: list = []
    # a quarter CPU each leaves 1.5 of the 2 for the preprocess's tasks and encoder actors
    quarter = "scaling.cpus_per_worker=0.25"
    trainer = threading.Thread(target=lambda: done.append(run(job_path, "changing", quarter)[0]))
    trainer.start()
    deadline = time.monotonic() + 240
    while committed(run_dir) < 4 and trainer.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = _workers_of_this_test()
    assert committed(run_dir) >= 4 and len(workers) == 2, "the run did not reach step 4"
    for worker in workers:  # held still while the commit happens
        worker.suspend()
    image = Image.fromarray(np.full((64, 64, 3), 7, np.uint8))
    image.save(tmp_path / "images" / "added.png")
    job = load_job(job_path)
    started = time.monotonic()
    assert preprocess(job.model, job.data, job.preprocess)["encoded"] == 1
    print(f"committed the added image in {time.monotonic() - started:.1f} s")
    workers[-1].kill()
    workers[0].resume()
    trainer.join(timeout=300)

    (summary,) = done
    assert summary["step"] == STEPS and len(samples.read_attempts(run_dir)) == 2
    assert samples.trained(run_dir) == samples.trained(reference_dir)
    with pytest.raises(ConfigError, match=r"1 added \(added\.png\).*checkpoint\.resume=false"):
        run(job_path, "changing", f"train.max_steps={STEPS + 4}")


def test_resuming_with_another_adapter_shape_or_schedule_is_refused(job_file):
    _, run_dir = reference(job_file)
    before = sorted(p.name for p in Path(run_dir).iterdir())
    for change, key in (("lora.rank=8", "lora.rank"), ("train.seed=1", "schedule.seed")):
        with pytest.raises(ConfigError, match=rf"{re.escape(key)}.*checkpoint.resume=false"):
            run(job_file, "reference", change)
    assert sorted(p.name for p in Path(run_dir).iterdir()) == before  # nothing was touched


def test_a_finished_run_submitted_again_trains_nothing_and_exports_again(job_file):
    expected, run_dir = reference(job_file)
    export = Path(expected["lora"])
    export.unlink()  # as if the driver had died between the last checkpoint and the export
    attempts = len(samples.read_attempts(run_dir))
    again, _ = run(job_file, "reference")
    assert again["step"] == STEPS and export.is_file()
    assert_same_weights(again, expected, tolerance=0.0)
    assert len(samples.read_attempts(run_dir)) == attempts  # no step was trained again
