"""A run whose loss or gradients stop being finite ends at the step it happened, before any
checkpoint or export of what it trained after (``train/loop.py``): a NaN or an infinity in the
weights never becomes a checkpoint, a resume or a LoRA file.

Cheap on a GPU: once a step (not per micro-batch), a flag made on the device from the step's
loss and gradient norm (which ``clip_grad_norm_`` computes anyway), on a multi-worker run
made the same on every worker by one all-reduce of one number; the host reads it one step late,
from pinned memory once the device has finished that step (a CUDA event; the device is busy
with the next step meanwhile), and at once where the loop waits for the device anyway (a
metrics window, a checkpoint). So every worker stops at the same step, and no extra
synchronisation of host and device is added.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from raytuner.placement import sharding


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class FiniteGuard:
    """``add`` each step's loss sum and gradient norm; it returns what went wrong at the step
    before (or None); ``now`` at the step itself."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pending: tuple[int, torch.Tensor, object] | None = None  # (step, values, event)

    def add(self, step: int, loss: torch.Tensor, norm: torch.Tensor) -> str | None:
        """Queue the check of ``step``; the verdict of the step before."""
        norm = sharding.gather(norm)  # a sharded run's norm: a DTensor of every worker's rows
        loss = loss.detach().float().reshape(())
        values = torch.stack([loss, norm.detach().float().reshape(()).to(loss.device)])
        bad = (~torch.isfinite(values)).any().float().reshape(1)
        if _distributed():  # any worker's: every worker stops at the same step
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        packed, event = torch.cat([bad, values]), None
        if packed.device.type == "cuda":
            host = torch.empty(3, dtype=torch.float32, pin_memory=True)
            packed = host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        previous, self.pending = self.pending, (step, packed, event)
        return _verdict(previous)

    def now(self) -> str | None:
        """The verdict of the last step added (waits for the device to finish it)."""
        pending, self.pending = self.pending, None
        return _verdict(pending)

    def weights_finite(self, params: list[torch.Tensor]) -> bool:
        """Whether every trained weight is finite on every worker (each checks its rows): before
        a checkpoint, where an update that overflowed shows before any loss does."""
        finite = all(bool(torch.isfinite(sharding.local(p)).all()) for p in params)
        flag = torch.tensor([float(finite)], device=self.device)
        if _distributed():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


def _verdict(pending) -> str | None:
    if pending is None:
        return None
    step, values, event = pending
    if event is not None:
        event.synchronize()
    bad, loss, norm = values.tolist()
    if not bad:
        return None
    what = "the loss is" if not math.isfinite(loss) else "the gradients are"
    if math.isfinite(loss) and math.isfinite(norm):
        what = "another worker's loss is"
    return f"{what} not finite at step {step} (loss {loss:g}, gradient norm {norm:g})"
