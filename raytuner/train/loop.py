"""The per-worker training loop (runs inside Ray Train workers)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from raytuner import storage
from raytuner.checkpoint import layout, resume
from raytuner.checkpoint.checkpointer import Checkpointer, Contents
from raytuner.config import (
    CheckpointConfig,
    LoraConfig,
    MemoryConfig,
    ModelConfig,
    ObjectiveConfig,
    TrackingConfig,
    TrainConfig,
)
from raytuner.families import mixture
from raytuner.lora import export
from raytuner.observe import flops
from raytuner.observe.memory import PeakMemory
from raytuner.observe.observer import Observer
from raytuner.placement.strategy import Strategy
from raytuner.train import optim
from raytuner.train.feed import open_feed
from raytuner.train.finite import FiniteGuard
from raytuner.train.model import trainable_model
from raytuner.train.sample_log import SampleLog, attempt_id
from raytuner.train.step import train_step

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
    strategy: str = "ddp"  # scaling.strategy: ddp (replicated) or fsdp (sharded)
    peak_tflops: float = 0.0  # scaling.peak_tflops: the GPU's peak for MFU (0: from its name)
    validation_every: int = 0  # validation renders need a checkpoint every N steps
    tracking: TrackingConfig = TrackingConfig()  # rank 0's W&B run (the job as its config)
    # model.merge_adapters as recorded (path, weight, sha256 each: lora.merge.identity)
    merged: tuple = ()


class Meter:
    """Loss, throughput, work and data wait over the steps since the last flush. The loss stays
    on the device until the flush, so steps do not synchronise with the host to log it.
    ``peak``: the device's dense bfloat16 TFLOP/s (None: MFU and HFU unknown)."""

    def __init__(self, device: torch.device, peak: float | None = None) -> None:
        self.device, self.peak = device, peak
        self._reset()

    def _reset(self) -> None:
        self.sums, self.steps = torch.zeros(3, dtype=torch.float64, device=self.device), 0
        self.tick = time.perf_counter()

    def add(self, loss_sum: torch.Tensor, flops: float = 0.0, model_flops: float = 0.0) -> None:
        """A step's loss sum and this rank's FLOPs of it: the hardware's (recompute included)
        and the model's."""
        self.sums[0] += loss_sum.detach()
        self.sums[1] += flops
        self.sums[2] += model_flops
        self.steps += 1

    def flush(self, global_batch_size: int, wait_s: float) -> dict[str, float | None]:
        """Means over the window, across ranks for the loss and the work (TFLOP/s per worker);
        ``wait_s``: this rank's data wait."""
        seconds = time.perf_counter() - self.tick
        total, world = self.sums.clone(), 1
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
            world = dist.get_world_size()
        loss, work, model_work = total.tolist()
        samples = self.steps * global_batch_size
        tflops, model_tflops = (w / seconds / world / 1e12 for w in (work, model_work))
        out = {
            "loss": loss / samples,
            "samples_per_s": samples / seconds,
            "step_time_s": seconds / self.steps,
            "data_wait_fraction": wait_s / seconds,
            "tflops_per_s": model_tflops,  # the model's work (no recompute) a second
            "hardware_tflops_per_s": tflops,
            "mfu": flops.mfu(model_tflops, self.peak),
            "hfu": flops.mfu(tflops, self.peak),
        }
        self._reset()
        return out


def _quiet_ray_train_reports() -> None:
    """Ray 2.60 logs one INFO line per report and rank from a logger named by its file path,
    which RunConfig's LoggingConfig (a ``ray.train.*`` filter) does not reach."""
    from ray.train.v2._internal.execution import context

    logging.getLogger(context.__file__).setLevel(logging.WARNING)


