"""`raytuner bench train`: one Ray Train worker on the cached dataset against a bare loop.

Both sides train the same LoRA on the same denoiser with the same global batches of the same
cached tensors and the same torch thread count; each is timed over ``steps`` steps after
``steps`` warm-up steps. The bare loop has every batch in memory before the clock starts, so
the ratio charges raytuner with everything it adds: Ray Train, the cache reads, the prefetch
thread, the metrics and the reports.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import torch

from raytuner import runtime
from raytuner.bench import print_figures, torch_threads
from raytuner.config import JobConfig, ValidationConfig
from raytuner.data.cache import fingerprint, read_manifest
from raytuner.data.preprocess import preprocess
from raytuner.data.reader import open_dataset
from raytuner.families import get_family, parts
from raytuner.train.feed import Feed
from raytuner.train.weights import Weights


def _one_worker_job(job: JobConfig, steps: int, output: str) -> JobConfig:
    """The job trained by one worker for two windows of ``steps``; the second is measured.
    No validation renders and no TensorBoard files: nothing beside the loop."""
    return dataclasses.replace(
        job,
        train=dataclasses.replace(
            job.train,
            output=output,
            name="bench",
            max_steps=2 * steps,
            log_every=steps,
            tensorboard=False,
        ),
        validation=ValidationConfig(),
        scaling=dataclasses.replace(job.scaling, workers=1),
        checkpoint=dataclasses.replace(job.checkpoint, every_steps=2 * steps, resume=True),
    )


def _batches(job: JobConfig, count: int) -> list[tuple[dict, list[int]]]:
    """The first ``count`` global batches of the schedule as tensors, with their noise seeds."""
    t = job.train
    data = open_dataset(job.data.cache, fingerprint(job.model, job.preprocess))
    feed = Feed(
        data,
        seed=t.seed,
        global_batch_size=t.global_batch_size,
        remainder=t.remainder,
        rank=0,
        world=1,
        prefetch=1,
        pin=False,
        caption_dropout=t.caption_dropout,
    )
    out, epoch = [], 0
    while len(out) < count:
        batches = feed.epoch(epoch)
        for index in range(min(len(batches), count - len(out))):
            batch = feed.assemble(epoch, index, batches)
            out.append((batch.tensors, batch.seeds))
        epoch += 1
    data.close()
    return out


def bare_loop(job: JobConfig, steps: int, threads: int) -> float:
    """Samples/s of a plain single-process loop over the same batches (no Ray)."""
    with torch_threads(threads):
        return _bare_loop(job, steps)


def _bare_loop(job: JobConfig, steps: int) -> float:
    """The loop ``bare_loop`` times."""
    family, t = get_family(job.model.family), job.train
    torch.manual_seed(t.seed)
    m = job.model
    source = parts.source(m.pretrained, m.revision, m.dtype, "cpu")
    denoiser = family.denoiser(source)
    weights = Weights(
        denoiser, mode=t.mode, lora=job.lora, targets=family.lora_targets, ema_decay=t.ema_decay
    )
    params = weights.params
    opt = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)
    loss_fn = family.loss(source, job.objective)
    batches = _batches(job, 2 * steps)
    start = 0.0
    for i, (batch, seeds) in enumerate(batches):
        if i == steps:
            start = time.perf_counter()
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        loss_fn(denoiser, batch, generators).mean().backward()
        torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        weights.step()
    return steps * t.global_batch_size / (time.perf_counter() - start)


def bench_train(job: JobConfig, steps: int, as_json: bool) -> dict:
    from raytuner.train.trainer import train

    runtime.connect()
    if read_manifest(job.data.cache, fingerprint(job.model, job.preprocess)) is None:
        preprocess(job.model, job.data, job.preprocess)
    with tempfile.TemporaryDirectory(prefix="raytuner-bench-train-") as output:
        metrics = train(_one_worker_job(job, steps, output))["metrics"]
    threads = int(metrics["threads"])
    bare = bare_loop(job, steps, threads)
    result = {
        "samples_per_s": round(metrics["samples_per_s"], 2),
        "bare_samples_per_s": round(bare, 2),
        "ratio": round(metrics["samples_per_s"] / bare, 3),
        "data_wait_fraction": round(metrics["data_wait_fraction"], 4),
        "step_time_s": round(metrics["step_time_s"], 4),
        "global_batch_size": job.train.global_batch_size,
        "measured_steps": steps,
        "threads": threads,
        "cpus": os.cpu_count(),
    }
    return print_figures(result, as_json)
