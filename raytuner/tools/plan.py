"""`raytuner plan`: the GPU memory a job needs, per training worker, encoder actor and validation
actor, measured by running the real step on the meta device (nothing is allocated).

The training worker's figure is one real training step of the job (the family's loss, the peft
adapter, AdamW, gradient checkpointing when set), run once on meta tensors; a later step is the
same with the optimizer state alive: its peak is the weights (by dtype) plus the peak of every
tensor the step keeps alive at once (activations saved for backward, gradients, optimizer state,
temporaries).
Attention is traced as the fused kernel a GPU runs (output + log-sum-exp saved, never the score
matrix). Not counted: the CUDA context and cuBLAS/cuDNN workspaces (about 0.5-1 GiB a process,
see ``OVERHEAD``), allocator fragmentation, DDP's gradient buckets (another copy of the trainable
gradients; counted below) and the pinned host batches of the feed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from raytuner import placement
from raytuner.config import JobConfig
from raytuner.families import parts
from raytuner.preprocess.buckets import make_buckets
from raytuner.train import optim
from raytuner.train.weights import Weights

GiB = 2**30
OVERHEAD = GiB  # CUDA context + library workspaces, per process
CONDITIONING = ("original_size", "crop_top_left", "target_size")


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors created while active (each storage counted once,
    until it is freed)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view of an input (a weight's transpose, a reshape) holds no new memory
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = storage._cdata
        if key in self._sizes:
            return
        self._sizes[key] = storage.nbytes()
        self.now += self._sizes[key]
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self._sizes.pop(key, 0)


def _fused_attention(*args, **kwargs):
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
    given = dict(zip(names, args, strict=False)) | kwargs
    q, k, v = given.pop("query"), given.pop("key"), given.pop("value")
    return _fused(q, k, v, **given)


def _fused(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
    if kw.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(q.dtype)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return op(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


@contextlib.contextmanager
def traced() -> Iterator[LiveBytes]:
    """Count the bytes of what runs inside, with ``scaled_dot_product_attention`` traced as a
    fused kernel: on meta tensors torch would otherwise trace the math fallback, which keeps the
    whole score matrix for backward. (Patched on the module, not through a torch-function mode:
    gradient checkpointing recomputes the forward in backward, outside any such mode.)"""
    live, original = LiveBytes(), F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _fused_attention
    try:
        with live:
            yield live
    finally:
        F.scaled_dot_product_attention = original


def _bytes_by_dtype(module) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in list(module.parameters()) + list(module.buffers()):
        name = str(t.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + t.numel() * t.element_size()
    return out


def largest_bucket(job: JobConfig, family) -> tuple[int, int]:
    pre = job.preprocess
    resolution = pre.resolution or family.default_resolution
    step = pre.bucket_step or family.pixel_multiple
    buckets = make_buckets(resolution, step, pre.min_aspect, pre.max_aspect)
    return max(buckets, key=lambda b: (b[0] * b[1], b[0]))


def _meta_batch(shapes: dict, n: int, dtype: torch.dtype, size: tuple[int, int]) -> dict:
    batch = {k: torch.zeros(n, *s, device="meta", dtype=dtype) for k, s in shapes.items()}
    if "prompt_attention_mask" in batch:
        batch["prompt_attention_mask"] = torch.ones_like(batch["prompt_attention_mask"])
    for key in CONDITIONING:
        batch[key] = torch.full((n, 2), float(max(size)), device="meta", dtype=dtype)
    return batch


def _source(job: JobConfig, full: bool = False) -> parts.Source:
    """The job's model on a GPU; a released repo the package knows is planned from its shipped
    architecture (the ``random`` preset), with no download."""
    m = job.model
    dtype = parts.resolve_dtype(m.dtype, "cuda")
    if full:
        dtype = parts.DTYPES[m.trainable_dtype]
    source = parts.model_source(m, "cuda")  # a single file: described by its config repo
    pretrained = parts.released(m.family, source.repo) or m.pretrained
    return dataclasses.replace(source, pretrained=pretrained, dtype=dtype)


@contextlib.contextmanager
def _offloaded(on: bool) -> Iterator[None]:
    """``memory.activation_offload`` in a trace: a tensor saved outside the checkpointed blocks
    leaves the device until backward unpacks it (a new device tensor, counted from then)."""
    if not on:
        yield
        return

    def pack(t):
        return (t.shape, t.dtype, t.device)

    def unpack(saved):
        return torch.empty(saved[0], dtype=saved[1], device=saved[2])

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _block_bytes(denoiser, family) -> list[int]:
    """Each swappable block's frozen weight bytes (what block swap streams)."""
    return [
        sum(p.numel() * p.element_size() for p in b.parameters() if not p.requires_grad)
        for b in placement.blocks(denoiser, family)
    ]