class Worker:
    """One Ray Train worker's training, built once per worker: its peak-memory sampler, the
    trained weights (placed, wrapped for DDP), optimizer, LR schedule and train step, the state
    restored from the newest readable checkpoint, the feed started at its cursor, the metrics
    meter, the sample log and, on rank 0, the observer. ``close()`` stops what it started."""

    def __init__(self, cfg: LoopConfig) -> None:
        self.cfg, t = cfg, cfg.train
        self.memory = PeakMemory().start()
        ctx = ray.train.get_context()
        self.rank, world = ctx.get_world_rank(), ctx.get_world_size()
        device = ray.train.torch.get_device()
        started = time.perf_counter()
        self.say("%d worker(s) started: building the model on %s", world, device)
        torch.manual_seed(t.seed)  # the same LoRA init on every rank
        strategy = Strategy.of(cfg.strategy)
        trained = trainable_model(
            cfg.model, t, cfg.lora, cfg.family, device, cfg.memory, strategy=strategy
        )
        self.say("model built in %.1f s", time.perf_counter() - started)
        self.weights, placed = trained.weights, trained.placement
        self.opt, self.sched = optim.for_run(t, self.weights.param_groups())
        self.checkpoints = Checkpointer(
            cfg.run_dir, cfg.checkpoint, rank=self.rank, sharded=strategy.sharded,
            max_steps=t.max_steps, validation_every=cfg.validation_every,
        )  # fmt: skip
        self.state = self.checkpoints.restore(self.weights, self.opt, self.sched)
        # restored optimizer state beside its parameter, every block in its place
        placed.check(self.opt)
        model = strategy.wrap(placed, ray.train.torch.prepare_model)
        loss_fn = cfg.family.loss(trained.source, cfg.objective.for_family(cfg.family))
        opt, sched = self.opt, self.sched
        self.train_step = train_step(
            trained, model, loss_fn, opt, sched, t, cfg.memory, device, world
        )
        pin = device.type == "cuda"
        where = (cfg.cache, cfg.fingerprint, cfg.manifest)
        text = trained.weights.text
        turns = mixture.turns_of(loss_fn, cfg.model.expert_switch_every)  # model.expert "both"
        self.feed = open_feed(t, *where, self.rank, world, pin, text, loss_fn.draw, turns)
        self.feed.start(self.state.epoch, self.state.index, self.state.step)
        run_dir = cfg.run_dir if t.sample_log else None
        self.samples = SampleLog(run_dir, attempt_id(), self.rank, world)
        self.meter = Meter(device, flops.device_peak(device, cfg.peak_tflops))
        self.guard, self.went_wrong = FiniteGuard(device), None
        self.observer = None
        if self.rank == 0:
            args = (cfg.run_dir, t.max_steps, t.tensorboard, cfg.tracking, cfg.job)
            self.observer = Observer(*args, resumed=self.state.step)
        if trained.compiled:
            self.say("train.compile: the first steps compile the denoiser's blocks (minutes)")

    def say(self, message: str, *args) -> None:
        """A line of rank 0 about where the worker group is (each rank would repeat it)."""
        if self.rank == 0:
            log.info(message, *args)

    def train_batch(self) -> None:
        """Train this rank's slice of the next global batch; the step and cursor move past it."""
        st = self.state
        batch = self.feed.next(st.epoch, st.index)
        loss = self.train_step(batch)
        self.meter.add(loss, self.train_step.flops, self.train_step.model_flops)
        st.step, (st.epoch, st.index) = st.step + 1, batch.after()
        self.samples.add(st.step, batch.epoch, batch.index, batch.ids, self._expert(batch))
        # the step before's verdict (this one's is still on the device)
        self.went_wrong = self.guard.add(st.step, loss, self.train_step.grad_norm)

    def _expert(self, batch) -> dict | None:
        """What the sample log says of a step of experts trained in turn: its expert and its
        samples' noise levels (the feed's draw in that expert's range)."""
        turns = self.cfg.family.turns
        if self.samples.run_dir is None or not turns or "sigma" not in batch.tensors:
            return None  # no sample log, or one expert: nothing more (no sync for sigma)
        return {"expert": turns[batch.turn].name, "sigma": batch.tensors["sigma"].tolist()}

    def stop_reason(self, window: bool, due: bool) -> str | None:
        """Why the run must stop before it logs, checkpoints or trains on (the same on every
        worker): a loss or gradients no longer finite (at a metrics window or a checkpoint,
        the check of the step just trained), or, before a checkpoint, weights no longer
        finite."""
        reason = self.went_wrong or (self.guard.now() if window else None)
        if reason is None and due and not self.guard.weights_finite(self.weights.params):
            reason = f"the trained weights are not finite after step {self.state.step}"
        return reason

    def end_window(self) -> dict:
        """Close the metrics window: report it on rank 0, write the sample log, return the metrics
        (with this worker's peak memory so far)."""
        st, lr = self.state, self.sched.get_last_lr()[0]
        metrics = self.meter.flush(self.cfg.train.global_batch_size, self.feed.take_wait())
        st.loss = metrics["loss"]
        st.first_loss = st.loss if st.first_loss is None else st.first_loss
        if self.observer is not None:
            self.observer.window(st.step, metrics, lr)
        self.samples.flush()
        position = {"step": st.step, "epoch": st.epoch, "first_loss": st.first_loss}
        extra = {"lr": lr, "threads": torch.get_num_threads()}
        return metrics | position | self.memory.peaks() | extra

    def checkpoint(self, metrics: dict, preempted: bool) -> None:
        """A checkpoint of where training stands (``Checkpointer.save``: a barrier, every rank
        calls it); ``preempted``: taken because a preemption was announced."""
        seconds = self.checkpoints.save(self.state, self.contents(), metrics, preempted)
        if self.observer is not None:
            self.observer.checkpoint(self.state.step, seconds)

    def contents(self) -> Contents:
        """What this worker's checkpoints hold besides the train state."""
        return Contents(
            weights=self.weights, optimizer=self.opt, lr_schedule=self.sched,
            records=self._records, export=self._export,
        )  # fmt: skip

    def _records(self) -> dict:
        """The JSON a checkpoint keeps beside its tensors: the run's identity (what a resume must
        match), the resolved job, the dataset and, for a full fine-tune, its export's metadata."""
        cfg = self.cfg
        identity = resume.run_identity(
            cfg.model, cfg.lora, cfg.train, cfg.fingerprint, cfg.dataset["id"], cfg.strategy,
            cfg.merged,
        )  # fmt: skip
        records = {layout.RUN: identity, layout.JOB: cfg.job, layout.DATASET: cfg.dataset}
        if self.weights.mode == "full":  # the final export's raytuner.json (written from it)
            records[layout.EXPORT_META] = self._metadata()
        return records

    def _metadata(self) -> dict:
        cfg = self.cfg
        return export.metadata(
            family=cfg.family.name, model=cfg.model, lora=cfg.lora, step=self.state.step,
            run=storage.basename(cfg.run_dir), fingerprint=cfg.fingerprint, merged=cfg.merged,
        )  # fmt: skip

    def _export(self, folder: str | None) -> None:
        """A LoRA's export into the checkpoint (every worker: a sharded LoRA is gathered)."""
        if self.weights.mode == "lora":
            self.weights.export_lora(folder, family=self.cfg.family, meta=self._metadata())

    def close(self) -> None:
        """Stop the feed and its data, the memory sampler and rank 0's observer."""
        self.feed.close()
        self.feed.data.close()
        self.memory.stop()
        if self.observer is not None:
            self.observer.close()


