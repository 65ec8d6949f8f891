"""`raytuner bench train`: one Ray Train worker on the cached dataset against a bare loop.

Both sides train the same LoRA on the same denoiser with the same global batches of the same
cached tensors and the same torch thread count; each is timed over ``steps`` steps after
``steps`` warm-up steps. The bare loop has every batch's rows in memory before the clock
starts and makes each step's draws (noise, timesteps) inside it, as a plain loop does, so the
ratio charges raytuner with everything it adds: Ray Train, the cache reads, the feed's threads
(which make the draws beside the step), the metrics and the reports.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
import time

import torch

from raytuner import runtime
from raytuner.config import JobConfig, ValidationConfig
from raytuner.data.cache import fingerprint
from raytuner.data.reader import for_readers, open_dataset
from raytuner.families import parts
from raytuner.placement.strategy import Strategy
from raytuner.preprocess.job import update_cache
from raytuner.tools.bench.common import (
    alternate,
    load_average,
    print_figures,
    round_figures,
    torch_threads,
    wait_for_quiet,
)
from raytuner.train import optim, text_lora
from raytuner.train.feed import Feed, RankSlice, drawn
from raytuner.train.model import trainable_model
from raytuner.train.step import train_step


def _one_worker_job(job: JobConfig, steps: int, output: str) -> JobConfig:
    """The job trained by one worker for two windows of ``steps``; the second is measured.
    No validation renders and no TensorBoard files: nothing beside the loop. One worker holds
    a replica (``"auto"``: ddp)."""
    strategy = Strategy.one_process(job.scaling.strategy)
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
        scaling=dataclasses.replace(job.scaling, workers=1, strategy=strategy.name),
        checkpoint=dataclasses.replace(job.checkpoint, every_steps=2 * steps, resume=True),
    )


def _batches(job: JobConfig, family, count: int) -> list[tuple[dict, list[int]]]:
    """The first ``count`` global batches of the schedule as tensors, with their noise seeds
    (with ``lora.text_encoder``, the captions' token ids, as the worker's feed makes them)."""
    t, text = job.train, None
    if job.lora.text_encoder:  # its tokenizers; the encoders on the meta device, unused
        source = parts.model_source(job.model, "cpu")
        text = text_lora.build(family, source, torch.device("meta"), job.lora, t, torch.float32)
    from raytuner.train.trainer import job_dataset

    fp = fingerprint(job.model, job.preprocess)
    readers = for_readers(*job_dataset(job, fp))  # the job's own rows
    data = open_dataset(job.data.cache, fp, readers, computed=text.outputs if text else ())
    # the rows as the worker's feed reads them; the objective's draws are the bare loop's to
    # make, inside its clock, as a plain loop draws its noise each step (the worker's feed makes
    # them in its threads)
    feed = Feed(
        data,
        seed=t.seed,
        global_batch_size=t.global_batch_size,
        remainder=t.remainder,
        rank=0,
        world=1,
        prefetch=1,
        pin=torch.cuda.is_available(),
        caption_dropout=t.caption_dropout,
        tokenize=text.tokens if text else None,
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


def bare_loop(job: JobConfig, family, steps: int, threads: int, batches=None) -> float:
    """Samples/s of a plain single-process loop over the same batches (no Ray); ``batches``:
    those of ``_batches(job, family, 2 * steps)`` when already read."""
    if batches is None:
        batches = _batches(job, family, 2 * steps)
    with torch_threads(threads):
        return _bare_loop(job, family, steps, batches)


def _bare_loop(job: JobConfig, family, steps: int, batches: list) -> float:
    """The loop ``bare_loop`` times: the worker's own model setup and step (``TrainStep``, the
    same object the loop calls) on this machine's device (a GPU when there is one), without
    Ray, the cache reads or the feed."""
    t = job.train
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(t.seed)
    trained = trainable_model(job.model, t, job.lora, family, device, job.memory)
    opt, sched = optim.for_run(t, trained.weights.param_groups())
    loss_fn = family.loss(trained.source, job.objective.for_family(family))
    take_step = train_step(trained, trained.denoiser, loss_fn, opt, sched, t, job.memory, device)
    pin, start = device.type == "cuda", 0.0
    for i, (tensors, seeds) in enumerate(batches):
        if i == steps:
            _synchronize(device)
            start = time.perf_counter()
        made = drawn(tensors, seeds, loss_fn.draw, pin)  # the step's noise and timesteps
        take_step(RankSlice(0, i, len(batches), made, seeds, []))
    _synchronize(device)
    return steps * t.global_batch_size / (time.perf_counter() - start)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_train(job: JobConfig, family, steps: int, as_json: bool, rounds: int = 3) -> dict:
    """``rounds`` rounds, each one ``train()`` run (one worker, a fresh output folder) and then
    the bare loop; the figures are the medians over the rounds."""
    from raytuner.train.trainer import job_dataset, train

    runtime.connect()
    try:
        job_dataset(job, fingerprint(job.model, job.preprocess))
    except FileNotFoundError:  # the job's rows are not committed yet
        update_cache(job.model, job.data, job.preprocess, family=family)
    batches = _batches(job, family, 2 * steps)  # read once: the bare loop's clock never sees them
    threads: list[int] = []
    with tempfile.TemporaryDirectory(prefix="raytuner-bench-train-") as output:

        def pipeline(r: int) -> dict:
            run = _one_worker_job(job, steps, os.path.join(output, f"round-{r}"))
            metrics = train(run, family)["metrics"]
            threads.append(int(metrics["threads"]))
            return metrics

        def bare(r: int) -> float:  # with the torch thread count its round's worker had
            return bare_loop(job, family, steps, threads[-1], batches)

        load_before = load_average()
        sides = alternate(rounds, {"pipeline": pipeline, "bare": bare}, wait_for_quiet)
        load_after = load_average()
    metrics = sides["pipeline"]
    rates = {"pipeline": [m["samples_per_s"] for m in metrics], "bare": sides["bare"]}
    keys = ("samples_per_s", "data_wait_fraction", "step_time_s", "tflops_per_s")
    median = {k: statistics.median(m[k] for m in metrics) for k in keys}
    mfu = [m["mfu"] for m in metrics if m["mfu"] is not None]
    hfu = [m["hfu"] for m in metrics if m.get("hfu") is not None]
    bare_rate = statistics.median(rates["bare"])
    result = {
        "samples_per_s": round(median["samples_per_s"], 2),
        "bare_samples_per_s": round(bare_rate, 2),
        "ratio": round(median["samples_per_s"] / bare_rate, 3),
        "data_wait_fraction": round(median["data_wait_fraction"], 4),
        "step_time_s": round(median["step_time_s"], 4),
        # the worker's counted work (the model's: no recompute): TFLOP/s, MFU and HFU against
        # the GPU's peak (None: unknown)
        "tflops_per_s": float(f"{median['tflops_per_s']:.4g}"),
        "tflops_per_sample": float(f"{median['tflops_per_s'] / median['samples_per_s']:.4g}"),
        "bare_tflops_per_s": float(
            f"{median['tflops_per_s'] / median['samples_per_s'] * bare_rate:.4g}"
        ),
        "mfu": round(statistics.median(mfu), 4) if mfu else None,
        "hfu": round(statistics.median(hfu), 4) if hfu else None,
        "global_batch_size": job.train.global_batch_size,
        "measured_steps": steps,
        "threads": threads[0],
        "cpus": os.cpu_count(),
        **round_figures(rounds, rates, load_before, load_after),
    }
    return print_figures(result, as_json)
