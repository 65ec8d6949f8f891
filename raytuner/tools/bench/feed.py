"""`raytuner bench feed`: the training feed at full size, without a model.

It writes a synthetic committed cache in the real format with the tensor shapes of the job's
family at the job's resolution (``Family.cache_shapes``; N rows with N distinct captions over
three buckets), then runs W Ray Train workers through the feed training uses (``open_feed``:
this rank's slice of every global batch, read from the cache and stacked, ``train.prefetch``
ahead) for S steps, first on 1% of the rows and then on all: the worker's peak memory after the
first is the baseline of the second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
import time

import ray
import ray.train
import torch.distributed as dist
from ray.train.torch import TorchTrainer

from raytuner import placement, runtime
from raytuner.config import JobConfig
from raytuner.data import cache
from raytuner.data.reader import for_readers
from raytuner.observe.memory import PeakMemory
from raytuner.preprocess.job import bucket_sizes
from raytuner.tools import synthetic
from raytuner.tools.bench.common import print_figures
from raytuner.train.feed import open_feed


def _buckets(job: JobConfig, family) -> list[tuple[int, int]]:
    """The square bucket and its two nearest aspect ratios at the job's resolution."""
    sizes = bucket_sizes(family, job.preprocess)
    return sorted(sizes, key=lambda s: (abs(math.log(s[0] / s[1])), s))[:3]


def write_synthetic(job: JobConfig, family, rows: int, root: str) -> dict:
    """The job's cache version under ``root`` with ``rows`` synthetic rows (reused when one
    with that many rows is committed there); returns its manifest."""
    version = cache.Version(root, cache.fingerprint(job.model, job.preprocess))
    manifest = version.manifest()
    if manifest is not None and manifest["dataset"]["rows"] == rows:
        return manifest
    buckets = _buckets(job, family)
    return synthetic.write_cache(
        version,
        buckets=[buckets[i % len(buckets)] for i in range(rows)],
        captions=list(range(rows)),
        repeats=[1] * rows,
        shapes=family.cache_shapes,
        family=family.name,
        dtype=job.preprocess.dtype,
        rows_per_file=job.preprocess.batch_size,
    )


def _phase(config: dict, cache_root: str, manifest: dict, rank: int, world: int, device):
    """``steps`` batches of this rank's slice from one cache, moved to ``device``: rows/s,
    bytes read and used, requests."""
    pin = device.type == "cuda"
    feed = open_feed(config["train"], cache_root, config["fp"], manifest, rank, world, pin)
    feed.start(0, 0)
    reader, rows = feed.data.reader, 0
    try:
        cursor = feed.next(0, 0).after()  # the first batch pays for opening files: not timed
        start = time.perf_counter()
        before = (reader.bytes_read, feed.data.bytes_used, reader.requests)
        for _ in range(config["steps"]):
            batch = feed.next(*cursor)
            placement.batch(batch.tensors, device)
            cursor, rows = batch.after(), rows + len(batch.ids)
        seconds = time.perf_counter() - start
        after = (reader.bytes_read, feed.data.bytes_used, reader.requests)
    finally:
        feed.close()
        feed.data.close()
    read, used, requests = (int(a - b) for a, b in zip(after, before, strict=True))
    return {"rows_per_s": rows / seconds, "bytes_read": read, "bytes_used": used} | {
        "requests": requests
    }


def _feed_loop(config: dict) -> None:
    """One worker: the baseline cache, then the full one, each followed by this worker's peak
    memory so far; the figures of every rank gathered on rank 0 and reported."""
    memory = PeakMemory(interval_s=0.01).start()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    mine = []
    for cache_root, manifest in config["phases"]:
        mine.append(_phase(config, cache_root, manifest, rank, world, device) | memory.peaks())
    memory.stop()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    checkpoint = None
    if rank == 0:  # Ray Train keeps a report's metrics only when a checkpoint comes with it
        checkpoint = ray.train.Checkpoint.from_directory(tempfile.mkdtemp(prefix="feed-"))
    ray.train.report({"ranks": everyone}, checkpoint=checkpoint)


def _run(job: JobConfig, phases: list, workers: int, steps: int) -> list[list[dict]]:
    """Per phase (cache root, manifest), each rank's figures, from one run of the workers."""
    gpus = ray.cluster_resources().get("GPU", 0) >= workers and job.scaling.use_gpu
    config = {
        "train": dataclasses.replace(job.train, remainder="pad"),  # 1 % may not fill batches
        "fp": cache.fingerprint(job.model, job.preprocess),
        "phases": [(root, for_readers(manifest)) for root, manifest in phases],
        "steps": steps,
    }
    with tempfile.TemporaryDirectory(prefix="raytuner-bench-feed-") as output:
        trainer = TorchTrainer(
            _feed_loop,
            train_loop_config=config,
            scaling_config=ray.train.ScalingConfig(num_workers=workers, use_gpu=gpus),
            run_config=ray.train.RunConfig(
                name="bench-feed",
                storage_path=output,
                logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            ),
        )
        ranks = trainer.fit().metrics["ranks"]
    return [[r[i] for r in ranks] for i in range(len(phases))]


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def bench_feed(
    job: JobConfig, family, rows: int, workers: int, steps: int, as_json: bool, workdir=None
):
    runtime.connect()
    if workers > job.train.global_batch_size:
        raise ValueError(f"--workers {workers} > train.global_batch_size: every rank needs a row")
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="raytuner-feed-"))
        full_root, base_root = os.path.join(workdir, "full"), os.path.join(workdir, "base")
        tick = time.perf_counter()
        full = write_synthetic(job, family, rows, full_root)
        written = time.perf_counter() - tick
        base = write_synthetic(job, family, max(1, rows // 100), base_root)
        load_before = _load()
        baseline, measured = _run(job, [(base_root, base), (full_root, full)], workers, steps)
        load_after = _load()
    files = full["latents"] + full["text"] + [full["index"], full["captions"]]
    used = sum(r["bytes_used"] for r in measured)
    result = {
        "rows": rows,
        "cache_bytes": sum(f["bytes"] for f in files),
        "rows_per_s_per_worker": round(min(r["rows_per_s"] for r in measured), 1),
        "read_amplification": round(sum(r["bytes_read"] for r in measured) / used, 4),
        "peak_worker_rss_bytes": max(r["peak_rss_bytes"] for r in measured),
        "baseline_worker_rss_bytes": max(r["peak_rss_bytes"] for r in baseline),
        "peak_worker_anon_bytes": max(r["peak_anon_bytes"] for r in measured),
        "baseline_worker_anon_bytes": max(r["peak_anon_bytes"] for r in baseline),
        "requests_per_batch": round(sum(r["requests"] for r in measured) / (steps * workers), 2),
        "family": family.name,
        "shapes": {k: list(v) for k, v in _shapes(job, family).items()},
        "workers": workers,
        "steps": steps,
        "global_batch_size": job.train.global_batch_size,
        "write_s": round(written, 1),
        "load_before": load_before,
        "load_after": load_after,
    }
    return print_figures(result, as_json)


def _shapes(job: JobConfig, family) -> dict[str, tuple[int, ...]]:
    w, h = _buckets(job, family)[0]
    return family.cache_shapes(w, h)
