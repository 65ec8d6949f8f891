"""One training step: the worker's loop and both benches (`bench train`'s bare loop, `bench
step`) call this very code, so a bench times what training runs and nothing else.

``forward_backward``: a rank's slice in micro-batches (gradient accumulation, DDP synchronised on
the last one only), under autocast, the checkpointed blocks' inputs in host memory when asked;
with ``lora.text_encoder`` each micro-batch's captions encoded by the trained text encoders
first (``encode``: ``text_lora.TextLora.encode``). ``TrainStep``: that, then the text encoders'
gradients averaged over the workers, gradient clipping, the optimizer, the learning-rate
schedule (warm-up included) and the EMA; the FLOPs of a step, counted once per latent shape (a
bucket) on its first step (``observe/flops.py``) and known for every later one (``flops``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Protocol

import torch

from raytuner import placement
from raytuner.families.mixture import ExpertMixture
from raytuner.observe import flops


class Slice(Protocol):
    """What a step takes: this rank's tensors and a noise seed per sample (``feed.RankSlice``)."""

    tensors: dict[str, torch.Tensor]
    seeds: list[int]


def forward_backward(
    model,
    loss_fn,
    batch: Slice,
    device,
    micro_batch_size: int,
    scale: float,
    amp=None,
    offload=False,
    encode=None,
) -> torch.Tensor:
    """Forward and backward over this rank's slice, in micro-batches (gradient accumulation,
    synchronised across ranks on the last one only), under autocast to ``amp`` when set, the
    checkpointed blocks' inputs in host memory when ``offload``; ``encode``: the micro-batch's
    token ids to the text tensors the loss reads (trained text encoders), inside autocast.
    Returns the slice's loss sum."""
    tensors = placement.batch(batch.tensors, device)
    torch.manual_seed(batch.seeds[0])  # dropout: a redone step draws the same masks
    n = len(batch.seeds)
    size = micro_batch_size or n
    total = torch.zeros((), device=device)
    for a in range(0, n, size):
        last = a + size >= n
        no_sync = getattr(model, "no_sync", None)
        sync = contextlib.nullcontext() if last or no_sync is None else no_sync()
        # the samples' own generators, for a loss whose batch lacks the feed's draws
        generators = [torch.Generator().manual_seed(s) for s in batch.seeds[a : a + size]]
        with sync, placement.activations(offload, device):
            with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
                micro = {k: v[a : a + size] for k, v in tensors.items()}
                if encode is not None:
                    micro = encode(micro)
                per_sample = loss_fn(model, micro, generators)
                if "loss_weight" in micro:  # regularization images: train.prior_loss_weight
                    per_sample = per_sample * micro["loss_weight"]
            # DDP averages gradients over ranks: scaled, the update is the global batch's mean
            (per_sample.sum() * scale).backward()
        total += per_sample.detach().sum()
    return total


@dataclass(kw_only=True)
class TrainStep:
    """``step(batch) -> loss sum``: one optimizer step of the model on this rank's slice."""

    model: torch.nn.Module  # the denoiser, DDP-wrapped on a multi-worker run
    loss_fn: object  # the family's Loss
    weights: object  # train.weights.Weights: the trained parameters and their EMA
    opt: torch.optim.Optimizer
    sched: object  # the learning-rate schedule, stepped after each optimizer step
    device: torch.device
    micro_batch_size: int  # train.micro_batch_size
    max_grad_norm: float  # train.max_grad_norm; 0: no clipping
    scale: float  # world / global batch size: the update is the global batch's mean
    amp: torch.dtype | None = None  # autocast dtype
    offload: bool = False  # memory.activation_offload
    text: object = None  # train.text_lora.TextLora (lora.text_encoder), else None
    # model.expert = "both": the experts (mixture.ExpertMixture), each step's own activated
    mixture: object = None
    # FLOPs of one sample, per latent shape: the hardware's (forward, backward and the forward
    # gradient checkpointing recomputes) and the model's (without the recompute)
    per_sample: dict = field(default_factory=dict)
    model_per_sample: dict = field(default_factory=dict)
    flops: float = 0.0  # the hardware's, of the last step (this rank's slice)
    model_flops: float = 0.0  # the model's, of the last step
    grad_norm: torch.Tensor | None = None  # of the last step, before clipping (on the device)

    def __call__(self, batch: Slice) -> torch.Tensor:
        if self.mixture is not None:  # the step's expert (the feed drew its noise levels)
            self.mixture.activate(getattr(batch, "turn", 0))
        shape = tuple(batch.tensors["latent"].shape[1:])
        counting = shape not in self.per_sample
        with flops.counted() if counting else contextlib.nullcontext() as counter:
            loss = forward_backward(
                self.model, self.loss_fn, batch, self.device, self.micro_batch_size,
                self.scale, self.amp, self.offload, self.text and self.text.encode,
            )  # fmt: skip
        if counting:
            self.per_sample[shape] = counter.get_total_flops() / len(batch.seeds)
            self.model_per_sample[shape] = counter.model / len(batch.seeds)
        self.flops = self.per_sample[shape] * len(batch.seeds)
        self.model_flops = self.model_per_sample[shape] * len(batch.seeds)
        if self.text is not None:  # not DDP-wrapped: averaged over the workers here
            self.text.average_gradients()
        # 0: no clipping (what sd-scripts and SimpleTuner read in 0); the norm is kept either way
        limit = self.max_grad_norm or float("inf")
        self.grad_norm = torch.nn.utils.clip_grad_norm_(self.weights.params, limit)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.weights.step()
        return loss


def train_step(trained, model, loss_fn, opt, sched, train, memory, device, world: int = 1):
    """The step of a run: ``trained`` from ``model.trainable_model``, ``model`` the denoiser
    as the step calls it (DDP-wrapped or not), ``train``/``memory`` the job's sections."""
    return TrainStep(
        model=model,
        loss_fn=loss_fn,
        weights=trained.weights,
        opt=opt,
        sched=sched,
        device=device,
        micro_batch_size=train.micro_batch_size,
        max_grad_norm=train.max_grad_norm,
        scale=world / train.global_batch_size,
        amp=trained.amp,
        offload=memory.activation_offload,
        text=trained.weights.text,
        mixture=trained.denoiser if isinstance(trained.denoiser, ExpertMixture) else None,
    )
