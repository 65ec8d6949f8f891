"""What a run takes from `raytuner plan` without being asked, before any worker loads weights:
the strategy (``scaling.strategy = "auto"``: ``auto.py``), then the step's speed settings.

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

from raytuner.config import ConfigError, JobConfig
from raytuner.placement.strategy import Strategy
from raytuner.tools.plan import auto
from raytuner.tools.plan.auto import KEYS, Memory, free_keys
from raytuner.tools.plan.suggest import changes, largest_fitting
from raytuner.tools.plan.trace import (
    MARGIN,
    GiB,
    Traces,
    largest_bucket,
    largest_frames,
    micro_batch,
    trace_encoders,
)

log = logging.getLogger("raytuner")

__all__ = ["KEYS", "Memory", "adopt", "before_workers", "decided", "fastest", "free_keys"]
__all__ += ["worker_gpu", "worker_memory"]


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
    usable = int(memory * (1 - MARGIN))
    found = fastest(job, traces_of(job, family), usable, free)
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


def worker_gpu(scaling, wait: bool = False) -> tuple[str, int] | None:
    """The GPU a training worker gets: its name and the bytes of it that are the worker's
    (a worker's share of a GPU it shares), asked of a task on one; None when the cluster has no
    GPU up now (an autoscaler starts them for the workers: the job's settings are kept), or
    with ``wait`` (a strategy to decide), once one is up (``scaling.resource_wait_s``)."""
    import ray

    from raytuner import runtime

    share = min(scaling.gpus_per_worker or 1.0, 1.0)
    if not ray.cluster_resources().get("GPU"):
        if not wait:
            return None
        log.info("train: waiting for a GPU to decide scaling.strategy = \"auto\" on")
        lower = "scaling.gpus_per_worker, or name scaling.worker_memory (then no GPU is asked)"
        runtime.wait_for_resources(
            [{"GPU": share}], scaling.resource_wait_s, 'scaling.strategy = "auto" and its probe',
            lower=lower,
        )

    @ray.remote(num_cpus=0, num_gpus=share, max_calls=1)
    def probe() -> tuple[str, int]:
        import torch

        properties = torch.cuda.get_device_properties(0)
        return properties.name, properties.total_memory

    name, total = ray.get(probe.remote())
    return name, int(total * share)


def traces_of(job: JobConfig, family) -> Traces:
    """Plan's traces of the job's family at its largest bucket, shared by the strategy's
    decision and the step's settings (and by ``check`` and ``train`` in one process): the last
    job's kept."""
    size = largest_bucket(job, family)
    key = (family.name, repr(job.model), repr(job.preprocess), size, largest_frames(job, family))
    if _TRACES.get("key") != key:
        _TRACES.update(key=key, traces=Traces(family, trace_encoders(job, family, size)[1], size))
    return _TRACES["traces"]


_TRACES: dict = {}
_DECIDED: dict = {}


def decided(job: JobConfig, family, memory: Memory) -> auto.Choice:
    """``auto.decide`` for workers of ``memory``, with the step settings a GPU run adopts left
    free; decided once a job and memory (``check`` and then ``train`` ask the same)."""
    free = free_keys(job) if job.scaling.use_gpu else ()
    key = (repr(job), job.given, family.name, memory)
    if key not in _DECIDED:
        _DECIDED.clear()
        _DECIDED[key] = auto.decide(job, family, memory, free, traces_of(job, family))
    return _DECIDED[key]


def worker_memory(job: JobConfig) -> Memory | None:
    """The memory a training worker has: ``scaling.worker_memory``, else the GPU it gets
    (``worker_gpu``; for ``"auto"`` waited for where none is up yet), else None (CPU workers,
    or a named strategy and no GPU up yet)."""
    if (given := job.scaling.memory_bytes) is not None:
        return Memory(given, "scaling.worker_memory")
    undecided = Strategy.pinned(job.scaling.strategy) is None
    if not job.scaling.use_gpu or (gpu := worker_gpu(job.scaling, undecided)) is None:
        return None
    return Memory(gpu[1], gpu[0])


def before_workers(job: JobConfig, family) -> JobConfig:
    """The job as a run's workers start it: ``scaling.strategy = "auto"`` decided on the
    memory a worker has (``worker_memory``; a job nothing fits refused, ``ConfigError``), then
    on GPUs the fastest free step settings that fit (``adopt``); each said on the terminal."""
    undecided = Strategy.pinned(job.scaling.strategy) is None
    free = free_keys(job) if job.scaling.use_gpu else ()
    memory = worker_memory(job) if undecided or free else None
    if undecided:
        choice = _strategy(job, family, memory)
        job = choice.job
        log.info("train: %s", choice.line)
    if free and memory is not None:
        log.info("train: sizing the step on the GPU a worker gets (`raytuner plan`'s traces)")
        job, line = adopt(job, family, (memory.source, memory.bytes))
        if line:
            log.info("train: %s", line)
    return job


def _strategy(job: JobConfig, family, memory: Memory | None) -> auto.Choice:
    """``"auto"`` decided on ``memory``; with none, a replica, saying why."""
    if memory is None:
        why = "CPU workers (scaling.use_gpu = false), no scaling.worker_memory to size a replica "
        return auto.cpu_choice(job, why + "against")
    log.info("train: deciding scaling.strategy on %s (`raytuner plan`'s traces)", memory.source)
    choice = decided(job, family, memory)
    if choice.refusal:
        raise ConfigError(choice.refusal)
    return choice
