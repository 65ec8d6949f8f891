"""Gradient checkpointing of the denoiser's blocks: torch's non-reentrant checkpoint, as
diffusers' own, with its recompute in backward marked for the FLOP counter
(``observe.flops.recomputing``). The mark is needed where the recompute runs ops with gradients
off, which the counter would otherwise take for backward: the forward of a custom
autograd.Function (``train.float8_matmul``'s ``_FrozenMatmul``)."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from raytuner.observe import flops


def checkpointed(module, *args, **kwargs):
    """``module(*args, **kwargs)`` checkpointed: what diffusers' ``ModelMixin.
    enable_gradient_checkpointing`` takes as ``gradient_checkpointing_func``."""
    return checkpoint(functools.partial(_run, module), *args, use_reentrant=False, **kwargs)


def _run(module, *args, **kwargs):
    """The forward; inside backward (checkpoint's recompute, in the thread that runs it)
    marked as recompute."""
    if torch._C._current_graph_task_id() == -1:
        return module(*args, **kwargs)
    with flops.recomputing():
        return module(*args, **kwargs)
