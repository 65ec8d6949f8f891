"""``scaling.strategy = "auto"`` (the default): ddp while one replica of the job's worker fits
the memory a worker has, else fsdp over the fewest workers whose shards fit, decided from plan's
traces before any worker loads weights.

The memory is ``scaling.worker_memory`` where the job names it, else the GPU a worker gets
(``adopt.worker_gpu``, asked as training starts), else none (CPU workers: a replica, ddp);
`raytuner plan` decides on its ``--gpu-memory``. A replica or a shard fits when the worker's
peak at the leanest settings raytuner may choose (gradient checkpointing on and one sample a
forward where the job leaves them free: ``KEYS``; ``adopt.py`` then picks the fastest that
fits) is within the memory less plan's margin. Where the job leaves ``scaling.workers`` out,
fsdp takes the fewest workers that fit; where it names them, they are kept and must fit. A job
that nothing fits is refused (``Choice.refusal``), naming the key and what would fit. A
strategy the job names (``"ddp"``, ``"fsdp"``) is kept; with a memory given it must fit too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from raytuner.config import JobConfig
from raytuner.families import parts
from raytuner.placement.strategy import REPLICATED, SHARDED, Strategy
from raytuner.tools.plan import fsdp
from raytuner.tools.plan.suggest import MOST_LORA_WORKERS, changes
from raytuner.tools.plan.trace import MARGIN, OVERHEAD, GiB, Traces, micro_batch

KEYS = ("train.gradient_checkpointing", "train.micro_batch_size")  # what a GPU run may adopt


def free_keys(job: JobConfig) -> tuple[str, ...]:
    """Of ``KEYS``, those the job leaves to raytuner: not named by its file or ``--set``, and
    checkpointing only where nothing it has needs it (block swap, activation offload)."""
    free = [key for key in KEYS if key not in job.given]
    if job.memory.blocks_to_swap or job.memory.activation_offload:
        free = [key for key in free if key != "train.gradient_checkpointing"]
    return tuple(free)


@dataclass(frozen=True)
class Memory:
    """The memory a worker has: ``bytes``, and ``source``: what says so (a GPU's name,
    ``scaling.worker_memory``, ``--gpu-memory``)."""

    bytes: int
    source: str

    @property
    def usable(self) -> int:
        return int(self.bytes * (1 - MARGIN))

    def text(self) -> str:
        return f"the {_gib(self.usable)} usable of {self.source}'s {_gib(self.bytes)}"


@dataclass(frozen=True)
class Choice:
    """What ``decide`` decided: the ``job`` as its workers run it (the strategy decided, and
    ``scaling.workers`` where the job leaves them to raytuner), the ``line`` that says why
    ("" for a strategy the job names), and ``refusal`` when nothing fits (what ``check`` and
    ``train`` refuse the job with; ``job`` is then the replicated one, for plan's report)."""

    job: JobConfig
    line: str
    refusal: str = ""


def unshardable(job: JobConfig) -> str:
    """What of the job sharded weights cannot take, as the job writes it ("" when nothing)."""
    if job.lora.text_encoder:
        return "lora.text_encoder = true (the text encoders are replicated)"
    if job.lora.module_dropout:  # config/rules.module_dropout_needs
        return f"lora.module_dropout = {job.lora.module_dropout} (each worker skips other modules)"
    if job.train.float8_matmul:
        return "train.float8_matmul = true"
    refusal = SHARDED.refusal(
        blocks_to_swap=job.memory.blocks_to_swap,
        float8=job.model.dtype == parts.FLOAT8,
        optimizer=job.train.optimizer,
    )
    return refusal.split(" with scaling.strategy")[0] if refusal else ""


def cpu_choice(job: JobConfig, why: str) -> Choice:
    """``"auto"`` with no memory to size the job on: a replica (ddp), ``why`` said."""
    return Choice(_as(job, REPLICATED.name), f"strategy auto → ddp: {why}")


def decide(job: JobConfig, family, memory: Memory, free: tuple[str, ...], traces: Traces):
    """The ``Choice`` for ``job`` on workers of ``memory``; ``free``: the step settings
    raytuner may still choose (``free_keys`` on GPUs, none on CPU workers); ``traces``: plan's
    traces of the job's family at its largest bucket."""
    least = lean(job, free)
    pinned = Strategy.pinned(job.scaling.strategy)
    if pinned is not None:
        return Choice(job, "", _pinned_refusal(least, pinned, memory, traces))
    # the job's own settings first: what plan traces anyway, and what fits needs nothing leaner
    replica, leaner = replica_peak(_as(job, REPLICATED.name), traces), ""
    if replica > memory.usable and least != job:  # what a GPU run may take (adopt.py)
        replica = replica_peak(_as(least, REPLICATED.name), traces)
        leaner = f" (with {changes(job, least)})"
    needs = f"a replica needs {_gib(replica)}{leaner}"
    if replica <= memory.usable:
        line = f"strategy auto → ddp: {needs}, within {memory.text()}"
        return Choice(_as(job, REPLICATED.name), line)
    needs += f", more than {memory.text()}"
    replicated = _as(job, REPLICATED.name)
    if blocker := unshardable(job):
        refusal = (
            f'scaling.strategy = "auto": {needs}, and sharded weights cannot take {blocker}: '
            "change that (`raytuner plan` says what fits) or train on GPUs with more memory"
        )
        return Choice(replicated, "", refusal)
    workers_free = "scaling.workers" not in job.given
    start = 1 if workers_free else job.scaling.min_workers
    found, most = _fewest(least, traces, memory.usable, start)
    if found is not None and (workers_free or found[0] == start):
        n, peak = found
        chosen = _as(job, SHARDED.name, n if workers_free else job.scaling.workers)
        line = f"strategy auto → fsdp: {needs}; sharded over {_workers(n)}, a worker needs "
        line += _gib(peak)
        if workers_free:
            line += f", the fewest that fit: scaling.workers = {n} (name it for more)"
        return Choice(chosen, line)
    at_start = sharded_peak(least, traces, start)
    if found is not None:
        refusal = (
            f"scaling.workers = {job.scaling.workers}: {needs}, and sharded over "
            f"{_workers(start)} a worker needs {_gib(at_start)}: set {_more(job, found[0])} "
            "(the fewest whose shards fit), or leave scaling.workers out for raytuner to take them"
        )
        return Choice(replicated, "", refusal)
    return Choice(replicated, "", _too_big(job, needs, least, traces, most))


def _too_big(job: JobConfig, needs: str, least: JobConfig, traces: Traces, most: int) -> str:
    """Nothing fits, even sharded over ``most`` workers."""
    peak = sharded_peak(least, traces, max(most, 1))
    return (
        f'scaling.strategy = "auto": {needs}, and sharded over {most} workers (the most '
        f"raytuner shards a {job.train.mode} job over, at most train.global_batch_size) a "
        f"worker still needs {_gib(peak)}: train on GPUs with more memory, or with what "
        "`raytuner plan` suggests"
    )


def _pinned_refusal(least: JobConfig, pinned: Strategy, memory: Memory, traces: Traces) -> str:
    """Why a strategy the job names cannot fit ``memory`` ("" when it fits)."""
    if not pinned.sharded:
        replica = replica_peak(least, traces)
        if replica <= memory.usable:
            return ""
        return (
            f'scaling.strategy = "ddp": a replica needs {_gib(replica)}, more than '
            f'{memory.text()}; use scaling.strategy = "auto" (sharded over the fewest workers '
            'that fit) or "fsdp"'
        )
    start = least.scaling.min_workers
    peak = sharded_peak(least, traces, start)
    if peak <= memory.usable:
        return ""
    found, most = _fewest(least, traces, memory.usable, start + 1)
    fix = (
        f"set {_more(least, found[0])} (the fewest whose shards fit)"
        if found is not None
        else f"no group of up to {most} workers fits: train on GPUs with more memory"
    )
    return (
        f'scaling.workers = {least.scaling.workers} with scaling.strategy = "fsdp": sharded '
        f"over {_workers(start)} a worker needs {_gib(peak)}, more than {memory.text()}; {fix}"
    )


def lean(job: JobConfig, free: tuple[str, ...]) -> JobConfig:
    """``job`` at the leanest of its ``free`` step settings: what a worker needs at least."""
    leanest = {}
    if "train.gradient_checkpointing" in free:
        leanest["gradient_checkpointing"] = True
    if "train.micro_batch_size" in free:
        leanest["micro_batch_size"] = 1
    return dataclasses.replace(job, train=dataclasses.replace(job.train, **leanest))


def _as(job: JobConfig, strategy: str, workers=None) -> JobConfig:
    """``job`` with ``scaling.strategy = strategy`` (and ``scaling.workers`` when given)."""
    workers = job.scaling.workers if workers is None else workers
    scaling = dataclasses.replace(job.scaling, strategy=strategy, workers=workers)
    return dataclasses.replace(job, scaling=scaling)


def replica_peak(job: JobConfig, traces: Traces) -> int:
    return traces.step(job, micro_batch(job), job.train.gradient_checkpointing)["peak_bytes"]


def sharded_peak(job: JobConfig, traces: Traces, workers: int) -> int:
    """A sharded worker's peak in a group whose fewest workers are ``workers``."""
    bounds = job.scaling.workers
    group = [workers, max(workers, bounds[1])] if isinstance(bounds, list) else workers
    sharded = _as(job, SHARDED.name, group)
    parts_ = traces.sharded(sharded, micro_batch(sharded), job.train.gradient_checkpointing)
    return fsdp.worker_bytes(sharded, parts_, workers, OVERHEAD)["peak_bytes"]


def _fewest(job: JobConfig, traces: Traces, usable: int, start: int):
    """The fewest sharded workers from ``start`` whose peak fits ``usable`` as (workers,
    peak), or None; and the most tried: 8 for a LoRA (one node), ``fsdp.MOST_WORKERS`` for a
    full fine-tune, never more than the global batch (a sample a worker)."""
    most = MOST_LORA_WORKERS if job.train.mode == "lora" else fsdp.MOST_WORKERS
    most = min(most, job.train.global_batch_size)
    for n in range(start, most + 1):
        if (peak := sharded_peak(job, traces, n)) <= usable:
            return (n, peak), most
    return None, most


def _workers(n: int) -> str:
    return f"{n} worker" + ("s" if n != 1 else "")


def _more(job: JobConfig, fewest: int) -> str:
    """The ``scaling.workers`` setting whose fewest workers are ``fewest`` or more."""
    if isinstance(job.scaling.workers, list):
        return f"scaling.workers = [{fewest}, {max(fewest, job.scaling.max_workers)}] or more"
    return f"scaling.workers = {fewest} or more"


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"