def swapped_peak(worker: dict, n: int, ring: int) -> int:
    """The worker's peak with the last ``n`` blocks streamed through a ring of ``ring``."""
    streamed = worker["block_bytes"][len(worker["block_bytes"]) - n :] if n else []
    resident = sorted(streamed)[-ring:] if streamed else []
    return worker["peak_bytes_unswapped"] - sum(streamed) + sum(resident)


def trace_step(job: JobConfig, family, shapes: dict, size, micro: int, checkpointing: bool) -> dict:
    """One training worker's step at ``micro`` samples of ``shapes``, traced on meta."""
    t, memory = job.train, job.memory
    source = _source(job, t.mode == "full")
    denoiser = family.denoiser(source, "meta", weights=False).train()
    if job.model.dtype == parts.FLOAT8:
        parts.float8_storage(denoiser.requires_grad_(False))
    if checkpointing:
        denoiser.enable_gradient_checkpointing()
    trainable = parts.DTYPES[job.model.trainable_dtype]
    weights = Weights(
        denoiser,
        mode=t.mode,
        lora=job.lora,
        targets=family.lora_targets,
        ema_decay=t.ema_decay,
        dtype=trainable,
    )
    opt = torch.optim.AdamW(weights.params, lr=t.learning_rate, foreach=False)
    loss_fn = family.loss(source, job.objective.for_family(family))
    # the step computes in the denoiser's weight dtype (bf16 by default on GPUs); a float32
    # denoiser is traced in float32 even where bf16 autocast would halve its activations
    batch = _meta_batch(shapes, micro, source.dtype, size)
    with traced() as live, _offloaded(memory.activation_offload and checkpointing):
        generators = [torch.Generator().manual_seed(j) for j in range(micro)]
        loss_fn(denoiser, batch, generators).sum().backward()
        backward_peak = live.peak
        opt.step()
        opt.zero_grad(set_to_none=True)
    trained = sum(p.numel() * p.element_size() for p in weights.params)
    adamw = sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    state = optim.state_bytes(t.optimizer, weights.params)
    by_dtype = _bytes_by_dtype(denoiser)
    ema = trained if t.ema_decay else 0
    ddp_buckets = trained  # DDP's flat gradient buckets beside the .grad tensors
    # every later step runs the same forward and backward with the optimizer state alive
    step_peak = max(backward_peak + state, live.peak - adamw + state)
    unswapped = sum(by_dtype.values()) + ema + ddp_buckets + step_peak + OVERHEAD
    result = {"peak_bytes_unswapped": unswapped, "block_bytes": _block_bytes(denoiser, family)}
    n = memory.blocks_to_swap if checkpointing and t.mode == "lora" else 0
    peak = swapped_peak(result, n, memory.swap_ring)
    return result | {
        "blocks_to_swap": n,
        "resident_weights_bytes": sum(by_dtype.values()) - (unswapped - peak),
        "denoiser_params": sum(p.numel() for p in denoiser.parameters()) - _lora(weights),
        "trainable_params": sum(p.numel() for p in weights.params),
        "weights_bytes": sum(by_dtype.values()),
        "weights_by_dtype": by_dtype,
        "gradients_bytes": trained,
        "optimizer_bytes": state,
        "ema_bytes": ema,
        "ddp_buckets_bytes": ddp_buckets,
        "step_peak_bytes": step_peak,
        "backward_peak_bytes": backward_peak,  # forward + backward, before the optimizer
        "activations_bytes": max(0, step_peak - trained - state),
        "overhead_bytes": OVERHEAD,
        "peak_bytes": peak,
    }


def _lora(weights: Weights) -> int:
    return sum(p.numel() for p in weights.params) if weights.mode == "lora" else 0


def trace_encoders(job: JobConfig, family, size) -> tuple[dict, dict]:
    """An encoder actor (VAE encode of ``preprocess.batch_size`` images at ``size``, then the
    text encoders on as many captions) and the tensor shapes it produces per image."""
    pre = job.preprocess
    source = _source(job)
    n, (w, h) = pre.batch_size, size
    encode_image = family.image_encoder(source, "meta", weights=False)
    encode_text = family.text_encoder(source, "meta", weights=False)
    pixels = torch.zeros(n, 3, h, w, device="meta")
    with traced() as image_live:
        latent = encode_image(pixels)[0]
    with traced() as text_live:
        text = encode_text(["a caption of average length for a photograph"] * n)
    shapes = {"latent": tuple(latent.shape[1:])} | {k: tuple(v.shape[1:]) for k, v in text.items()}
    weights = _part_bytes(job, family, ("vae",)) + _text_bytes(job, family)
    peak = weights + max(image_live.peak, text_live.peak) + OVERHEAD
    return {"weights_bytes": weights, "peak_bytes": peak, "batch_size": n}, shapes


