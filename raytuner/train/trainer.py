"""Driver side of training: Ray Train's TorchTrainer, and the final export from its checkpoint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import signal
import sys
import threading

import pyarrow.fs as pafs
import ray.train
from ray.train.torch import TorchTrainer

from raytuner import checksums, runs, runtime, storage
from raytuner.config import ConfigError, JobConfig, LoraConfig
from raytuner.data import datasets
from raytuner.data.cache import Version, fingerprint, read_manifest, version_dir
from raytuner.data.reader import for_readers
from raytuner.errors import Interrupted, TrainingStopped, WorkerDied, dead_worker
from raytuner.lora import full_model
from raytuner.render import validation
from raytuner.runs import (
    DATASET,
    DIFFUSERS_FILE,
    EXPORT,
    EXPORT_META,
    KOHYA_FILE,
    LORA_DIR,
    MODEL_DIR,
    RUN,
    STATE,
    checkpoint_folders,
)
from raytuner.train import starting, stopping
from raytuner.train.checkpoints import identity_changes, run_identity
from raytuner.train.loop import LoopConfig, train_loop
from raytuner.train.schedule import epoch_batches

log = logging.getLogger(__name__)
# [lora] keys of a run's identity that checkpoints written before them lack (their defaults)
ADDED_LORA_KEYS = (
    "text_encoder",
    "text_encoder_rank",
    "text_encoder_alpha",
    "text_encoder_target_modules",
)


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


def check_resumable(job: JobConfig, run_dir: str, fp: str, dataset: dict) -> None:
    """Refuse to resume a run whose newest checkpoint was trained on another cache, dataset,
    model, adapter shape, schedule or strategy."""
    current = run_identity(job.model, job.lora, job.train, fp, dataset["id"], job.scaling.strategy)
    fs, folders = checkpoint_folders(run_dir)
    for folder in folders:
        try:
            saved = storage.read_json(fs, storage.join(folder, RUN))
        except (OSError, ValueError):
            continue  # unreadable: the workers skip it too
        saved.get("weights", {}).setdefault("strategy", "ddp")  # before scaling.strategy
        for key in ADDED_LORA_KEYS:  # a run from before lora.text_encoder trained none
            saved.get("lora", {}).setdefault(key, getattr(LoraConfig(), key))
        changes = identity_changes(saved, current)
        if changes == ["dataset.id"]:
            raise ConfigError(
                f"run {run_dir} was trained on another dataset than the cache now holds "
                f"({_dataset_change(fs, folder, dataset)}): its saved place in the schedule "
                "would pick other rows. Start a new run with --set checkpoint.resume=false or "
                "another train.name, or restore the images it trained on"
            )
        if "weights.strategy" in changes:
            before = saved["weights"]["strategy"]
            raise ConfigError(
                f"run {run_dir} was trained with scaling.strategy = {before!r}, and its "
                "checkpoints are laid out for it: a run cannot switch strategy. Keep "
                f"scaling.strategy = {before!r} to resume it, or start a new run with --set "
                "checkpoint.resume=false or another train.name (from its weights: "
                "lora.init_from = its lora/ file, or model.pretrained = its model/ folder)"
            )
        if changes:
            raise ConfigError(
                f"run {run_dir} was trained with other settings ({', '.join(changes)} changed; "
                f"a changed fingerprint means other model or preprocess settings): resuming it "
                "would mix them. Use --set checkpoint.resume=false or another train.name"
            )
        return


def finished_checkpoint(run_dir: str, max_steps: int) -> ray.train.Checkpoint | None:
    """The run's newest complete checkpoint when it has reached ``max_steps`` (with what its
    export reads): a finished run submitted again exports from it without starting any worker."""
    fs, folders = checkpoint_folders(run_dir)
    for folder in folders:
        try:
            step = storage.read_json(fs, storage.join(folder, STATE))["step"]
            runs.trained_files(fs, folder)
        except (OSError, ValueError, KeyError):
            continue  # incomplete or unreadable: the workers would skip it too
        if step >= max_steps:
            return ray.train.Checkpoint(folder, filesystem=fs)
        return None
    return None


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


def export_final(checkpoint: ray.train.Checkpoint, output: str, name: str, part: str) -> dict:
    """What the user takes away, from the checkpoint into ``<output>/<name>/``: a LoRA's
    ``lora/`` (the checkpoint's export, copied), or a full fine-tune's ``model/<part>/`` (a
    diffusers folder written a block at a time from its trained weights); return the summary:
    where the files went, and the checkpoint's state. Never reads the optimizer state. Every
    byte read is checked against the checkpoint's checksums (a damaged file raises
    ``checksums.DamagedFileError``), and the folder is written beside the old one and swapped
    in whole (``storage.folder_swap``): a failed or interrupted export leaves the previous."""
    uri = runs.run_dir(output, name)  # what the user reads: s3:// kept
    source = checkpoint.filesystem
    state = storage.read_json(source, storage.join(checkpoint.path, STATE))
    if runs.trained_files(source, checkpoint.path) != [EXPORT]:
        _export_model(checkpoint, storage.join(uri, MODEL_DIR, part))
        return {"model": storage.join(uri, MODEL_DIR)} | state
    fs, run = storage.resolve(uri)
    sums = checksums.Sums.read(source, checkpoint.path)
    # file by file from where the checkpoint is, streamed: never the optimizer state, never a
    # whole file in memory (the driver may be a small head)
    root = storage.join(checkpoint.path, EXPORT, LORA_DIR)
    selector = pafs.FileSelector(root, recursive=True)
    files = [i.path for i in source.get_file_info(selector) if i.type == pafs.FileType.File]
    with storage.folder_swap(fs, storage.join(run, LORA_DIR)) as out:
        for path in sorted(files):
            target = storage.join(out, path[len(root) + 1 :])
            if sums is None:  # a checkpoint written before checksums
                storage.copy_stream(source, path, fs, target)
            else:
                sums.copy(source, path, fs, target)
    lora = storage.join(uri, LORA_DIR)
    paths = {"lora": storage.join(lora, DIFFUSERS_FILE)}
    if any(p.endswith(f"/{LORA_DIR}/{KOHYA_FILE}") for p in files):  # not every family's
        paths["kohya"] = storage.join(lora, KOHYA_FILE)
    return paths | state


def _export_model(checkpoint: ray.train.Checkpoint, out: str) -> None:
    """A full fine-tune's diffusers folder at ``out`` from the checkpoint's trained weights
    (their EMA where kept), read where they are and written a block at a time
    (``lora/full_model.py``), with what the checkpoint says of its export (``raytuner.json``)."""
    fs, folder = checkpoint.filesystem, checkpoint.path
    trained = full_model.Trained(folder, fs)
    path, sums = storage.join(folder, EXPORT_META), checksums.Sums.read(fs, folder)
    if sums is not None:
        sums.check(fs, path)
    meta = storage.read_json(fs, path)
    meta["raytuner.checkpoint"] = storage.basename(folder)
    meta["raytuner.weights"] = storage.basename(trained.path)  # the EMA where there is one
    full_model.write_folder(trained, out, meta)


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
    name = runs.choose_run(job.train.output, job.train.name, job.checkpoint.resume)
    part = family.denoiser_part
    run_dir = runs.run_dir(job.train.output, name)
    dataset = dataset_record(job.data.cache, fp, readers)
    check_resumable(job, run_dir, fp, dataset)
    # checkpoints of reports Ray never registered (an interrupted driver's) beyond the newest
    # checkpoint.keep, and half-written folders: the workers resume from the newest complete one
    runs.prune_checkpoints(run_dir, job.checkpoint.keep)
    if (done := finished_checkpoint(run_dir, t.max_steps)) is not None:
        log.info("run %s trained its %d steps before: exporting again", name, t.max_steps)
        try:
            return export_final(done, job.train.output, name, part) | {"metrics": {}}
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
    )
    _wait_for_workers(job)
    with Version(job.data.cache, fp).lease(f"train-{name}"):  # gc leaves the version alone
        result = _fit(job, family, name, loop)
    if result.checkpoint is None:
        raise RuntimeError(f"training run {name} ended without a checkpoint")
    summary = export_final(result.checkpoint, job.train.output, name, part)
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


def resume_hint(run_dir: str) -> str:
    """Where an interrupted run stands: its newest complete checkpoint, and how to resume."""
    newest = runs.complete_checkpoints(run_dir)[1][:1]
    if not newest:
        return f"run {run_dir} has no complete checkpoint yet: the same command starts it again"
    fs, folder = storage.resolve(newest[0])
    step = storage.read_json(fs, storage.join(folder, STATE))["step"]
    return (
        f"the newest complete checkpoint is step {step} ({newest[0]}): the same command "
        "resumes from it"
    )


def _fit(job: JobConfig, family, name: str, loop: LoopConfig) -> ray.train.Result:
    """Ray Train's run of the loop, with the validation actor beside it. Interrupted (Ctrl-C),
    it raises ``Interrupted`` saying where the run can resume."""
    # the run's state (workers, attempts, checkpoints) on the dashboard's Train page; a local
    # Ray without its dashboard has no such page, and no state API its tracking could ask
    if runtime.has_state_api():
        os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")
    validator, callbacks = validation.start(job, family, loop.run_dir)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    trainer = _Trainer(
        train_loop,
        train_loop_config=vars(loop),
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
        with starting.waiting_for_workers(name, workers):
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
