"""The traces `raytuner plan` is made of: one training worker's step, an encoder actor's and the
validation actor's work, each run once on the meta device and counted (``meta.py``: the
bytes; ``observe/flops.py``: the FLOPs), and the sharded worker's parts (``fsdp.py``).
``measure.py`` puts them together; ``suggest.py`` traces the settings it suggests.

A trace on meta tensors costs the same at any size (every op runs torch's Python meta kernel:
an SDXL step is about 50 000 of them), so one plan traces each setting once (``Traces``): a
step asked for again is the one already traced, one meta model serves every micro-batch of the
same setting (a trace leaves it as it found it), and AdamW's step, whose bytes depend on the
trained parameters alone, is traced once per set of parameters."""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

import torch

from raytuner import placement
from raytuner.config import JobConfig
from raytuner.families import parts
from raytuner.lora import kinds
from raytuner.observe import flops
from raytuner.placement.strategy import REPLICATED
from raytuner.preprocess.buckets import make_buckets
from raytuner.tools.plan import fsdp
from raytuner.tools.plan.meta import bytes_by_dtype, offloaded, traced
from raytuner.tools.plan.progress import Progress
from raytuner.tools.plan.vae import encode_peak
from raytuner.train import optim, recompute
from raytuner.train.model import Trainable, trainable_model

GiB = 2**30
OVERHEAD = GiB  # CUDA context + library workspaces, per process
# of --gpu-memory kept free: the caching allocator's fragmentation (it reserves more than it
# hands out) and what the driver keeps of a card; plan's peaks came within 0.91-1.01 of the
# measured max_memory_allocated on an H100 (docs/figures.md)
MARGIN = 0.05
META = torch.device("meta")


def largest_bucket(job: JobConfig, family) -> tuple[int, int]:
    pre = job.preprocess
    resolution = pre.resolution or family.geometry.default_resolution
    bucket_step = pre.bucket_step or family.geometry.pixel_multiple
    buckets = make_buckets(resolution, bucket_step, pre.min_aspect, pre.max_aspect)
    return max(buckets, key=lambda b: (b[0] * b[1], b[0]))


def largest_frames(job: JobConfig, family) -> int:
    """The frames of the job's longest sample: a video family's largest frame bucket
    (``data.frames`` and its sources'), what its VAE and denoiser must hold; 1 for images."""
    if not family.geometry.frame_multiple:
        return 1
    return max(n for source in job.data.all_sources() for n in source.frames)


def _source(job: JobConfig) -> parts.Source:
    """The job's model on a GPU; a released repo the package knows is planned from its shipped
    architecture (the ``random`` preset), with no download."""
    m = job.model
    source = parts.model_source(m, "cuda")  # a single file: described by its config repo
    pretrained = parts.released(m.family, source.repo) or m.pretrained
    return dataclasses.replace(source, pretrained=pretrained)


def _block_bytes(denoiser, family) -> list[int]:
    """Each swappable block's frozen weight bytes (what block swap streams)."""
    return [
        sum(p.numel() * p.element_size() for p in b.parameters() if not p.requires_grad)
        for b in placement.blocks(denoiser, family)
    ]


def block_sizes(worker: dict) -> list[int]:
    """How many of the worker's ``block_bytes`` each model it runs has (an expert of a mixture
    trained in turn: one each), in order."""
    return worker.get("block_groups") or [len(worker["block_bytes"])]


def swapped_peak(worker: dict, n: int, ring: int) -> int:
    """The worker's peak with the last ``n`` blocks (of each expert of a mixture) streamed
    through a ring of ``ring``."""
    streamed = [worker["block_bytes"][i] for i in placement.last_of_each(block_sizes(worker), n)]
    resident = sorted(streamed)[-ring:] if streamed else []
    return worker["peak_bytes_unswapped"] - sum(streamed) + sum(resident)


def _planned_model(job: JobConfig, family) -> Trainable:
    """The worker's own setup (``trainable_model``) of the job's denoiser on the meta device,
    from the model a GPU runs (``_source``)."""
    model = (job.model, job.train, job.lora, family)
    return trainable_model(*model, META, job.memory, source=_source(job))


