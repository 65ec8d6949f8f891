"""The step's speed settings a GPU run takes from `raytuner plan` without being asked.

A run on GPUs (``scaling.use_gpu``) sizes its step on the GPU a worker gets: gradient
checkpointing off (the forward is not run again in the backward) and the largest micro-batch up
to a worker's slice of the global batch (fewer, larger kernels), the fastest pair that plan says
fits that GPU with its margin. A key the job file or a ``--set`` names is the job's own
(``JobConfig.given``) and is kept; so is checkpointing that block swap or activation offload
needs. What was adopted is said on the terminal (and is in the run's ``job.json``).

Neither key changes what is learned: checkpointing recomputes the same forward, and the
micro-batches of a rank's slice accumulate into the same update; neither is part of a run's
identity, so a resume on another GPU may adopt other values.
"""

from __future__ import annotations

import dataclasses
import logging

from raytuner.config import JobConfig
from raytuner.tools.plan.suggest import changes, largest_fitting
from raytuner.tools.plan.trace import (
    MARGIN,
    GiB,
    Traces,
    largest_bucket,
    micro_batch,
    trace_encoders,
)

log = logging.getLogger("raytuner")

KEYS = ("train.gradient_checkpointing", "train.micro_batch_size")  # what a run may adopt


def free_keys(job: JobConfig) -> tuple[str, ...]:
    """Of ``KEYS``, those the job leaves to raytuner: not named by its file or ``--set``, and
    checkpointing only where nothing it has needs it (block swap, activation offload)."""
    free = [key for key in KEYS if key not in job.given]
    if job.memory.blocks_to_swap or job.memory.activation_offload:
        free = [key for key in free if key != "train.gradient_checkpointing"]
    return tuple(free)


def fastest(job: JobConfig, traces: Traces, usable: int, free: tuple[str, ...]):
    """The fastest settings of ``free`` keys whose worker fits ``usable`` bytes, as (the job
    with them, its peak bytes, TFLOP a sample), or None when none does: checkpointing off
    before on, then the largest micro-batch (1, 2, 4 … up to a worker's slice)."""
    train = job.train
    modes = [train.gradient_checkpointing]
    if "train.gradient_checkpointing" in free:
        modes = [False, True]
    slice_ = -(-train.global_batch_size // job.scaling.min_workers)
    sizes = [micro_batch(job)]
    if "train.micro_batch_size" in free:
        sizes = sorted({min(2**i, slice_) for i in range(slice_.bit_length() + 1)})
    for checkpointing in modes:
        candidate = dataclasses.replace(
            job, train=dataclasses.replace(train, gradient_checkpointing=checkpointing)
        )
        if found := largest_fitting(candidate, sizes, traces, usable):
            return found
    return None


def adopt(job: JobConfig, family, gpu: tuple[str, int]) -> tuple[JobConfig, str]:
    """``job`` with the fastest free settings that fit ``gpu`` (its name, a worker's bytes of
    it) and the line that says what was adopted ("" when nothing changed)."""
    free = free_keys(job)
    if not free:
        return job, ""
    name, memory = gpu
    size = largest_bucket(job, family)
    _, shapes = trace_encoders(job, family, size)
    usable = int(memory * (1 - MARGIN))
    found = fastest(job, Traces(family, shapes, size), usable, free)
    if found is None:
        return job, (
            f"plan finds no {' or '.join(free)} a worker fits {name}'s {memory / GiB:.1f} GiB "
            "with: the job's own kept (`raytuner plan` says what would fit)"
        )
    faster, peak, _ = found
    text = changes(job, faster)
    if not text:
        return job, ""
    return faster, (
        f"on {name} ({memory / GiB:.1f} GiB a worker) the step runs with {text}: the fastest "
        f"plan finds to fit, {peak / GiB:.1f} of {usable / GiB:.1f} GiB; name them in the job "
        "to keep your own"
    )


def worker_gpu(scaling) -> tuple[str, int] | None:
    """The GPU a training worker gets: its name and the bytes of it that are the worker's
    (a worker's share of a GPU it shares), asked of a task on one; None when the cluster has no
    GPU up now (an autoscaler starts them for the workers: the job's settings are kept)."""
    import ray

    if not ray.cluster_resources().get("GPU"):
        return None
    share = min(scaling.gpus_per_worker or 1.0, 1.0)

    @ray.remote(num_cpus=0, num_gpus=share, max_calls=1)
    def probe() -> tuple[str, int]:
        import torch

        properties = torch.cuda.get_device_properties(0)
        return properties.name, properties.total_memory

    name, total = ray.get(probe.remote())
    return name, int(total * share)


def on_gpus(job: JobConfig, family) -> JobConfig:
    """``adopt`` for a run about to train: on GPUs, with free keys, on the GPU a worker gets;
    says what it adopted."""
    if not job.scaling.use_gpu or not free_keys(job):
        return job
    gpu = worker_gpu(job.scaling)
    if gpu is None:
        return job
    log.info("train: sizing the step on the GPU a worker gets (`raytuner plan`'s traces)")
    job, line = adopt(job, family, gpu)
    if line:
        log.info("train: %s", line)
    return job
