"""`raytuner plan`: the GPU memory a job needs, per training worker, encoder actor and validation
actor, measured by running the real step on the meta device (nothing is allocated).

The training worker's figure is one real training step of the job (the worker's own model setup,
``train.model.trainable_model``, on the meta device; the family's loss on its example batch;
AdamW), run once on meta tensors (``meta.py`` counts them); a later step is the
same with the optimizer state alive: its peak is the weights (by dtype) plus the peak of every
tensor the step keeps alive at once (activations saved for backward, gradients, optimizer state,
temporaries).
Attention is traced as the fused kernel a GPU runs (output + log-sum-exp saved, never the score
matrix). Not counted: the CUDA context and cuBLAS/cuDNN workspaces (about 0.5-1 GiB a process,
see ``OVERHEAD``), allocator fragmentation, DDP's gradient buckets (another copy of the trainable
gradients; counted below) and the pinned host batches of the feed. A worker or actor fits a card
when its peak is within ``1 - MARGIN`` of it (fragmentation, what the driver keeps).

Each setting is traced once (``trace.Traces``), and ``progress.Progress`` says what is
traced, on the ``raytuner.plan`` logger.
"""

from __future__ import annotations

from raytuner.config import JobConfig
from raytuner.placement.encoders import WHOLE
from raytuner.placement.strategy import Strategy
from raytuner.tools.plan import auto, encoders, fsdp, suggest
from raytuner.tools.plan.progress import Progress
from raytuner.tools.plan.trace import (
    MARGIN,
    OVERHEAD,
    GiB,
    Traces,
    largest_bucket,
    micro_batch,
    trace_encoders,
    trace_validation,
)

__all__ = ["GiB", "measure"]


def _sharded(job: JobConfig, traces: Traces, micro: int, compare: bool) -> dict:
    """An fsdp job's worker at its fewest and most workers (an elastic group may shrink to the
    fewest: that is the one that must fit), and with gradient checkpointing the other way."""
    s, checkpointing = job.scaling, job.train.gradient_checkpointing
    parts = traces.sharded(job, micro, checkpointing)
    out = {
        "compute_dtype": parts["compute_dtype"],
        "by_workers": [
            fsdp.worker_bytes(job, parts, n, OVERHEAD)
            for n in sorted({s.min_workers, s.max_workers})
        ],
    }
    if compare:
        other = traces.sharded(job, micro, not checkpointing)
        key = "without" if checkpointing else "with"
        fewest = fsdp.worker_bytes(job, other, s.min_workers, OVERHEAD)
        out[f"peak_bytes_{key}_checkpointing"] = fewest["peak_bytes"]
    return out | {"parts": parts}


def measure(job: JobConfig, family, gpu_memory: int, compare: bool = True, progress=None) -> dict:
    """Everything ``raytuner plan`` prints (sizes in bytes); ``compare``: also the worker's
    peak with gradient checkpointing switched the other way. ``scaling.strategy = "auto"`` is
    decided on ``gpu_memory`` first (``strategy_choice`` says how). A ``scaling.strategy = "fsdp"``
    job's worker is the sharded one (``sharded``); a job that does not fit is offered the
    settings that would fit (``suggest.when_too_big``), one that fits the faster settings
    that would still fit (``suggest.faster``, with ``compare``). ``progress``: where it
    says what it traces (``progress.Progress``; by default one of its own)."""
    if progress is not None:
        return _measure(job, family, gpu_memory, compare, progress)
    with Progress() as progress:
        return _measure(job, family, gpu_memory, compare, progress)


