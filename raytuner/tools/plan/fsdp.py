"""`raytuner plan` for ``scaling.strategy = "fsdp"``: a sharded training worker's bytes at a
number of workers, counted from the job's own denoiser (``trainable_model`` on the meta device)
and its traced step.

Every parameter is split by rows over the workers (FSDP2's ``Shard(0)``, padded to equal rows),
and so are its gradient, optimizer state and EMA; on top of that a worker holds, in the compute
dtype (bfloat16 on GPUs), the root unit's whole parameters for the step (FSDP2 keeps the root
gathered between forward and backward), the two largest units' own whole parameters (the one
running and the one prefetched; a unit's own: those of no unit nested in it), the largest
unit's whole gradients in the compute dtype and their float32 copy for the reduce-scatter, and
the step's activations. The activations are
traced: the job's step run once on meta tensors in the compute dtype with each parameter's
gradient dropped as soon as it is made (a sharded worker keeps only its rows of them, counted
above), so the trace holds what the forward saved, the recomputed block of gradient checkpointing
and backward's temporaries. Not counted: the communication buffers of the collectives beyond the
reduce-scatter input (NCCL's own, a few hundred MiB), and the optimizer step's temporaries.
"""

from __future__ import annotations

import math

import torch

from raytuner.observe import flops
from raytuner.placement import sharding
from raytuner.tools.plan.meta import offloaded, traced
from raytuner.train import optim
from raytuner.train.model import autocast_dtype

MOST_WORKERS = 64  # the largest group plan suggests
CUDA = torch.device("cuda")


def shard_numel(shape: tuple[int, ...], workers: int) -> int:
    """The elements of one worker's rows of a tensor of ``shape`` (FSDP2 pads the rows to a
    multiple of the workers; a 0-dim tensor is kept whole)."""
    if not shape:
        return 1
    return math.ceil(shape[0] / workers) * math.prod(shape[1:])


def _bytes(params, dtype=None) -> int:
    return sum(p.numel() * (dtype.itemsize if dtype else p.element_size()) for p in params)


def trace(job, family, trained, batch: dict, offload: bool) -> dict:
    """What sharding does not divide: the units' whole sizes and the traced activations of the
    job's step in the compute dtype. ``trained``: the job's ``trainable_model`` on meta, left
    as it was given."""
    denoiser, weights = trained.denoiser, trained.weights
    params = [(tuple(p.shape), p.dtype, p.requires_grad) for p in denoiser.parameters()]
    compute = autocast_dtype(job.train.mixed_precision, CUDA, trained.source.dtype)
    compute = compute or torch.float32
    blocks = sharding.owned(sharding.units(denoiser, family))
    inside = {id(p) for b in blocks for p in b}
    root = [p for p in denoiser.parameters() if id(p) not in inside]
    largest = sorted((_bytes(b, compute) for b in blocks), reverse=True)[:2]
    unit_grads = max((_bytes([p for p in b if p.requires_grad]) for b in blocks), default=0)
    master = [(p, p.data) for p in denoiser.parameters()]
    for p, data in master:  # the whole copies a unit computes with (meta: no bytes)
        p.data = data.to(compute)
    # a sharded worker keeps its rows only: drop each whole gradient
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        for p in weights.params
    ]
    loss_fn = family.loss(trained.source, job.objective.for_family(family))
    batch = {k: v.to(compute) if v.is_floating_point() else v for k, v in batch.items()}
    try:
        with traced() as live, offloaded(offload), flops.counted() as work:
            generators = [torch.Generator().manual_seed(j) for j in range(len(batch["latent"]))]
            loss_fn(denoiser, batch, generators).sum().backward()
    finally:  # the model as it was, for the next trace of the same setting
        for p, data in master:
            p.data = data
        for hook in hooks:
            hook.remove()
    trainable_dtype = next((d for _, d, trained in params if trained), torch.float32)
    return {
        "params": params,  # (shape, master dtype, trained) of each parameter
        "buffers_bytes": _bytes(denoiser.buffers()),
        "compute_dtype": str(compute).removeprefix("torch."),
        "root_bytes": _bytes(root, compute),
        "gathered_bytes": sum(largest),
        # the largest block's whole gradients: made in the compute dtype, reduced in float32
        "unit_gradient_bytes": unit_grads // trainable_dtype.itemsize * (compute.itemsize + 4),
        "activations_bytes": live.peak,
        "flops": work.get_total_flops(),  # forward and backward (the recompute included)
    }


def worker_bytes(job, parts: dict, workers: int, overhead: int) -> dict:
    """A sharded worker's bytes at ``workers`` workers, from ``trace``'s ``parts`` (its
    parameters' master dtypes: float32 trained, ``model.dtype`` frozen)."""
    rows = [(shard_numel(shape, workers), dtype, t) for shape, dtype, t in parts["params"]]
    trained = [torch.empty(n, dtype=dtype, device="meta") for n, dtype, t in rows if t]
    sharded = {
        "weights_bytes": sum(n * d.itemsize for n, d, _ in rows) + parts["buffers_bytes"],
        "gradients_bytes": _bytes(trained),
        "optimizer_bytes": optim.state_bytes(job.train.optimizer, trained),
        "ema_bytes": _bytes(trained) if job.train.ema_decay else 0,
    }
    whole = {k: parts[k] for k in ("root_bytes", "gathered_bytes", "unit_gradient_bytes")}
    peak = sum(sharded.values()) + sum(whole.values()) + parts["activations_bytes"] + overhead
    return (
        {"workers": workers}
        | sharded
        | whole
        | {
            "activations_bytes": parts["activations_bytes"],
            "overhead_bytes": overhead,
            "peak_bytes": peak,
        }
    )


def fewest_workers(job, parts: dict, gpu_memory: int, overhead: int, most=MOST_WORKERS):
    """The smallest number of sharded workers (up to ``most``) whose peak fits ``gpu_memory``,
    with its bytes; None when none does."""
    for n in range(1, most + 1):
        worker = worker_bytes(job, parts, n, overhead)
        if worker["peak_bytes"] <= gpu_memory:
            return worker
    return None
