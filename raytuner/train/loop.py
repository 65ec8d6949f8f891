"""The per-worker training loop (runs inside Ray Train workers)."""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import time
from dataclasses import dataclass

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from raytuner import runs, storage
from raytuner.config import (
    CheckpointConfig,
    LoraConfig,
    MemoryConfig,
    ModelConfig,
    ObjectiveConfig,
    TrackingConfig,
    TrainConfig,
)
from raytuner.lora import export
from raytuner.observe.memory import PeakMemory
from raytuner.observe.observer import Observer
from raytuner.train import checkpoints, optim
from raytuner.train.feed import open_feed
from raytuner.train.sample_log import SampleLog, attempt_id
from raytuner.train.step import train_step
from raytuner.train.weights import trainable_model

log = logging.getLogger("raytuner.train")


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """What a worker receives: its own sections, plus where the committed cache is."""

    family: object  # the job's Family (families/)
    model: ModelConfig
    train: TrainConfig
    lora: LoraConfig
    objective: ObjectiveConfig
    checkpoint: CheckpointConfig
    cache: str
    fingerprint: str
    manifest: dict  # the committed manifest the job started with (``reader.for_readers``)
    dataset: dict  # what a checkpoint records of it (``trainer.dataset_record``)
    run_dir: str  # <train.output>/<run name>
    job: dict  # the whole resolved job, written into every checkpoint as a record only
    memory: MemoryConfig = MemoryConfig()
    validation_every: int = 0  # validation renders need a checkpoint every N steps
    tracking: TrackingConfig = TrackingConfig()  # rank 0's W&B run (the job as its config)


class Meter:
    """Loss, throughput and data wait over the steps since the last flush. The loss stays on the
    device until the flush, so steps do not synchronise with the host to log it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._reset()

    def _reset(self) -> None:
        self.loss_sum, self.steps = torch.zeros((), device=self.device), 0
        self.tick = time.perf_counter()

    def add(self, loss_sum: torch.Tensor) -> None:
        self.loss_sum += loss_sum
        self.steps += 1

    def flush(self, global_batch_size: int, wait_s: float) -> dict[str, float]:
        """Means over the window, across ranks for the loss; ``wait_s``: this rank's data wait."""
        seconds = time.perf_counter() - self.tick
        total = self.loss_sum.detach().clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        samples = self.steps * global_batch_size
        out = {
            "loss": total.item() / samples,
            "samples_per_s": samples / seconds,
            "step_time_s": seconds / self.steps,
            "data_wait_fraction": wait_s / seconds,
        }
        self._reset()
        return out


def _report(cfg: LoopConfig, st, metrics: dict, weights, opt, sched, family, jit: bool) -> None:
    """A checkpoint through ``ray.train.report`` (a barrier: every rank calls it, rank 0 attaches
    the files). Only checkpoints are reported: Ray Train 2.60 takes one report per worker each
    health check (2 s), and a report blocks until the previous one is taken, so reporting every
    log window would throttle fast steps."""
    checkpoint = None
    if ray.train.get_context().get_world_rank() == 0:
        if jit:
            log.warning("preemption announced: checkpoint at step %d before the node goes", st.step)
        directory = tempfile.mkdtemp(prefix="raytuner-ckpt-")  # Ray deletes it after upload
        identity = checkpoints.run_identity(
            cfg.model, cfg.lora, cfg.train, cfg.fingerprint, cfg.dataset["id"]
        )
        records = {runs.RUN: identity, runs.JOB: cfg.job, runs.DATASET: cfg.dataset}
        run = storage.basename(cfg.run_dir)
        meta = export.metadata(
            family=family.name,
            model=cfg.model,
            lora=cfg.lora,
            step=st.step,
            run=run,
            fingerprint=cfg.fingerprint,
        )
        save = functools.partial(weights.export, family=family, meta=meta)
        try:
            checkpoints.save_checkpoint(directory, weights, opt, sched, st, records, save)
        except OSError as e:  # a full disk: no half-written folder left behind
            shutil.rmtree(directory, ignore_errors=True)
            need = sum(t.numel() * t.element_size() for t in weights.params)
            raise RuntimeError(
                f"checkpoint of step {st.step} could not be written to {directory} ({e}): it "
                f"needs room for the trained weights ({need:,} bytes) about three times over "
                "(weights, optimizer state, export); free space there or set TMPDIR"
            ) from e
        checkpoint = ray.train.Checkpoint.from_directory(directory)
    ray.train.report(metrics, checkpoint=checkpoint)


def _quiet_ray_train_reports() -> None:
    """Ray 2.60 logs one INFO line per report and rank from a logger named by its file path,
    which RunConfig's LoggingConfig (a ``ray.train.*`` filter) does not reach."""
    from ray.train.v2._internal.execution import context

    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def _candidates(restored: ray.train.Checkpoint, run_dir: str):
    """Ray's latest checkpoint first, then the run's older checkpoint folders, newest first."""
    yield restored
    fs, folders = runs.checkpoint_folders(run_dir)
    newest = storage.basename(restored.path)
    for path in folders:
        if storage.basename(path) < newest:  # timestamp names sort by age
            yield ray.train.Checkpoint(path, filesystem=fs)