def _setting(job: JobConfig, checkpointing: bool) -> JobConfig:
    """``job`` with gradient checkpointing as given (without it: no block swap, no activation
    offload, which need it), no micro-batch size (a trace is asked for at a micro-batch of
    its own) and one worker (a trace is one worker's step, whatever the group and strategy:
    ``fsdp.worker_bytes`` divides it by the workers): one per meta model."""
    train = dataclasses.replace(job.train, gradient_checkpointing=checkpointing, micro_batch_size=0)
    memory = job.memory
    if not checkpointing:
        memory = dataclasses.replace(memory, blocks_to_swap=0, activation_offload=False)
    scaling = dataclasses.replace(
        job.scaling, workers=1, strategy=REPLICATED.name, worker_memory=""
    )
    return dataclasses.replace(job, train=train, memory=memory, scaling=scaling)


class Traces:
    """The traces of one plan at ``size`` with the cache's ``shapes``, each made once: a training
    worker's step (``step``) and a sharded worker's parts (``sharded``), on the meta models of
    the settings asked for (the last ``MODELS`` kept); a line on ``progress`` for each."""

    MODELS = 3

    def __init__(self, family, shapes: dict, size, progress: Progress | None = None) -> None:
        self.family, self.shapes, self.size = family, shapes, size
        self.progress = progress or Progress(quiet=True)
        self._models: dict[str, Trainable] = {}
        self._made: dict[tuple, dict] = {}
        self._adamw_steps: dict = {}

    def step(self, job: JobConfig, micro: int, checkpointing: bool) -> dict:
        """One training worker's step at ``micro`` samples a forward."""
        job = _setting(job, checkpointing)
        key = ("step", repr(job), micro)
        if self._reuse(key, "the training worker", job, micro):
            trained = self._model(job)
            batch = self._batch(trained, micro)
            if (text := trained.weights.text) is not None:  # the feed's token ids
                batch = text.example(batch, META)
            offload = job.memory.activation_offload and checkpointing
            counted = _step_trace(job, self.family, trained, batch, offload, self._adamw_steps)
            self._made[key] = _worker(job, self.family, trained, micro, counted)
        return copy.deepcopy(self._made[key])

    def sharded(self, job: JobConfig, micro: int, checkpointing: bool) -> dict:
        """``fsdp.trace`` of the job's step (what sharding does not divide)."""
        job = _setting(job, checkpointing)
        key = ("sharded", repr(job), micro)
        if self._reuse(key, "the sharded (fsdp) worker", job, micro):
            trained = self._model(job)
            batch = self._batch(trained, micro)
            offload = job.memory.activation_offload and checkpointing
            self._made[key] = fsdp.trace(job, self.family, trained, batch, offload)
        return copy.deepcopy(self._made[key])

    def _reuse(self, key: tuple, who: str, job: JobConfig, micro: int) -> bool:
        """Whether ``key`` is still to trace (and say so)."""
        if key in self._made:
            self.progress.reused()
            return False
        (w, h), t = self.size, job.train
        checkpointing = "checkpointing" if t.gradient_checkpointing else "no checkpointing"
        self.progress.tracing(
            f"{who} at {w}x{h}, {micro} a forward, {checkpointing}, {t.mode}, "
            f"model.dtype {job.model.dtype}"
        )
        return True

    def _model(self, job: JobConfig) -> Trainable:
        """The meta model of ``job`` (what ``trainable_model`` takes), built once; one model
        serves both ways of gradient checkpointing (switched here) unless text encoders are
        trained, whose checkpointing is set as they are built."""
        checkpointing, switched = job.train.gradient_checkpointing, not job.lora.text_encoder
        train = dataclasses.replace(job.train, gradient_checkpointing=False)
        # on meta, nothing is streamed or offloaded: the model is the same with or without
        memory = dataclasses.replace(job.memory, blocks_to_swap=0, activation_offload=False)
        key = repr((job.model, train if switched else job.train, job.lora, memory))
        if key not in self._models:
            if len(self._models) >= self.MODELS:
                del self._models[next(iter(self._models))]
            self._models[key] = _planned_model(job, self.family)
        trained = self._models[key]
        if switched and checkpointing:
            trained.denoiser.enable_gradient_checkpointing(recompute.checkpointed)
        elif switched:
            trained.denoiser.disable_gradient_checkpointing()
        return trained

    def _batch(self, trained: Trainable, micro: int) -> dict:
        dtype = trained.source.dtype
        return self.family.example_batch(self.shapes, micro, self.size, META, dtype)