def _text_bytes(job: JobConfig, family) -> int:
    names = [p for p in family.part_classes() if p.startswith("text_")]
    return _part_bytes(job, family, tuple(names))


def _part_bytes(job: JobConfig, family, names: tuple[str, ...]) -> int:
    source = _source(job)
    total = 0
    for name in names:
        cls = family.part_classes()[name]
        module = parts.load(family, source, name, cls, device="meta", weights=False)
        total += sum(_bytes_by_dtype(module).values())
    return total


def trace_validation(job: JobConfig, family, shapes: dict, size) -> dict:
    """The validation actor: the whole pipeline's weights, and the larger of a denoiser forward
    (batch 2: classifier-free guidance) and the VAE decode of one image."""
    source = _source(job)
    denoiser = family.denoiser(source, "meta", weights=False).requires_grad_(False)
    loss_fn = family.loss(source, job.objective.for_family(family))
    batch = _meta_batch(shapes, 2, source.dtype, size)
    with torch.no_grad(), traced() as forward:
        loss_fn(denoiser, batch, [torch.Generator().manual_seed(i) for i in range(2)])
    cls = family.part_classes()["vae"]
    vae = parts.load(family, source, "vae", cls, device="meta", weights=False)
    latent = torch.zeros(1, *shapes["latent"], device="meta", dtype=source.dtype)
    with torch.no_grad(), traced() as decode:
        vae.decode(latent)
    weights = _part_bytes(job, family, tuple(family.part_classes()))
    if n := job.memory.blocks_to_swap:  # the denoiser streams as in training
        per_block = _block_bytes(denoiser, family)
        streamed = per_block[len(per_block) - n :]
        weights -= sum(streamed) - sum(sorted(streamed)[-job.memory.swap_ring :])
    peak = weights + max(forward.peak, decode.peak) + OVERHEAD
    return {"weights_bytes": weights, "peak_bytes": peak}


def micro_batch(job: JobConfig) -> int:
    """The most samples one forward takes: ``train.micro_batch_size``, else the largest rank
    slice (the global batch over the fewest workers an elastic run may have)."""
    fewest = (
        job.scaling.workers[0] if isinstance(job.scaling.workers, list) else job.scaling.workers
    )
    return job.train.micro_batch_size or math.ceil(job.train.global_batch_size / fewest)


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
    if not family.swap_blocks or job.train.mode != "lora":
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


def plan(job: JobConfig, family, gpu_memory: int, compare: bool = True) -> dict:
    """Everything ``raytuner plan`` prints (sizes in bytes); ``compare``: also the worker's
    peak with gradient checkpointing switched the other way."""
    size = largest_bucket(job, family)
    encoder, shapes = trace_encoders(job, family, size)
    micro = micro_batch(job)
    checkpointing = job.train.gradient_checkpointing
    worker = trace_step(job, family, shapes, size, micro, checkpointing)
    if compare:
        other = trace_step(job, family, shapes, size, micro, not checkpointing)
        key = "without" if checkpointing else "with"
        worker[f"peak_bytes_{key}_checkpointing"] = other["peak_bytes"]
    fits = worker["peak_bytes"] <= gpu_memory
    suggestions = []
    if not fits:
        for text, changed in _remedies(job):
            micro_changed, checkpointing_changed = (
                micro_batch(changed),
                changed.train.gradient_checkpointing,
            )
            peak = trace_step(changed, family, shapes, size, micro_changed, checkpointing_changed)[
                "peak_bytes"
            ]
            suggestions.append({"set": text, "peak_bytes": peak, "fits": peak <= gpu_memory})
        suggestions += _swap_suggestions(job, family, shapes, size, gpu_memory)
    return {
        "family": family.name,
        "pretrained": job.model.pretrained,
        "bucket": list(size),
        "micro_batch": micro,
        "gradient_checkpointing": checkpointing,
        "gpu_memory_bytes": gpu_memory,
        "denoiser_params": worker["denoiser_params"],
        "trainable_params": worker["trainable_params"],
        "weights_bytes": worker["weights_bytes"],
        "blocks_to_swap": worker["blocks_to_swap"],
        "peak_bytes": worker["peak_bytes"],
        "fits": fits,
        "worker": worker,
        "encoder_actor": encoder | {"fits": encoder["peak_bytes"] <= gpu_memory},
        "validation_actor": (validation := trace_validation(job, family, shapes, size))
        | {"fits": validation["peak_bytes"] <= gpu_memory},
        "cache_shapes": {k: list(v) for k, v in shapes.items()},
        "suggestions": suggestions,
    }
