"""`raytuner bench step`: one process trains the job's denoiser on random batches of the job's
largest bucket (no Ray, no cache) and reports samples/s, the work (TFLOP a sample, counted;
TFLOP/s; MFU against the device's dense bfloat16 peak, ``scaling.peak_tflops`` or the table of
``observe/flops.py``) and the measured peak GPU memory beside what ``raytuner plan`` traces for
the same step. On a CPU it runs the same code (tiny models).
With ``scaling.strategy = "fsdp"`` the denoiser is sharded over a process group of one (what
sharding costs on one GPU: the gathers, the float32 reduction), against plan's sharded worker."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch

from raytuner.config import JobConfig
from raytuner.families import parts
from raytuner.observe import flops
from raytuner.placement.strategy import Strategy
from raytuner.tools.plan import fsdp, trace
from raytuner.train import optim, step
from raytuner.train.feed import RankSlice
from raytuner.train.model import trainable_model


def bench_step(
    job: JobConfig, family, steps: int, as_json: bool, warmup: int = 3, planned: bool = True
) -> dict:
    """``warmup`` steps first (kernels chosen, optimizer state made, compiled blocks compiled),
    then ``steps`` timed; ``planned``: also trace plan's step for the same settings (on the
    CPU: seconds to minutes of a full-size model) and report it beside the measured peak."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = trace.largest_bucket(job, family)
    if parts.Source(job.model.pretrained).full_size:  # released shapes: no encoder trace
        shapes = family.cache_shapes(*size, trace.largest_frames(job, family))
    else:
        shapes = trace.trace_encoders(job, family, size)[1]
    micro = trace.micro_batch(job)
    checkpointing = job.train.gradient_checkpointing
    planned_step = _planned(job, family, shapes, size, micro) if planned else None
    strategy = Strategy.one_process(job.scaling.strategy)
    strategy.alone(device)
    started = time.perf_counter()
    m, t = job.model, job.train
    trained = trainable_model(m, t, job.lora, family, device, job.memory, strategy=strategy)
    loss_fn = family.loss(trained.source, job.objective.for_family(family))
    dtype = trained.source.dtype
    load_s = time.perf_counter() - started
    _say(_built(job, trained.denoiser, trained.weights.params, load_s))
    opt, sched = optim.for_run(job.train, trained.weights.param_groups())
    one = dataclasses.replace(job.train, global_batch_size=micro, micro_batch_size=0)
    args = (trained, trained.denoiser, loss_fn, opt, sched, one, job.memory, device)
    train_step = step.train_step(*args)
    batches = [_example(family, trained, loss_fn, shapes, micro, size, device, t)
               for t in range(max(len(family.turns), 1))]  # fmt: skip
    warmup_s, seconds, graphs = _timed(_stepper(train_step, batches, micro), warmup, steps, device)
    shape = tuple(batches[0]["latent"].shape[1:])
    per_sample = train_step.per_sample[shape] / 1e12  # the hardware's: recompute included
    model_per_sample = train_step.model_per_sample[shape] / 1e12
    tflops = steps * micro * per_sample / seconds
    model_tflops = steps * micro * model_per_sample / seconds
    peak = flops.device_peak(device, job.scaling.peak_tflops)
    measured = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    result = {
        "family": family.name,
        "pretrained": job.model.pretrained,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "bucket": list(size),
        "micro_batch": micro,
        "gradient_checkpointing": checkpointing,
        "strategy": strategy.name,
        "experts": len(batches) if family.turns else None,  # in turn, one a step
        "compile": trained.compiled,
        "channels_last": job.train.channels_last
        and family.blocks.channels_last
        and device.type == "cuda",
        "attention": job.train.attention,
        "steps": steps,
        "warmup_steps": warmup,
        "load_s": round(load_s, 1),
        "warmup_s": round(warmup_s, 1),
        # compiled blocks: graphs dynamo made in the warm-up, and again while timed (0: none)
        "compiled_graphs": graphs if trained.compiled else None,
        "recompiles_timed": compiled_graphs() - graphs if trained.compiled else None,
        "samples_per_s": round(steps * micro / seconds, 3),
        "step_s": round(seconds / steps, 4),
        # counted: the model's (forward, backward) and the hardware's (with the recompute)
        "model_tflops_per_sample": float(f"{model_per_sample:.4g}"),
        "hardware_tflops_per_sample": float(f"{per_sample:.4g}"),
        "tflops_per_s": float(f"{model_tflops:.4g}"),
        "hardware_tflops_per_s": float(f"{tflops:.4g}"),
        "peak_tflops": peak,  # the device's dense bfloat16 peak; None: unknown
        "mfu": None if peak is None else round(flops.mfu(model_tflops, peak), 4),
        "hfu": None if peak is None else round(flops.mfu(tflops, peak), 4),
        "planned_bytes": planned_step,
        "measured_peak_bytes": measured,
        "planned_over_measured": round(planned_step / measured, 3)
        if measured and planned_step
        else None,
    }
    print(json.dumps(result) if as_json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    return result


def _stepper(train_step, batches: list[dict], micro: int):
    """``run(i)``: the training step itself on one micro-batch of random inputs, ``batches[i %
    len(batches)]``: a run of both experts (``model.expert = "both"``) gives each step to the
    next expert, so the timed steps (and the peak) hold both experts' steps and optimizer state."""

    def run(i: int) -> None:
        turn, samples = i % len(batches), [i * micro + j for j in range(micro)]
        train_step(RankSlice(0, i, 1, batches[turn], samples, [], turn=turn))

    return run


def _example(family, trained, loss_fn, shapes, micro: int, size, device, turn: int = 0) -> dict:
    """The family's example of what the feed hands the step (float32, as read from the cache;
    with ``lora.text_encoder`` the token ids instead), with each sample's draws as the feed
    makes them (for expert ``turn`` of a run of both: its noise levels)."""
    batch = family.example_batch(shapes, micro, size, device, torch.float32)
    if (text := trained.weights.text) is not None:
        batch = text.example(batch, device)
    generators = [torch.Generator().manual_seed(i) for i in range(micro)]
    drawn = loss_fn.draw_of(turn)(tuple(batch["latent"].shape), generators)
    return batch | {k: v.to(device) for k, v in drawn.items()}


def _timed(run, warmup: int, steps: int, device) -> tuple[float, float, int]:
    """``run(i)`` ``warmup`` times (kernels chosen, optimizer state made, compiled blocks
    compiled), then ``steps`` times on the clock: (warm-up seconds, timed seconds, graphs
    compiled before the timed steps); the peak memory counts the timed steps only."""
    started = time.perf_counter()
    for i in range(warmup):  # each timed apart and said: a row ended at its limit tells how far
        run(i)
        _sync(device)
        _say(f"warm-up step {i + 1} of {warmup}: {time.perf_counter() - started:.1f} s in")
    warmup_s = time.perf_counter() - started
    _say(f"timing {steps} steps")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    graphs = compiled_graphs()
    started = time.perf_counter()
    for i in range(steps):
        run(warmup + i)
    _sync(device)
    return warmup_s, time.perf_counter() - started, graphs


def _say(text: str) -> None:
    """A progress line on stderr (``bench gpu`` keeps a row's last 20: an ended row's tail)."""
    print(f"bench step: {text}", file=sys.stderr, flush=True)


def _built(job: JobConfig, denoiser, trained: list, load_s: float) -> str:
    """What was built: the family, preset or folder, its parameters and the trained ones."""
    total = sum(p.numel() for p in denoiser.parameters())
    ours = sum(p.numel() for p in trained)
    return (f"{job.model.family} ({job.model.pretrained}): {total / 1e6:,.1f} M parameters, "
            f"{ours / 1e6:,.2f} M trained, built in {load_s:.1f} s")  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def compiled_graphs() -> int:
    """How many graphs dynamo has made in this process so far (``train.compile``)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _planned(job: JobConfig, family, shapes, size, micro: int) -> int:
    """What plan says the bare step holds: no DDP buckets, no CUDA context (the allocator does
    not count it); sharded, plan's worker of a group of one."""
    checkpointing = job.train.gradient_checkpointing
    if Strategy.one_process(job.scaling.strategy).sharded:
        parts = trace.sharded_parts(job, family, shapes, size, micro, checkpointing)
        return fsdp.worker_bytes(job, parts, 1, 0)["peak_bytes"]
    planned = trace.trace_step(job, family, shapes, size, micro, checkpointing)
    return planned["weights_bytes"] + planned["ema_bytes"] + planned["step_peak_bytes"]