def _step_trace(job: JobConfig, family, trained: Trainable, batch: dict, offload: bool,
                adamw_steps: dict) -> dict:  # fmt: skip
    """The step itself, run once on meta tensors and counted: the family's loss of ``trained``
    on ``batch`` (with ``lora.text_encoder``, its token ids encoded by the trained text encoders
    first), backward (``offload``: activation offload) and an AdamW step. Returns the peak
    bytes of forward + backward, of the whole step, and of AdamW's state (made by the step), and
    the FLOPs of forward and backward (the recompute of gradient checkpointing included).
    ``adamw_steps``: AdamW's step by trained parameters (``_adamw_step``), filled here."""
    params = trained.weights.params
    key = (job.train.learning_rate, tuple((tuple(p.shape), p.dtype) for p in params))
    opt = None if key in adamw_steps else torch.optim.AdamW(params, lr=key[0], foreach=False)
    loss_fn = family.loss(trained.source, job.objective.for_family(family))
    with traced() as live, offloaded(offload), flops.counted() as work:
        generators = [torch.Generator().manual_seed(j) for j in range(len(batch["latent"]))]
        if (text := trained.weights.text) is not None:  # lora.text_encoder: captions encoded
            batch = text.encode(batch)
        loss_fn(trained.denoiser, batch, generators).sum().backward()
        backward_peak, step_flops, at_step = live.peak, work.get_total_flops(), live.now
        if opt is not None:
            adamw_steps[key] = _adamw_step(opt, live)
        rise, adamw = adamw_steps[key]
        for p in params:  # the model is left as built, for the next trace
            p.grad = None
    peak = max(backward_peak, at_step + rise)
    return {"backward_peak": backward_peak, "peak": peak, "adamw": adamw, "flops": step_flops}