def _restore(cfg: LoopConfig, weights, opt, sched, rank: int) -> checkpoints.TrainState:
    """The newest readable checkpoint's state, applied; a broken one is skipped with a warning."""
    if (restored := ray.train.get_checkpoint()) is None:
        return checkpoints.TrainState()
    for candidate in _candidates(restored, cfg.run_dir):
        try:
            with candidate.as_directory() as directory:
                st = checkpoints.load_checkpoint(directory, weights, opt, sched)
        except checkpoints.CheckpointError as e:
            log.warning("rank %d: skipping unreadable checkpoint: %s", rank, e)
            continue
        log.info(
            "rank %d resumed at step %d (epoch %d, batch %d) from %s",
            *(rank, st.step, st.epoch, st.index, candidate.path),
        )
        return st
    raise RuntimeError(f"no readable checkpoint in {cfg.run_dir}: start a new run instead")


def _preempted(cfg: LoopConfig, step: int) -> bool:
    """Whether Ray announced a preemption of a node of this group (one actor round trip)."""
    every = cfg.checkpoint.preemption_check_every
    return bool(every) and step % every == 0 and ray.train.get_preemption_info() is not None


def _checkpoint_due(cfg: LoopConfig, step: int) -> bool:
    every = [cfg.checkpoint.every_steps] + [cfg.validation_every] * bool(cfg.validation_every)
    return step == cfg.train.max_steps or any(step % n == 0 for n in every)


def _end_window(cfg: LoopConfig, st, meter: Meter, feed, samples: SampleLog, lr, observer, memory):
    """Close the metrics window: report it on rank 0, write the sample log, return the metrics
    (with this worker's peak memory so far)."""
    metrics = meter.flush(cfg.train.global_batch_size, feed.take_wait())
    st.loss = metrics["loss"]
    st.first_loss = st.loss if st.first_loss is None else st.first_loss
    if observer is not None:
        observer.window(st.step, metrics, lr)
    samples.flush()
    position = {"step": st.step, "epoch": st.epoch, "first_loss": st.first_loss}
    return metrics | position | memory.peaks() | {"lr": lr, "threads": torch.get_num_threads()}


def train_loop(config: dict) -> None:
    cfg = LoopConfig(**config)
    memory = PeakMemory().start()
    _quiet_ray_train_reports()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    family, device, t = cfg.family, ray.train.torch.get_device(), cfg.train
    torch.manual_seed(t.seed)  # the same LoRA init on every rank
    trained = trainable_model(cfg.model, t, cfg.lora, family, device, cfg.memory)
    weights, placed = trained.weights, trained.placement
    opt, sched = optim.for_run(t, weights.params)
    st = _restore(cfg, weights, opt, sched, rank)
    placed.check(opt)  # restored optimizer state beside its parameter, every block in its place
    model = placed.distributed(ray.train.torch.prepare_model)
    loss_fn = family.loss(trained.source, cfg.objective.for_family(family))
    step = train_step(trained, model, loss_fn, opt, sched, t, cfg.memory, device, world)
    pin = device.type == "cuda"
    feed = open_feed(cfg.train, cfg.cache, cfg.fingerprint, cfg.manifest, rank, world, pin)
    feed.start(st.epoch, st.index)
    samples = SampleLog(cfg.run_dir if t.sample_log else None, attempt_id(), rank, world)
    meter, warned = Meter(device), False
    observer = None
    if rank == 0:
        observer = Observer(cfg.run_dir, t.max_steps, t.tensorboard, cfg.tracking, cfg.job)
    try:
        while st.step < t.max_steps:
            batch = feed.next(st.epoch, st.index)
            meter.add(step(batch))
            st.step, (st.epoch, st.index) = st.step + 1, batch.after()
            samples.add(st.step, batch.epoch, batch.index, batch.ids)
            # a spot reclaim announced to any rank: every rank checkpoints now (once), so the
            # restart loses no finished step; the call is a barrier that agrees across ranks
            jit = not warned and _preempted(cfg, st.step)
            warned |= jit
            due = jit or _checkpoint_due(cfg, st.step)
            if due or st.step % t.log_every == 0:
                lr = sched.get_last_lr()[0]
                metrics = _end_window(cfg, st, meter, feed, samples, lr, observer, memory)
                if due:
                    started = time.perf_counter()
                    _report(cfg, st, metrics, weights, opt, sched, family, jit)
                    if observer is not None:
                        observer.checkpoint(st.step, time.perf_counter() - started)
    finally:
        feed.close()
        feed.data.close()
        memory.stop()
        if observer is not None:
            observer.close()
