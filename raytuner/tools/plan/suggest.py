"""What `raytuner plan` suggests: for a worker that does not fit, the settings that make it fit
(cheaper remedies, block swap, sharding over the fewest workers); for one that fits, the faster
settings that still fit (no gradient checkpointing, a larger micro-batch). Each suggestion is
traced like the job itself (``trace.py``)."""

from __future__ import annotations

import dataclasses

from raytuner.config import JobConfig
from raytuner.families import parts
from raytuner.placement.strategy import SHARDED, UNSHARDABLE, Strategy
from raytuner.tools.plan import fsdp
from raytuner.tools.plan.trace import OVERHEAD, Traces, block_sizes, micro_batch, swapped_peak

# the settings a suggestion may change, and how a job TOML writes them
SETTINGS = (
    ("train", "gradient_checkpointing"),
    ("train", "micro_batch_size"),
    ("train", "optimizer"),
    ("model", "dtype"),
    ("memory", "blocks_to_swap"),
    ("memory", "activation_offload"),
    ("lora", "text_encoder"),
    ("scaling", "strategy"),
)
MOST_LORA_WORKERS = 8  # a LoRA is sharded inside one node at most (docs/training.md)


def _with(job: JobConfig, **train) -> JobConfig:
    return dataclasses.replace(job, train=dataclasses.replace(job.train, **train))


def _set(job: JobConfig, section: str, **values) -> JobConfig:
    changed = dataclasses.replace(getattr(job, section), **values)
    return dataclasses.replace(job, **{section: changed})


def changes(job: JobConfig, changed: JobConfig) -> str:
    """The settings ``changed`` has that ``job`` has not, as a job TOML writes them (a
    micro-batch only where the samples a forward differ)."""
    out = []
    for section, key in SETTINGS:
        old, new = getattr(getattr(job, section), key), getattr(getattr(changed, section), key)
        if key == "micro_batch_size":
            old, new = micro_batch(job), micro_batch(changed)
        if old != new:
            out.append(f"{section}.{key} = {_toml(new)}")
    return ", ".join(out)