def _measure(job: JobConfig, family, gpu_memory: int, compare: bool, progress: Progress) -> dict:
    size = largest_bucket(job, family)
    encoder, shapes = trace_encoders(job, family, size, progress)
    traces = _traces(family, shapes, size, progress)
    job, choice = _decided(job, family, gpu_memory, traces)
    micro = micro_batch(job)
    checkpointing = job.train.gradient_checkpointing
    worker = traces.step(job, micro, checkpointing)
    sharded, peak = None, worker["peak_bytes"]
    if Strategy.of(job.scaling.strategy).sharded:
        sharded = _sharded(job, traces, micro, compare)
        peak = sharded["by_workers"][0]["peak_bytes"]
    elif compare:
        other = traces.step(job, micro, not checkpointing)
        key = "without" if checkpointing else "with"
        worker[f"peak_bytes_{key}_checkpointing"] = other["peak_bytes"]
    usable = int(gpu_memory * (1 - MARGIN))
    fits = peak <= usable
    text = encoders.pool(job, family, gpu_memory)
    if fits:  # what would be faster and still fit (traced only for the full report)
        suggestions = suggest.faster(job, traces, usable) if compare else []
    else:
        suggestions = suggest.when_too_big(job, traces, usable, sharded)
    if sharded is not None:
        del sharded["parts"]  # traced for the suggestions; not printed
    result = {
        "family": family.name,
        "pretrained": job.model.pretrained,
        "strategy": job.scaling.strategy,
        # "auto": what it decided on gpu_memory and why (None for a strategy the job names)
        "strategy_choice": choice,
        "workers": job.scaling.workers,
        "bucket": list(size),
        "micro_batch": micro,
        "gradient_checkpointing": checkpointing,
        "gpu_memory_bytes": gpu_memory,
        "margin": MARGIN,
        "usable_bytes": usable,
        "denoiser_params": worker["denoiser_params"],
        "trainable_params": worker["trainable_params"],
        "weights_bytes": worker["weights_bytes"],
        "blocks_to_swap": worker["blocks_to_swap"],
        "peak_bytes": peak,
        "fits": fits,
        "tflops_per_sample": worker["tflops_per_sample"],
        "worker": worker,
        "sharded": sharded,
        "encoder_actor": _encoder_actor(encoder, text, usable),
        "text_encoder": text,
        "validation_actor": _validation(job, family, shapes, size, progress, peak, usable),
        "cache_shapes": {k: list(v) for k, v in shapes.items()},
        "suggestions": suggestions,
    }
    return result | {"closing": suggest.closing(job, result)}


_LAST: dict = {}  # the last plan's traces: a plan of the same model on another card reuses them


def _traces(family, shapes: dict, size, progress: Progress) -> Traces:
    """The traces of ``family`` (its expert) at ``size``: the last plan's when it planned the
    same (each trace is keyed by its whole job, so another ``gpu_memory`` asks for what it
    traced, and a plan of three cards in one process traces each setting once)."""
    key = (family.name, getattr(family, "expert", None), repr(sorted(shapes.items())), size)
    if _LAST.get("key") != key:
        _LAST.update(key=key, traces=Traces(family, shapes, size, progress))
    traces = _LAST["traces"]
    traces.progress = progress
    return traces


def _decided(job: JobConfig, family, gpu_memory: int, traces: Traces):
    """The job with ``scaling.strategy = "auto"`` decided on ``gpu_memory`` as a run decides it
    (``auto.decide``, the step settings a GPU run adopts left free), and the line that says
    how (None when the job names its strategy). Nothing fitting, the replicated job is
    planned, with its suggestions, and the line is the refusal `check` and `train` give."""
    if Strategy.pinned(job.scaling.strategy) is not None:
        return job, None
    memory = auto.Memory(gpu_memory, "--gpu-memory")
    choice = auto.decide(job, family, memory, auto.free_keys(job), traces)
    return choice.job, choice.line or f"strategy auto refuses the job as it is: {choice.refusal}"


def _fits(needs: int, usable: int) -> dict:
    return {"needs_bytes": needs, "fits": needs <= usable}


def _encoder_actor(encoder: dict, text: dict, usable: int) -> dict:
    """The encoder actor on one GPU; a text encoder split over the actor's GPUs or streamed
    from host memory (``text``: ``encoders.pool``, the VAE on its first GPU) fits where its
    busiest GPU does."""
    if text["layout"] == WHOLE:
        return encoder | _fits(encoder["peak_bytes"], usable)
    busiest = text["per_gpu_bytes"]
    fit = {"peak_bytes": busiest, "needs_bytes": busiest, "fits": text["fits"], "per_gpu": True}
    return encoder | fit


def _validation(job: JobConfig, family, shapes, size, progress, worker: int, usable: int):
    """The validation actor, when the job validates (``validation.every_steps``; else None):
    on a GPU of its own, or with a fraction of one (``validation.gpus`` < 1) beside a training
    worker on the worker's GPU."""
    if not job.validation.every_steps:
        return None
    actor = trace_validation(job, family, shapes, size, progress)
    shares = 0 < job.validation.gpus < 1
    needs = actor["peak_bytes"] + (worker if shares else 0)
    return actor | {"shares_training_gpu": shares} | _fits(needs, usable)
