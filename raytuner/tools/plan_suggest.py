"""What `raytuner plan` suggests: for a worker that does not fit, the settings that make it fit
(cheaper remedies, block swap, sharding over the fewest workers); for one that fits, the faster
settings that still fit (no gradient checkpointing, a larger micro-batch). Each suggestion is
traced like the job itself (``plan_trace.py``)."""

from __future__ import annotations

import dataclasses

from raytuner.config import JobConfig
from raytuner.families import parts
from raytuner.placement.strategy import Strategy
from raytuner.tools import plan_sharded
from raytuner.tools.plan_trace import (
    OVERHEAD,
    micro_batch,
    sharded_parts,
    swapped_peak,
    trace_step,
)


def _with(job: JobConfig, **train) -> JobConfig:
    return dataclasses.replace(job, train=dataclasses.replace(job.train, **train))


def _remedies(job: JobConfig) -> list[tuple[str, JobConfig]]:
    """Settings that lower the worker's peak, cheapest first."""
    out = []
    if not job.train.gradient_checkpointing:
        out.append(("train.gradient_checkpointing = true", _with(job, gradient_checkpointing=True)))
    if micro_batch(job) > 1:
        one = _with(job, gradient_checkpointing=True, micro_batch_size=1)
        out.append(("train.gradient_checkpointing = true, train.micro_batch_size = 1", one))
    if job.model.dtype == "float32":
        half = dataclasses.replace(job, model=dataclasses.replace(job.model, dtype="bfloat16"))
        out.append(('model.dtype = "bfloat16"', half))
    return out


def _swap_suggestions(job: JobConfig, family, shapes, size, gpu_memory: int) -> list[dict]:
    """The fewest ``memory.blocks_to_swap`` that make the worker fit, with gradient
    checkpointing (which block swap needs), in the job's dtype and in float8."""
    out = []
    if not family.blocks.swap or job.train.mode != "lora":
        return out
    dtypes = [job.model.dtype] + ([parts.FLOAT8] if job.model.dtype != parts.FLOAT8 else [])
    for dtype in dtypes:
        changed = dataclasses.replace(job, model=dataclasses.replace(job.model, dtype=dtype))
        worker = trace_step(changed, family, shapes, size, micro_batch(changed), True)
        ring = job.memory.swap_ring
        for n in range(1, len(worker["block_bytes"])):
            if (peak := swapped_peak(worker, n, ring)) <= gpu_memory:
                text = f"train.gradient_checkpointing = true, memory.blocks_to_swap = {n}"
                text += f', model.dtype = "{dtype}"' if dtype != job.model.dtype else ""
                out.append({"set": text, "peak_bytes": peak, "fits": True})
                break
    return out


def _fsdp_suggestion(job: JobConfig, parts: dict, gpu_memory: int) -> dict:
    """The fewest sharded workers that fit, as a suggestion."""
    worker = plan_sharded.fewest_workers(job, parts, gpu_memory, OVERHEAD)
    if worker is None:
        n = plan_sharded.MOST_WORKERS
        peak = plan_sharded.worker_bytes(job, parts, n, OVERHEAD)["peak_bytes"]
        text = f'scaling.strategy = "fsdp", scaling.workers = {n}'
        return {"set": text, "peak_bytes": peak, "fits": False}
    text = f'scaling.strategy = "fsdp", scaling.workers = {worker["workers"]} (or more)'
    return {"set": text, "peak_bytes": worker["peak_bytes"], "fits": True}


def when_too_big(job: JobConfig, family, shapes, size, gpu_memory: int, sharded) -> list[dict]:
    """Settings that make a worker that does not fit fit: for a replicated job the cheaper
    remedies first, block swap, then sharding over the fewest workers that fit; for a sharded
    one, more workers."""
    micro = micro_batch(job)
    if sharded is not None:
        return [_fsdp_suggestion(job, sharded["parts"], gpu_memory)]
    out = []
    for text, changed in _remedies(job):
        micro_changed, checkpointing = micro_batch(changed), changed.train.gradient_checkpointing
        peak = trace_step(changed, family, shapes, size, micro_changed, checkpointing)["peak_bytes"]
        out.append({"set": text, "peak_bytes": peak, "fits": peak <= gpu_memory})
    out += _swap_suggestions(job, family, shapes, size, gpu_memory)
    checkpointing, sharded_job = job.train.gradient_checkpointing, job
    if job.lora.text_encoder:  # fsdp shards the denoiser only: without the text encoders
        sharded_job = dataclasses.replace(job, lora=job.lora.without_text_encoder())
    parts = sharded_parts(sharded_job, family, shapes, size, micro, checkpointing)
    suggestion = _fsdp_suggestion(sharded_job, parts, gpu_memory)
    if sharded_job is not job:
        suggestion["set"] = "lora.text_encoder = false, " + suggestion["set"]
    return out + [suggestion]


def _measure(job: JobConfig, family, shapes, size) -> tuple[int, float]:
    """A worker's peak bytes (sharded: at the fewest workers) and TFLOP a sample."""
    micro, checkpointing = micro_batch(job), job.train.gradient_checkpointing
    worker = trace_step(job, family, shapes, size, micro, checkpointing)
    if not Strategy.of(job.scaling.strategy).sharded:
        return worker["peak_bytes"], worker["tflops_per_sample"]
    parts = sharded_parts(job, family, shapes, size, micro, checkpointing)
    fewest = plan_sharded.worker_bytes(job, parts, job.scaling.min_workers, OVERHEAD)
    return fewest["peak_bytes"], worker["tflops_per_sample"]


def faster(job: JobConfig, family, shapes, size, gpu_memory: int) -> list[dict]:
    """For a worker that fits: faster settings that still fit, the fastest last. Gradient
    checkpointing off (the forward is not run again in backward: a third less work a sample
    for a transformer), then the largest micro-batch up to the worker's slice of the global
    batch (fewer, larger kernels; each tried at twice the last)."""
    out, best = [], job
    if job.train.gradient_checkpointing and not job.memory.blocks_to_swap:  # swap needs it
        off = _with(job, gradient_checkpointing=False)
        peak, tflops = _measure(off, family, shapes, size)
        if peak <= gpu_memory:
            out.append(_faster("train.gradient_checkpointing = false", peak, tflops))
            best = off
    micro, fewest = micro_batch(best), best.scaling.min_workers
    slice_ = -(-best.train.global_batch_size // fewest)
    larger = None
    while micro < slice_:
        micro = min(2 * micro, slice_)
        changed = _with(best, micro_batch_size=micro)
        peak, tflops = _measure(changed, family, shapes, size)
        if peak > gpu_memory:
            break
        larger = (micro, peak, tflops)
    if larger is not None:
        text = f"train.micro_batch_size = {larger[0]}"
        if best is not job:
            text = f"train.gradient_checkpointing = false, {text}"
        out.append(_faster(text, larger[1], larger[2]))
    return out


def _faster(text: str, peak: int, tflops: float) -> dict:
    return {"set": text, "peak_bytes": peak, "fits": True, "faster": True,
            "tflops_per_sample": tflops}  # fmt: skip