def _toml(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f'"{value}"' if isinstance(value, str) else str(value)


def _remedies(job: JobConfig) -> list[JobConfig]:
    """Settings that lower the worker's peak, cheapest first."""
    out = []
    if not job.train.gradient_checkpointing:
        out.append(_with(job, gradient_checkpointing=True))
    if micro_batch(job) > 1:
        out.append(_with(job, gradient_checkpointing=True, micro_batch_size=1))
    if job.model.dtype == "float32":
        out.append(_set(job, "model", dtype="bfloat16"))
    return out


def _swap_suggestions(job: JobConfig, traces: Traces, usable: int) -> list[dict]:
    """The fewest ``memory.blocks_to_swap`` that make the worker fit, with gradient
    checkpointing (which block swap needs), in the job's dtype and in float8; when neither
    fits, with the checkpointed activations offloaded to host memory too
    (``memory.activation_offload``: a long clip's saved block inputs are most of its step)."""
    out = []
    if not traces.family.blocks.swap or job.train.mode != "lora":
        return out
    dtypes = [job.model.dtype] + ([parts.FLOAT8] if job.model.dtype != parts.FLOAT8 else [])
    for dtype in dtypes:
        out += _fewest_swapped(job, _set(job, "model", dtype=dtype), traces, usable)
    if not out and not job.memory.activation_offload:
        # checkpointing first: offloading its saved inputs needs it (config/rules.py)
        offloaded = _set(_with(job, gradient_checkpointing=True), "memory", activation_offload=True)
        out += _fewest_swapped(job, offloaded, traces, usable)
    return out


def _fewest_swapped(job: JobConfig, changed: JobConfig, traces: Traces, usable: int) -> list:
    """``changed`` (the job in another dtype or with activations offloaded) with the fewest
    blocks swapped that fit, as a suggestion for ``job``; [] when none does."""
    worker = traces.step(changed, micro_batch(changed), True)
    ring = job.memory.swap_ring
    for n in range(job.memory.blocks_to_swap + 1, min(block_sizes(worker))):
        if (peak := swapped_peak(worker, n, ring)) <= usable:
            swapped = _with(changed, gradient_checkpointing=True)
            swapped = _set(swapped, "memory", blocks_to_swap=n)
            return [{"set": changes(job, swapped), "peak_bytes": peak, "fits": True}]
    return []


def _shardable(job: JobConfig) -> JobConfig:
    """``job`` sharded (``scaling.strategy = "fsdp"``), with what sharding cannot take
    (``Strategy.refusal``) changed: no block swap, no float8 storage, AdamW, no text encoders
    (fsdp shards the denoiser only)."""
    job = _set(job, "lora", text_encoder=False) if job.lora.text_encoder else job
    job = _set(job, "memory", blocks_to_swap=0)
    if job.model.dtype == parts.FLOAT8:
        job = _set(job, "model", dtype="bfloat16")
    if job.train.optimizer in UNSHARDABLE:
        job = _with(job, optimizer="adamw")
    return _set(job, "scaling", strategy=SHARDED.name)


def _fsdp_suggestion(job: JobConfig, sharded: JobConfig, traced: dict, usable: int) -> dict:
    """The fewest workers ``sharded`` (``job`` sharded; ``traced``: its ``Traces.sharded``)
    fits at, as a suggestion; up to ``MOST_LORA_WORKERS`` for a LoRA (sharding across nodes is
    not what a LoRA should pick: docs/training.md), ``fsdp.MOST_WORKERS`` for a full
    fine-tune, still too big there."""
    most = MOST_LORA_WORKERS if job.train.mode == "lora" else fsdp.MOST_WORKERS
    worker = fsdp.fewest_workers(sharded, traced, usable, OVERHEAD, most)
    text = changes(job, sharded)
    text = (text + ", " if text else "") + "scaling.workers = "
    if worker is None:
        peak = fsdp.worker_bytes(sharded, traced, most, OVERHEAD)["peak_bytes"]
        return {"set": f"{text}{most}", "peak_bytes": peak, "fits": False}
    text += f"{worker['workers']} (or more)"
    return {"set": text, "peak_bytes": worker["peak_bytes"], "fits": True}


def when_too_big(job: JobConfig, traces: Traces, usable: int, sharded) -> list[dict]:
    """Settings that make a worker that does not fit ``usable`` bytes fit: for a replicated job
    the cheaper remedies first, block swap, then sharding over the fewest workers that fit; for
    a sharded one, more workers. Each says only what it changes."""
    micro = micro_batch(job)
    if sharded is not None:
        return [_fsdp_suggestion(job, job, sharded["parts"], usable)]
    out = []
    for changed in _remedies(job):
        micro_changed, checkpointing = micro_batch(changed), changed.train.gradient_checkpointing
        peak = traces.step(changed, micro_changed, checkpointing)["peak_bytes"]
        out.append({"set": changes(job, changed), "peak_bytes": peak, "fits": peak <= usable})
    out += _swap_suggestions(job, traces, usable)
    candidate = _shardable(job)
    traced = traces.sharded(candidate, micro, job.train.gradient_checkpointing)
    return out + [_fsdp_suggestion(job, candidate, traced, usable)]


def _measure(job: JobConfig, traces: Traces) -> tuple[int, float]:
    """A worker's peak bytes (sharded: at the fewest workers) and TFLOP a sample."""
    micro, checkpointing = micro_batch(job), job.train.gradient_checkpointing
    if not Strategy.of(job.scaling.strategy).sharded:
        worker = traces.step(job, micro, checkpointing)
        return worker["peak_bytes"], worker["tflops_per_sample"]
    parts = traces.sharded(job, micro, checkpointing)
    fewest = fsdp.worker_bytes(job, parts, job.scaling.min_workers, OVERHEAD)
    return fewest["peak_bytes"], parts["flops"] / micro / 1e12


def faster(job: JobConfig, traces: Traces, usable: int) -> list[dict]:
    """For a worker that fits ``usable`` bytes: faster settings that still fit, the fastest
    last. Gradient checkpointing off (the forward is not run again in backward: a third less
    work a sample for a transformer), then the largest micro-batch up to the worker's slice of
    the global batch (fewer, larger kernels), of twice, four times … the job's, capped at the
    slice (``largest_fitting``)."""
    out, best = [], job
    if job.train.gradient_checkpointing and not job.memory.blocks_to_swap:  # swap needs it
        off = _with(_set(job, "memory", activation_offload=False), gradient_checkpointing=False)
        peak, tflops = _measure(off, traces)
        if peak <= usable:
            out.append(_faster(changes(job, off), peak, tflops))
            best = off
    micro, slice_ = micro_batch(best), -(-best.train.global_batch_size // best.scaling.min_workers)
    sizes = []
    while micro < slice_:
        micro = min(2 * micro, slice_)
        sizes.append(micro)
    if larger := largest_fitting(best, sizes, traces, usable):
        out.append(_faster(changes(job, larger[0]), larger[1], larger[2]))
    return out


def largest_fitting(job: JobConfig, sizes: list[int], traces: Traces, usable: int):
    """The largest micro-batch of ``sizes`` (ascending) that fits, as (the job with it, peak,
    TFLOP a sample), or None: the largest tried first (it often fits), then halving the
    sizes left (a worker's peak grows with its micro-batch: one that does not fit rules out
    every larger one)."""
    fits, low, high = (
        None,
        0,
        len(sizes),
    )  # sizes[:low] fit (the largest in fits), sizes[high:] do not
    middle = high - 1
    while low < high:
        changed = _with(job, micro_batch_size=sizes[middle])
        peak, tflops = _measure(changed, traces)
        if peak <= usable:
            fits, low = (changed, peak, tflops), middle + 1
        else:
            high = middle
        middle = (low + high) // 2
    return fits


def _faster(text: str, peak: int, tflops: float) -> dict:
    return {"set": text, "peak_bytes": peak, "fits": True, "faster": True,
            "tflops_per_sample": tflops}  # fmt: skip


def closing(job: JobConfig, result: dict) -> str:
    """The sentence that ends a plan: what to do (``result``: ``plan``'s, its suggestions
    made)."""
    usable, size = result["usable_bytes"], _gib(result["gpu_memory_bytes"])
    margin = f"{result['margin']:.0%} of it kept free"
    suggestions, too_big = result["suggestions"], []
    if not result["fits"]:
        fitting = [s for s in suggestions if s["fits"]]
        if fitting:
            s = fitting[0]
            too_big.append(f"to fit {size}, set {s['set']} ({_gib(s['peak_bytes'])})")
        else:
            nearest = min(suggestions + [result], key=lambda s: s["peak_bytes"])
            what = f"with {nearest['set']}" if nearest is not result else "as it is"
            need = nearest["peak_bytes"] / (1 - result["margin"])
            more = " or shard it over more workers" if result["strategy"] == "fsdp" else ""
            too_big.append(
                f"nothing plan tries fits {size} ({margin}): the nearest is {what}, "
                f"{_gib(nearest['peak_bytes'])}; the job needs a GPU of at least "
                f"{_gib(need)}{more}"
            )
    for name, fix in _actor_fixes(job).items():
        actor = result[name]
        if actor is not None and not actor["fits"]:
            who = name.replace("_", " ")
            too_big.append(f"the {who} needs {_gib(actor['needs_bytes'])}: {fix}")
    if too_big:
        return "; ".join(too_big) + "."
    return f"the job fits {size} with {margin} ({_gib(usable)} usable)" + (
        f"; faster, and still fitting: {suggestions[-1]['set']}." if suggestions else "."
    )


def _actor_fixes(job: JobConfig) -> dict[str, str]:
    """What makes an encoder or validation actor that does not fit fit."""
    smaller = "lower preprocess.batch_size, or " if job.preprocess.batch_size > 1 else ""
    shares = 0 < job.validation.gpus < 1  # beside a training worker, on its GPU
    elsewhere = "set validation.gpus = 1 (a GPU of its own), or " if shares else "set "
    return {
        "encoder_actor": f"{smaller}preprocess on a larger GPU (`raytuner preprocess`)",
        "validation_actor": f"{elsewhere}validation.every_steps = 0 and render checkpoints "
        "with `raytuner sample` on a larger GPU",
    }


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
