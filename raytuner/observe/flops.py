"""The work a step does and how much of the GPU it used: FLOPs counted, not estimated, and MFU
against the device's dense bfloat16 peak.

``counted()`` counts with torch's FLOP formulas (``torch.utils.flop_counter``: matmuls,
convolutions, attention, forward and backward, and the forward again where gradient
checkpointing recomputes it, told apart from the model's work), with formulas added for the
CPU's fused attention kernels, which torch counts only on GPUs. It counts whatever runs inside
it, on real tensors or on the meta device (``raytuner plan`` counts its traced step). It is a
dispatch mode of its own rather than torch's ``FlopCounterMode``, whose module tracking keeps
tensors alive and would change what ``raytuner plan`` measures of the same step's memory.

Two utilisations, named as such: **MFU** (model FLOPs utilisation) counts the model's work
alone, forward and backward, and **HFU** (hardware FLOPs utilisation) adds what the step does
again, the forward that gradient checkpointing recomputes in backward. Both are achieved FLOP/s
over the device's dense (not 2:4 sparse) bfloat16 peak from ``PEAKS`` (vendor data sheets), or
the peak given (``scaling.peak_tflops``); a device the table does not know, a MIG slice (a share
of a GPU whose peak is not the whole GPU's) and every CPU have "unknown" rather than a number
against a wrong peak.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)

# dense bfloat16 tensor-core TFLOP/s, by a part of the name torch.cuda.get_device_name() gives
# (the first that matches; longer, more specific names first)
PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.4),  # SXM (HBM3)
    ("H200 NVL", 835.0),
    ("GH200", 989.4),
    ("H200", 989.4),  # SXM
    ("H20", 148.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
    ("RTX 4090", 165.2),
    ("RTX 3090", 71.0),
    ("RTX 6000 Ada", 364.2),
)


def _cpu_attention(q, k, v, *args, **kwargs) -> int:
    return sdpa_flop_count(q, k, v)


def _cpu_attention_backward(grad_out, q, k, v, *args, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, q, k, v)


def _custom() -> dict:
    aten = torch.ops.aten
    return {
        aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
    }


_state = threading.local()  # per thread: CUDA backward runs on autograd's device threads


@contextlib.contextmanager
def recomputing() -> Iterator[None]:
    """What runs inside, in this thread, is gradient checkpointing's recompute of a forward
    (``train/recompute.py`` marks its own): counted as ``recompute``, gradients on or off."""
    before = getattr(_state, "recomputing", False)
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = before


def _recomputed() -> bool:
    """Whether an op now is recompute: marked (``recomputing``), or a forward op run with
    gradients on inside backward (any other checkpointing, e.g. transformers' text encoders;
    autograd's own backward formulas run with gradients off). A custom autograd.Function's
    forward runs with them off: only the mark tells its ops apart in a recompute."""
    if getattr(_state, "recomputing", False):
        return True
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


class Counter(TorchDispatchMode):
    """The FLOPs of every op with a formula, added up (``total``), and of those the forward
    ops that ran again inside backward (``recompute``: gradient checkpointing's, ``_recomputed``);
    it keeps no reference to any tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.recompute = 0
        custom = {op: shape_wrapper(f) for op, f in _custom().items()}
        self.formulas = flop_registry | custom

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            n = formula(*args, **kwargs, out_val=out)
            self.total += n
            if _recomputed():
                self.recompute += n
        return out

    def get_total_flops(self) -> int:
        return self.total

    @property
    def model(self) -> int:
        """The model's FLOPs: forward and backward, without the recompute."""
        return self.total - self.recompute


@contextlib.contextmanager
def counted() -> Iterator[Counter]:
    """Count the FLOPs of what runs inside (``.get_total_flops()``). Compiled regions
    (``train.compile``) run eagerly while counted: dynamo, meeting them under a dispatch mode
    it cannot trace, would otherwise skip them for good."""
    with (
        torch.compiler.set_stance("force_eager"),
        Counter() as counter,
    ):
        yield counter


def device_peak(device: torch.device, given: float = 0.0) -> float | None:
    """The device's dense bfloat16 peak in TFLOP/s: ``given`` when set, else the table's entry
    for the GPU's name; None (MFU unknown) on a CPU or a GPU the table does not list."""
    if given:
        return given
    if device.type != "cuda":
        return None
    return peak_of(torch.cuda.get_device_name(device))


def peak_of(name: str) -> float | None:
    """The dense bfloat16 peak of the GPU torch names ``name``; None for one the table does not
    list and for a MIG slice ("... MIG 1g.10gb"), which has a fraction of the GPU's peak."""
    if "MIG" in name.split():
        return None
    return next((peak for part, peak in PEAKS if part in name), None)


def mfu(tflop_per_s: float, peak: float | None) -> float | None:
    """The share of the peak the achieved TFLOP/s are; None when the peak is unknown. Given the
    model's TFLOP/s it is the MFU, given the hardware's (recompute included) the HFU."""
    return None if not peak else tflop_per_s / peak