def train_loop(config: dict) -> dict:
    """A Ray Train worker: from the newest readable checkpoint to ``train.max_steps``, a metrics
    window every ``train.log_every`` steps and a checkpoint where one is due. Returns what the
    driver reads as ``Result.return_value`` (rank 0's): ``{"stopped": why}`` when the run
    stopped early, every worker at the same step, because what it trains is no longer finite
    (``train/finite.py``): nothing after that step is checkpointed or exported."""
    cfg = LoopConfig(**config)
    _quiet_ray_train_reports()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    worker = Worker(cfg)
    first, started = worker.state.step + 1, time.perf_counter()
    try:
        while worker.state.step < cfg.train.max_steps:
            worker.train_batch()
            if worker.state.step == first and cfg.train.log_every > 1:  # its line comes later
                worker.say("step %d took %.1f s", first, time.perf_counter() - started)
            # a spot reclaim announced to any rank: every rank checkpoints now (once), so the
            # restart loses no finished step; the call is a barrier that agrees across ranks
            step = worker.state.step
            preempted = worker.checkpoints.preemption_announced(step)
            due = preempted or worker.checkpoints.due(step)
            window = due or worker.state.step % cfg.train.log_every == 0
            if (reason := worker.stop_reason(window, due)) is not None:
                if worker.rank == 0:
                    log.error("%s: stopping the run without a checkpoint after it", reason)
                return {"stopped": reason}
            if window:
                metrics = worker.end_window()
                if due:
                    worker.checkpoint(metrics, preempted)
    finally:
        worker.close()
    return {}
