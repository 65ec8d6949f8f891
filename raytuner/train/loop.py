"""The per-worker training loop (runs inside Ray Train workers)."""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist

from raytuner.config import CheckpointConfig, LoraConfig, ModelConfig, TrainConfig
from raytuner.data.cache import CachedDataset, load_cached
from raytuner.families import get_family
from raytuner.train import state as ckpt
from raytuner.train.schedule import epoch_batches, rank_slice, sample_seed

log = logging.getLogger("raytuner.train")


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """What a worker receives: its own sections, plus where the committed cache is."""

    model: ModelConfig
    train: TrainConfig
    lora: LoraConfig
    checkpoint: CheckpointConfig
    cache: str
    fingerprint: str


class Feed:
    """This rank's slice of the global schedule, from a cursor (epoch, next global batch)."""

    def __init__(self, data: CachedDataset, train: TrainConfig, rank: int, world: int, device):
        self.data, self.train, self.rank, self.world, self.device = data, train, rank, world, device
        # a source's repeats are repeated appearances of its rows in the schedule
        self.rows = [i for i, n in enumerate(data.repeats) for _ in range(n)]
        buckets = data.buckets
        self.buckets = [buckets[i] for i in self.rows]
        self._epoch, self._batches = -1, []

    def next(self, st: ckpt.TrainState) -> tuple[dict, list[torch.Generator]]:
        """The batch at the cursor in ``st``, which is moved to the following global batch."""
        if self._epoch != st.epoch:
            t = self.train
            self._batches = epoch_batches(
                self.buckets, t.seed, st.epoch, t.global_batch_size, t.remainder
            )
            self._epoch = st.epoch
        global_batch = self._batches[st.index]
        start, stop = rank_slice(global_batch, self.rank, self.world)
        seeds = [sample_seed(self.train.seed, st.epoch, st.index, p) for p in range(start, stop)]
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        rows = [self.rows[j] for j in global_batch[start:stop]]
        batch = {k: v.to(self.device) for k, v in self.data.batch(rows).items()}
        st.index += 1
        if st.index == len(self._batches):
            st.epoch, st.index = st.epoch + 1, 0
        return batch, generators


def _global_mean(per_sample_sum: torch.Tensor, global_batch_size: int) -> float:
    total = per_sample_sum.detach().clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    return total.item() / global_batch_size


class Meter:
    """Mean loss and throughput over the steps since the last flush."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.tick = time.perf_counter()

    def flush(self, samples_per_step: int) -> tuple[float, float]:
        seconds = time.perf_counter() - self.tick
        mean = sum(self.losses) / len(self.losses)
        rate = len(self.losses) * samples_per_step / seconds
        self.losses, self.tick = [], time.perf_counter()
        return mean, rate


def _report(cfg: LoopConfig, st: ckpt.TrainState, metrics: dict, model, opt, sched, family):
    """Every rank reports (it is a barrier); rank 0 attaches the checkpoint when one is due."""
    due = st.step % cfg.checkpoint.every_steps == 0 or st.step == cfg.train.max_steps
    checkpoint = None
    if due and ray.train.get_context().get_world_rank() == 0:
        directory = tempfile.mkdtemp(prefix="raytuner-ckpt-")  # Ray deletes it after upload
        ckpt.save_checkpoint(directory, model, opt, sched, st, family.save_lora)
        checkpoint = ray.train.Checkpoint.from_directory(directory)
    ray.train.report(metrics, checkpoint=checkpoint)


def _quiet_ray_train_reports() -> None:
    """Ray 2.60 logs one INFO line per report and rank from a logger named by its file path,
    which RunConfig's LoggingConfig (a ``ray.train.*`` filter) does not reach."""
    from ray.train.v2._internal.execution import context

    logging.getLogger(context.__file__).setLevel(logging.WARNING)


def train_loop(config: dict) -> None:
    cfg = LoopConfig(**config)
    _quiet_ray_train_reports()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    family, device = get_family(cfg.model.family), ray.train.torch.get_device()
    torch.manual_seed(cfg.train.seed)  # the same LoRA init on every rank
    denoiser = family.denoiser(cfg.model.pretrained, cfg.model.revision)
    params = ckpt.add_lora(denoiser, cfg.lora, family.lora_targets)
    opt = torch.optim.AdamW(params, lr=cfg.train.learning_rate, weight_decay=cfg.train.weight_decay)
    warmup = max(cfg.train.warmup_steps, 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    st = ckpt.TrainState()
    if (restored := ray.train.get_checkpoint()) is not None:
        with restored.as_directory() as directory:
            st = ckpt.load_checkpoint(directory, denoiser, opt, sched)
        log.info(
            "rank %d resumed at step %d (epoch %d, batch %d)", rank, st.step, st.epoch, st.index
        )
    model = ray.train.torch.prepare_model(denoiser)
    loss_fn = family.loss(cfg.model.pretrained, cfg.model.revision)
    feed = Feed(load_cached(cfg.cache, cfg.fingerprint), cfg.train, rank, world, device)
    gbs, meter = cfg.train.global_batch_size, Meter()
    while st.step < cfg.train.max_steps:
        batch, generators = feed.next(st)
        per_sample = loss_fn(model, batch, generators)
        # DDP averages gradients over ranks: scale so the update is the mean over the global batch
        (per_sample.sum() * world / gbs).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.train.max_grad_norm)
        opt.step(), sched.step(), opt.zero_grad(set_to_none=True)
        st.step += 1
        meter.losses.append(_global_mean(per_sample.sum(), gbs))
        log_due = st.step % cfg.train.log_every == 0 or st.step == cfg.train.max_steps
        if log_due or st.step % cfg.checkpoint.every_steps == 0:
            st.loss, rate = meter.flush(gbs)
            st.first_loss = st.loss if st.first_loss is None else st.first_loss
            if rank == 0:
                log.info(
                    "step %d/%d loss %.4f lr %.2e %.1f samples/s",
                    st.step,
                    cfg.train.max_steps,
                    st.loss,
                    sched.get_last_lr()[0],
                    rate,
                )
            metrics = {
                "step": st.step,
                "loss": st.loss,
                "first_loss": st.first_loss,
                "epoch": st.epoch,
                "samples_per_s": rate,
            }
            _report(cfg, st, metrics, denoiser, opt, sched, family)