def _adamw_step(opt, live) -> tuple[int, int]:
    """AdamW's step on the gradients ``live`` holds: the most bytes it adds to what is live (its
    state, made at the first step, and each parameter's temporaries) and its state's bytes.
    Both depend on the trained parameters alone, not on what else is live."""
    before, live.peak = live.now, live.now
    opt.step()
    rise = live.peak - before
    adamw = sum(
        v.numel() * v.element_size()
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    return rise, adamw


def trace_step(job: JobConfig, family, shapes: dict, size, micro: int, checkpointing: bool) -> dict:
    """One training worker's step at ``micro`` samples of ``shapes``, traced on meta."""
    return Traces(family, shapes, size).step(job, micro, checkpointing)


def _worker(job: JobConfig, family, trained: Trainable, micro: int, counted: dict) -> dict:
    """A training worker's figures from its model and its traced step (``_step_trace``)."""
    t, memory = job.train, job.memory
    denoiser, weights = trained.denoiser, trained.weights
    text = weights.text.modules if weights.text is not None else []
    backward_peak = counted["backward_peak"]
    trained_bytes = sum(p.numel() * p.element_size() for p in weights.params)
    state = optim.state_bytes(t.optimizer, weights.params)
    by_dtype = bytes_by_dtype(denoiser, *text)  # the text encoders' when trained
    ema = trained_bytes if t.ema_decay else 0
    ddp_buckets = trained_bytes  # DDP's flat gradient buckets beside the .grad tensors
    # every later step runs the same forward and backward with the optimizer state alive
    step_peak = max(backward_peak + state, counted["peak"] - counted["adamw"] + state)
    unswapped = sum(by_dtype.values()) + ema + ddp_buckets + step_peak + OVERHEAD
    result = {"peak_bytes_unswapped": unswapped, "block_bytes": _block_bytes(denoiser, family)}
    groups = [len(group) for group in placement.block_groups(denoiser, family)]
    if len(groups) > 1:  # experts trained in turn: each streams its last blocks
        result["block_groups"] = groups
    n = memory.blocks_to_swap if t.gradient_checkpointing and t.mode == "lora" else 0
    peak = swapped_peak(result, n, memory.swap_ring)
    return result | {
        "tflops_per_sample": counted["flops"] / micro / 1e12,
        "blocks_to_swap": n,
        "resident_weights_bytes": sum(by_dtype.values()) - (unswapped - peak),
        "denoiser_params": sum(p.numel() for p in denoiser.parameters()) - _lora(denoiser),
        "trainable_params": sum(p.numel() for p in weights.params),
        # lora.text_encoder: the text encoders' frozen parameters and their LoRA's
        "text_encoder_params": sum(_frozen(m) for m in text),
        "text_encoder_trained_params": sum(_lora(m) for m in text),
        "weights_bytes": sum(by_dtype.values()),
        "weights_by_dtype": by_dtype,
        "gradients_bytes": trained_bytes,
        "optimizer_bytes": state,
        "ema_bytes": ema,
        "ddp_buckets_bytes": ddp_buckets,
        "step_peak_bytes": step_peak,
        "backward_peak_bytes": backward_peak,  # forward + backward, before the optimizer
        "activations_bytes": max(0, step_peak - trained_bytes - state),
        "overhead_bytes": OVERHEAD,
        "peak_bytes": peak,
    }


def _lora(module) -> int:
    """A module's adapter parameters (any ``lora.kind``)."""
    return sum(p.numel() for n, p in module.named_parameters() if kinds.is_adapter(n))


def _frozen(module) -> int:
    return sum(p.numel() for n, p in module.named_parameters() if not kinds.is_adapter(n))


def trace_encoders(
    job: JobConfig, family, size, progress: Progress | None = None, frames: int = 0
):  # fmt: skip
    """An encoder actor (VAE encode of ``preprocess.batch_size`` images at ``size``, or clip
    samples of ``frames`` frames (0: the largest frame bucket of a video family), then the text
    encoders on as many captions) and the tensor shapes it produces per image (sample)."""
    pre = job.preprocess
    source = _source(job)
    n, (w, h), frames = pre.batch_size, size, frames or largest_frames(job, family)
    what = f"{n} clips of {frames} frames" if frames > 1 else f"{n} images"
    (progress or Progress(quiet=True)).tracing(f"the encoder actor: {what} at {w}x{h}")
    encode_image = family.image_encoder(source, "meta", weights=False)
    encode_text = family.text_encoder(source, "meta", weights=False)
    clip = (frames,) if frames > 1 else ()  # a video family's clips [n, 3, F, h, w]
    image_peak, latent = encode_peak(family, source, encode_image, (3, *clip, h, w), n)
    with traced() as text_live:
        text = encode_text(["a caption of average length for a photograph"] * n)
    shapes = {"latent": tuple(latent.shape[1:])} | {k: tuple(v.shape[1:]) for k, v in text.items()}
    # the modules its text encoder holds (LTX-2's: Gemma and the connectors' first layer)
    held = sum(bytes_by_dtype(*encode_text.encoders).values())
    weights = _part_bytes(job, family, ("vae",)) + held
    peak = weights + max(image_peak, text_live.peak) + OVERHEAD
    return {"weights_bytes": weights, "peak_bytes": peak, "batch_size": n}, shapes


def _part_bytes(job: JobConfig, family, names: tuple[str, ...]) -> int:
    source = _source(job)
    return sum(_one_part_bytes(family, source, name) for name in names)


@functools.lru_cache(maxsize=64)
def _one_part_bytes(family, source: parts.Source, name: str) -> int:
    """The bytes of a part's weights (built once on meta)."""
    cls = family.parts.classes[name]
    module = parts.load(family, source, name, cls, device="meta", weights=False)
    return sum(bytes_by_dtype(module).values())


def trace_validation(job: JobConfig, family, shapes: dict, size, progress=None) -> dict:
    """The validation actor: the whole pipeline's weights, and the larger of a denoiser forward
    (batch 2: classifier-free guidance) and the VAE decode of one image."""
    source = _source(job)
    w, h = size
    (progress or Progress(quiet=True)).tracing(f"the validation actor at {w}x{h}")
    denoiser = family.denoiser(source, "meta", weights=False).requires_grad_(False)
    loss_fn = family.loss(source, job.objective.for_family(family))
    batch = family.example_batch(shapes, 2, size, META, source.dtype)
    with torch.no_grad(), traced() as forward:
        loss_fn(denoiser, batch, [torch.Generator().manual_seed(i) for i in range(2)])
    cls = family.parts.classes["vae"]
    vae = parts.load(family, source, "vae", cls, device="meta", weights=False)
    latent = torch.zeros(1, *shapes["latent"], device="meta", dtype=source.dtype)
    with torch.no_grad(), traced() as decode:
        vae.decode(family.vae_latent(latent))
    weights = _part_bytes(job, family, tuple(family.parts.classes))
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


def sharded_parts(job: JobConfig, family, shapes, size, micro: int, checkpointing: bool):
    """``fsdp.trace`` of the job's step (what sharding does not divide)."""
    return Traces(family, shapes, size).sharded(job, micro, checkpointing)
