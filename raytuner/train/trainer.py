"""Driver side of training: Ray Train's TorchTrainer, and the final export from its checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
import threading

import ray.train
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)

from raytuner import runtime, storage
from raytuner.checkpoint import checksums, export, layout
from raytuner.checkpoint.layout import (
    DATASET,
)
from raytuner.checkpoint.resume import check_resumable, finished_checkpoint, resume_hint
from raytuner.config import ConfigError, JobConfig
from raytuner.data import datasets
from raytuner.data.cache import Version, fingerprint, read_manifest, version_dir
from raytuner.data.reader import for_readers
from raytuner.errors import Interrupted, TrainingStopped, WorkerDied, dead_worker
from raytuner.lora import merge
from raytuner.render import validation
from raytuner.train import entry, starting, stopping
from raytuner.train.loop import LoopConfig
from raytuner.train.schedule import epoch_batches

log = logging.getLogger(__name__)


def dataset_record(cache: str, fp: str, readers: dict) -> dict:
    """What a checkpoint records of the committed dataset it trains on (``readers``: what its
    workers read, ``reader.for_readers``): its id (what a resume is checked against), its rows,
    its index file and a content hash of what the workers read."""
    canonical = json.dumps(readers, sort_keys=True).encode()
    return readers["dataset"] | {
        "cache": storage.absolute(cache),
        "fingerprint": fp,
        "index": readers["index"]["path"],
        "manifest_sha256": hashlib.sha256(canonical).hexdigest(),
    }


def job_dataset(job: JobConfig, fp: str) -> tuple[dict, dict]:
    """The committed manifest of the job's cache version and the job's own dataset in it (the
    rows its sources make, never another job's); FileNotFoundError naming what is missing."""
    manifest = read_manifest(job.data.cache, fp)
    if manifest is None:
        raise FileNotFoundError(
            f"no committed cache at {version_dir(job.data.cache, fp)}: "
            "run `raytuner preprocess` (or `raytuner run`) first"
        )
    mine = datasets.entry(manifest, job.data.all_sources(), version_dir(job.data.cache, fp))
    log.info(
        "dataset %s: %d images, %d samples an epoch, from %s",
        mine["dataset"]["id"],
        mine["dataset"]["rows"],
        sum(mine["appearances"].values()),
        datasets.describe(mine["sources"]),
    )
    return manifest, mine


def _dataset_change(fs, folder: str, current: dict) -> str:
    """What differs between the dataset a checkpoint trained on and ``current`` (a record)."""
    try:
        saved = storage.read_json(fs, storage.join(folder, DATASET))
        before = Version(saved["cache"], saved["fingerprint"]).read(saved["index"]).to_pylist()
    except (OSError, KeyError, ValueError) as e:
        return f"its index is no longer readable ({type(e).__name__}); {current['rows']} rows now"
    now = Version(current["cache"], current["fingerprint"]).read(current["index"]).to_pylist()
    return datasets.describe_change(before, now)




def _wait_for_workers(job: JobConfig) -> None:
    """The smallest worker group (and the validation actor) must fit the cluster within
    ``scaling.resource_wait_s`` (an autoscaler starts nodes for it meanwhile): Ray Train would
    otherwise retry its start every minute."""
    s, v = job.scaling, job.validation
    fewest = s.workers[0] if isinstance(s.workers, list) else s.workers
    gpus = (s.gpus_per_worker or 1.0) if s.use_gpu else 0.0
    bundles = [{"CPU": s.cpus_per_worker, "GPU": gpus}] * fewest
    if v.every_steps:
        bundles.append({"CPU": v.cpus, "GPU": v.gpus})
    what = f"{fewest} training workers" + (" and the validation actor" if v.every_steps else "")
    runtime.wait_for_resources(bundles, s.resource_wait_s, what)


def failure_config(c) -> ray.train.FailureConfig:
    """Every retry Ray Train makes is bounded (its own defaults for preemptions and controller
    failures are unbounded); ``c``: the job's ``[checkpoint]`` section."""
    return ray.train.FailureConfig(
        max_failures=c.max_failures,
        max_preemption_failures=c.max_preemption_failures,
        controller_failure_limit=c.controller_failure_limit,
    )


def _scaling(job: JobConfig) -> ray.train.ScalingConfig:
    s = job.scaling
    resources = {"CPU": s.cpus_per_worker} | ({"GPU": s.gpus_per_worker} if s.use_gpu else {})
    return ray.train.ScalingConfig(
        num_workers=tuple(s.workers) if isinstance(s.workers, list) else s.workers,
        use_gpu=s.use_gpu,
        resources_per_worker=resources,
        elastic_resize_monitor_interval_s=s.elastic_resize_interval_s,
    )



def train(job: JobConfig, family) -> dict:
    """Train on the committed cache of this job's model and preprocess settings (a job
    ``api.check`` passed; ``family``: its Family)."""
    fp = fingerprint(job.model, job.preprocess)
    manifest, mine = job_dataset(job, fp)
    # the manifest read now: a commit while the job runs does not change what it reads
    readers = for_readers(manifest, mine)
    # fail here, not in every worker, when no bucket can fill a global batch
    counts = mine["appearances"]
    rows = [bucket for bucket, n in counts.items() for _ in range(n)]
    t = job.train
    try:
        batches = epoch_batches(rows, t.seed, 0, t.global_batch_size, t.remainder)
    except ValueError as e:
        raise ConfigError(f"{e} (samples per bucket, repeats included: {counts})") from None
    if t.epochs:  # every epoch has as many global batches as the first
        job = dataclasses.replace(job, train=t.for_epochs(len(batches)))
        t = job.train
        log.info("train.epochs: %d steps, %d an epoch", t.max_steps, len(batches))
        if warning := t.warmup_warning():  # the check could not tell: no steps yet
            log.warning(warning)
    name = layout.choose_run(job.train.output, job.train.name, job.checkpoint.resume)
    part = family.parts.denoiser
    run_dir = layout.run_dir(job.train.output, name)
    dataset = dataset_record(job.data.cache, fp, readers)
    merged = tuple(merge.identity(job.model.merge_adapters))  # each file's sha256, once
    check_resumable(job, run_dir, fp, dataset, _dataset_change, merged)
    # checkpoints of reports Ray never registered (an interrupted driver's) beyond the newest
    # checkpoint.keep, and half-written folders: the workers resume from the newest complete one
    layout.prune_checkpoints(run_dir, job.checkpoint.keep)
    if (done := finished_checkpoint(run_dir, t.max_steps)) is not None:
        log.info("run %s trained its %d steps before: exporting again", name, t.max_steps)
        try:
            return export.final(done, job.train.output, name, part) | {"metrics": {}}
        except checksums.DamagedFileError as e:  # the workers skip it too
            log.warning(
                "not exporting run %s's final checkpoint, which is damaged: %s. Training from "
                "the previous complete checkpoint instead (the previous export is left as it was)",
                *(name, e),
            )
    loop = LoopConfig(
        family=family,
        model=job.model,
        train=job.train,
        lora=job.lora,
        objective=job.objective,
        checkpoint=job.checkpoint,
        cache=storage.absolute(job.data.cache),
        fingerprint=fp,
        manifest=readers,
        dataset=dataset,
        run_dir=run_dir,
        job=job.to_dict(),
        memory=job.memory,
        strategy=job.scaling.strategy,
        peak_tflops=job.scaling.peak_tflops,
        validation_every=job.validation.every_steps,
        tracking=job.tracking,
        merged=merged,
    )
    _wait_for_workers(job)
    with Version(job.data.cache, fp).lease(f"train-{name}"):  # gc leaves the version alone
        result = _fit(job, family, name, loop)
    if result.checkpoint is None:
        raise RuntimeError(f"training run {name} ended without a checkpoint")
    summary = export.final(result.checkpoint, job.train.output, name, part)
    return summary | {"metrics": result.metrics}


class _Trainer(TorchTrainer):
    """Ray Train's trainer with raytuner's Ctrl-C: the first SIGINT aborts the run (Ray Train's
    controller stops the workers and withdraws its autoscaler request) and ``fit`` ends; a second
    exits at once. Ray's own handler, which this replaces, needs three and exits the driver
    without a word. (`ray job stop` sends SIGTERM: the CLI calls this handler for it.)"""

    interrupted = False
    run_dir = ""  # where the run stands once interrupted (``resume_hint``)
    deadline = None  # under `ray job stop`: the driver's own exit before Ray's SIGKILL

    def _register_sigint_handler(self, controller) -> None:
        def interrupt(signum, frame) -> None:
            if self.interrupted:
                print("raytuner: interrupted again: exiting at once", file=sys.stderr, flush=True)
                runtime.kill_started_processes()  # a local Ray's agents would outlive the exit
                os._exit(130)
            self.interrupted = True
            log.warning("interrupted: stopping the run (Ctrl-C again to exit at once)")
            controller.abort.remote()
            self.deadline = stopping.exit_before_sigkill(lambda: resume_hint(self.run_dir))

        signal.signal(signal.SIGINT, interrupt)

    def _create_default_callbacks(self) -> list:
        """Ray Train's callbacks, less two that would start an actor a run (a process, ~1-3 s
        of CPU) for nothing: the one for Ray Datasets when the run passes none (the workers
        read the cache themselves), and the placement-group cleaner where the Ray has no
        state API (a local Ray without its dashboard): the cleaner asks that API every second
        whether the run's controller lives, and without it can only wait, never clean."""
        idle = [] if self.datasets else [DatasetsCallback]
        if not runtime.has_state_api():
            idle.append(PlacementGroupCleanerCallback)
        callbacks = super()._create_default_callbacks()
        return [c for c in callbacks if not isinstance(c, tuple(idle))]


@contextlib.contextmanager
def _ray_train_switches():
    """Ray Train's switches for a run, in this process's environment while it runs (Ray Train
    passes them to its controller and workers) and as they were after; a user's own win:
    - its state tracking (the dashboard's Train page: workers, attempts, checkpoints) where the
      connected Ray has a state API to serve it;
    - no preemption watcher on a local Ray, one node that nothing drains: the actor, a process
      of its own (~1 s of CPU to start), polls Ray for node drains and would find none. On a
      cluster it stays: a checkpoint is taken when a node's drain is announced."""
    switches = {
        "RAY_TRAIN_ENABLE_STATE_TRACKING": "1" if runtime.has_state_api() else None,
        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0" if runtime.is_local() else None,
    }
    before = {key: os.environ.get(key) for key in switches}
    for key, value in switches.items():
        if value is not None:
            os.environ.setdefault(key, value)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _fit(job: JobConfig, family, name: str, loop: LoopConfig) -> ray.train.Result:
    """Ray Train's run of the loop, with the validation actor beside it. Interrupted (Ctrl-C),
    it raises ``Interrupted`` saying where the run can resume."""
    validator, callbacks = validation.start(job, family, loop.run_dir)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    trainer = _Trainer(
        entry.train_loop,  # the controller imports neither the loop nor the model code
        train_loop_config=entry.config(loop),
        scaling_config=_scaling(job),
        run_config=ray.train.RunConfig(
            name=name,
            storage_path=storage.absolute(job.train.output),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=job.checkpoint.keep),
            failure_config=failure_config(job.checkpoint),
            # Ray Train's own INFO lines (one per report and rank) drown the progress lines
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            callbacks=callbacks,
        ),
    )
    trainer.run_dir = loop.run_dir
    stopping.warn_if_short()
    workers = job.scaling.workers
    workers = "-".join(map(str, workers)) if isinstance(workers, list) else str(workers)
    log.info("run %s: starting %s training worker(s) (%s)", name, workers, job.scaling.strategy)
    completed, stopped = False, None
    try:
        with _ray_train_switches(), starting.waiting_for_workers(name, workers):
            result = trainer.fit()
        stopped = (result.return_value or {}).get("stopped")  # rank 0's train_loop's
        completed = not trainer.interrupted and stopped is None
    except BaseException as e:  # the aborted controller's death, or a Ctrl-C before it started
        if trainer.interrupted or isinstance(e, KeyboardInterrupt):
            raise Interrupted(resume_hint(loop.run_dir)) from None
        if (died := dead_worker(e)) is not None:  # not the others' lost connections
            raise WorkerDied(f"{died}. {_capital(resume_hint(loop.run_dir))}") from None
        raise
    finally:
        if main:  # Ray leaves its handler in place after fit
            signal.signal(signal.SIGINT, previous)
        validation.finish(validator, completed)
        if trainer.deadline is not None:  # stopped in time: the CLI says where it stands
            trainer.deadline.cancel()
    if trainer.interrupted:  # aborted after the last step: the export may be missing
        raise Interrupted(resume_hint(loop.run_dir))
    if stopped is not None:  # what it trained is no longer finite: nothing after is kept
        raise TrainingStopped(
            f"{stopped}: the run stopped there, without a checkpoint or an export after it; "
            f"lower train.learning_rate (or look at that step's rows: train.sample_log). "
            f"{_capital(resume_hint(loop.run_dir))}"
        )
    return result


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]
