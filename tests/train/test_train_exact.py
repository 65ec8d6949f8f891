"""The global schedule in real Ray Train runs (2 gloo workers on CPU): a skewed bucket
distribution cannot hang DDP, a SIGKILLed worker resumes exactly (on the dataset the job started
with, though a preprocess committed another one meanwhile), and the world size changes neither
the samples trained at each step nor the weights.

Every run writes the sample log (`train.sample_log`): which cache rows each rank trained at
each step, per attempt (a restart is a new attempt). An uninterrupted 2-worker run is the
reference the other runs are compared with, step by step.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest
import ray
import torch
from conftest import SKEWED_JOB
from run_checks import committed, lora_changes_the_pipeline
from safetensors.torch import load_file

from raytuner.api import preprocess, train
from raytuner.checkpoint import layout
from raytuner.config import ConfigError, load_job
from raytuner.data import cache
from raytuner.data.reader import open_dataset
from raytuner.train import sample_log

STEPS = 12  # the skewed job of conftest.py: 5 global batches an epoch


_RUNS: dict[str, tuple[dict, str]] = {}
_ACTORS: dict[str, set[str]] = {}  # run -> the classes of the actors Ray started for it


def run(job_file: Path, name: str, *overrides: str) -> tuple[dict, str]:
    """Train (or resume) run ``name``; returns the summary and the run directory."""
    job = load_job(job_file, [f'train.name="{name}"', *overrides])
    summary = train(job)
    return summary, f"{job.train.output}/{name}"


def reference(job_file: Path) -> tuple[dict, str]:
    """The uninterrupted 2-worker run, trained once per module."""
    if "reference" not in _RUNS:
        before = set(ray._private.state.actors())  # the GCS's table, dead actors included
        _RUNS["reference"] = run(job_file, "reference")
        after = ray._private.state.actors()
        _ACTORS["reference"] = {after[a]["ActorClassName"] for a in after.keys() - before}
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


@pytest.mark.slow
@pytest.mark.timeout(300)  # a rank waiting in a collective for the other would hang: fail instead
def test_skewed_buckets_give_every_rank_the_same_steps_and_shapes(job_file):
    summary, run_dir = reference(job_file)
    assert summary["step"] == STEPS
    bucket = buckets_of(job_file)
    assert sorted(Counter(bucket.values()).values()) == [1, 3, 9]

    (attempt,) = sample_log.read_attempts(run_dir)  # no restart
    assert sorted(attempt) == list(range(1, STEPS + 1))
    for step, ranks in attempt.items():
        assert sorted(ranks) == [0, 1], f"step {step}: ranks {sorted(ranks)}"
        assert [len(ranks[r]["ids"]) for r in (0, 1)] == [2, 2]
        shapes = {bucket[i] for r in (0, 1) for i in ranks[r]["ids"]}
        assert len(shapes) == 1, f"step {step} mixes buckets {shapes}"

    # 9, 3 and 1 rows padded to whole batches of 4: 3 + 1 + 1 = 5 global batches per epoch
    trained = sample_log.trained(run_dir)
    epochs = [[i for s in range(e * 5 + 1, e * 5 + 6) for i in trained[s]] for e in (0, 1)]
    for ids in epochs:
        assert set(ids) == set(bucket), "a row was never trained in an epoch"
        padding = Counter(ids) - Counter(bucket.keys())
        assert sum(padding.values()) == 20 - 13
    assert epochs[0] != epochs[1], "the second epoch should be reshuffled"

    # Ray Train's actors for the run, but none for Ray Datasets (the workers read the cache
    # themselves), and on this local Ray no preemption watcher (nothing drains its one node)
    # and no placement-group cleaner (it has no state API to ask whether the controller lives)
    assert {"TrainController", "RayTrainWorker"} <= _ACTORS["reference"], _ACTORS
    idle = {"DatasetManager", "PreemptionWatcher", "PlacementGroupCleaner"}
    assert not idle & _ACTORS["reference"], _ACTORS


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


def _commit_then_kill(run_dir: str, step: int, job: Path, killed: list, errors: list) -> None:
    """Once the first attempt logged ``step`` and Ray registered a checkpoint: hold the workers
    still, commit the job's dataset without ``square8.png`` (a real preprocess), SIGKILL one
    worker; then time until the restarted group has trained its first step."""
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            attempts = sample_log.read_attempts(run_dir)
            # a checkpoint Ray has registered: a kill before it would restart from step 0
            ready = attempts and max(attempts[0], default=0) >= step and committed(run_dir)
            if not killed and ready:
                workers = _workers_of_this_test()
                for worker in workers:
                    worker.suspend()
                at_step = max(sample_log.read_attempts(run_dir)[0])
                (job.parent / "images" / "square8.png").unlink()
                config = load_job(job)
                preprocess(config)
                workers[-1].kill()
                for worker in workers[:-1]:
                    worker.resume()
                killed.append((workers[-1].pid, at_step, time.monotonic()))
            if killed and len(attempts) > 1:
                killed.append(time.monotonic() - killed[0][2])
                return
            time.sleep(0.02)
    except BaseException as e:  # raised again by the test
        errors.append(e)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkilled_worker_resumes_exactly_on_the_dataset_the_job_started_with(job_file, tmp_path):
    """A worker is SIGKILLed mid-epoch just after a preprocess committed the dataset without
    one of its images. The restarted group resumes at the checkpoint, reads the dataset the job
    started with and ends with the uninterrupted run's rows (step by step) and weights.
    Submitting the run again is refused before any worker starts, naming the removed image."""
    for folder in ("images", "cache"):
        shutil.copytree(job_file.parent / folder, tmp_path / folder)
    job = tmp_path / "job.toml"
    job.write_text(SKEWED_JOB.format(root=tmp_path))
    # the copied cache holds the original folder's dataset: the copy's is committed (a moved
    # folder is another source; nothing is encoded again, the dataset id is the same)
    preprocess(load_job(job))
    expected, reference_dir = reference(job_file)
    run_dir = str(tmp_path / "runs" / "killed")
    killed: list = []
    errors: list = []
    killer = threading.Thread(target=_commit_then_kill, args=(run_dir, 6, job, killed, errors))
    killer.start()
    summary, _ = run(job, "killed")
    killer.join()
    if errors:
        raise errors[0]
    assert killed, "the run finished before a worker could be killed"
    (pid, at_step, _), *recovery = killed
    assert recovery, "no step was trained after the kill"
    print(f"killed worker pid {pid} after step {at_step}; training again {recovery[0]:.1f} s later")

    first, second = sample_log.read_attempts(run_dir)[:2]
    resumed_from = min(second) - 1
    assert resumed_from % 4 == 0 and 0 < resumed_from <= at_step, "resume not at a checkpoint"
    assert summary["step"] == STEPS
    assert sample_log.trained(run_dir) == sample_log.trained(reference_dir)
    # the redone steps trained the same rows as before the kill
    for step in set(first) & set(second):
        assert first[step] == second[step] or len(first[step]) < 2
    assert_same_weights(summary, expected, tolerance=1e-6)
    assert lora_changes_the_pipeline(str(Path(summary["lora"]).parent))
    removed = r"1 removed \(square8\.png\).*checkpoint\.resume=false"
    with pytest.raises(ConfigError, match=removed):
        run(job, "killed", f"train.max_steps={STEPS + 4}")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_workers_train_the_same_rows_and_weights_as_two(job_file):
    """Slices of 2, 1 and 1 samples, and rank 0 accumulates its 2 in micro-batches of 1 (the
    elastic test covers 1 worker against the schedule)."""
    expected, reference_dir = reference(job_file)
    three, three_dir = run(job_file, "three", "scaling.workers=3", "train.micro_batch_size=1")
    assert sample_log.trained(three_dir) == sample_log.trained(reference_dir)
    # float rounding only (another all-reduce and accumulation order), which AdamW's normalised
    # steps at lr 1e-2 carry through 12 steps: measured up to 1.1e-4 (2026-11-25), 3.1e-4 with
    # gradients in DDP's buckets (2026-11-26, one lora_B of ~100 tensors); a wrong row, seed or
    # scale differs by more than 1e-2
    assert_same_weights(three, expected, tolerance=1e-3)
    slices = sample_log.read_attempts(three_dir)[0][1]
    assert [len(slices[r]["ids"]) for r in (0, 1, 2)] == [2, 1, 1]


@pytest.mark.slow
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
    exported = load_file(export)  # the first export, read before it goes
    export.unlink()  # as if the driver had died between the last checkpoint and the export
    attempts = len(sample_log.read_attempts(run_dir))
    again, _ = run(job_file, "reference")
    assert again["step"] == STEPS and export.is_file()
    again_exported = weights(again)
    assert again_exported.keys() == exported.keys()
    for key, value in exported.items():
        assert torch.equal(again_exported[key], value), key
    assert len(sample_log.read_attempts(run_dir)) == attempts  # no step was trained again


def _flops_per_sample(job, size: tuple[int, int]) -> float:
    """The FLOPs of one sample of bucket ``size`` (width, height), forward and backward, counted
    on the worker's own model and step (the tiny SDXL and its LoRA) on cached tensors' shapes."""
    from raytuner.families import FAMILIES
    from raytuner.families.parts import Source
    from raytuner.observe import flops
    from raytuner.train.feed import RankSlice
    from raytuner.train.model import trainable_model
    from raytuner.train.step import forward_backward

    family, cpu = FAMILIES[job.model.family], torch.device("cpu")
    trained = trainable_model(job.model, job.train, job.lora, family, cpu)
    loss_fn = family.loss(trained.source, job.objective.for_family(family))
    tiny = Source("tiny")
    latent = family.image_encoder(tiny, "cpu")(torch.zeros(1, 3, size[1], size[0]))[0]
    text = family.text_encoder(tiny, "cpu")(["a caption"])
    shapes = {"latent": tuple(latent.shape[1:])} | {k: v.shape[1:] for k, v in text.items()}
    batch = family.example_batch(shapes, 2, size, cpu, torch.float32)
    with flops.counted() as counter:
        forward_backward(trained.denoiser, loss_fn, RankSlice(0, 0, 1, batch, [0, 1], []), cpu,
                         0, 1.0)  # fmt: skip
    return counter.get_total_flops() / 2


def test_the_tflops_a_run_reports_are_each_workers_counted_flops_over_its_time(job_file):
    """``train/tflops_per_s`` (TensorBoard, the dashboard's gauge, the log line) is a worker's
    share of the step's counted FLOPs over the window's time: against ``train/samples_per_s``
    of the same window (the same seconds), every step's FLOPs a sample of its bucket over the
    2 workers. Rank 0's own FLOPs alone, or the group's not divided by the workers, is off by
    2x."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = reference(job_file)
    job = load_job(job_file)
    events = EventAccumulator(str(Path(run_dir, layout.TENSORBOARD)))
    events.Reload()
    tflops = {e.step: e.value for e in events.Scalars("train/tflops_per_s")}
    samples = {e.step: e.value for e in events.Scalars("train/samples_per_s")}
    assert sorted(tflops) == sorted(samples) == list(range(1, STEPS + 1))
    bucket, counted = buckets_of(job_file), {}
    for step, ids in sample_log.trained(run_dir).items():
        w, h = map(int, bucket[ids[0]].split("x"))
        if (w, h) not in counted:
            counted[w, h] = _flops_per_sample(job, (w, h))
        per_sample = tflops[step] * 1e12 / samples[step]  # the window's seconds cancel
        assert per_sample == pytest.approx(counted[w, h] / 2, rel=1e-4), (step, (w, h))
    assert len(counted) == 3  # every bucket of the skewed job
