"""``train.float8_matmul``: the frozen base linears of a transformer family's repeated blocks run
their matrix products in float8, while the LoRA stays in the compute dtype and its float32
weights. An opt-in speed setting for GPUs with FP8 tensor cores (compute capability 8.9 and
newer: L4, L40S, RTX 4090, H100, H200, B200). The weights stay stored as they are
(``model.dtype``); each converted linear keeps its weight's float8 e4m3 copy beside it, made
once (``Float8FrozenLinear.float8_weight``): 1 byte more a converted parameter (Flux.1-dev's
~11.9 B: ~11.9 GB next to its 23.8 GB of bfloat16 weights), which ``raytuner plan`` counts.

Each chosen linear becomes a ``Float8FrozenLinear`` in place (its class swapped: the parameters,
their names and peft's ``base_layer`` stay as they were; the copy is no parameter, buffer or
state). Its forward casts the input to float8 e4m3 with one scale per tensor and multiplies it
by the weight's copy with ``torch._scaled_mm`` into the compute dtype; its backward computes the
input's gradient alone (the output gradient cast to e5m2, times the same copy made column-major,
as ``_scaled_mm`` takes it: one linear's copy at a time, 1 byte an element, where keeping that
layout too would cost every converted parameter another byte) and saves nothing but the kept
copy. The weight cast on each use instead (forward, checkpointing's recompute, backward: ~30
bytes of memory traffic a parameter each) made a Flux.1-dev LoRA step on an H200 2.0x slower
than in bfloat16 (2026-11-28: 0.607 against 1.241 samples/s); the kept copy is not measured on
a GPU yet. Hand-written rather than torchao's float8 training, which is made for trained
weights: its backward computes the weight's gradient too (a third matrix product and two more
casts) and saves the input, even for a weight that needs no gradient; a Flux.1-dev LoRA on an
H200 (1024 px, checkpointing) trained 2.6x slower with it than in bfloat16, counting 290.0 TFLOP
a sample instead of 171.3.

What ``raytuner check`` refuses up front: CPU workers, the UNet families, float8 storage
(``model.dtype = "float8"``: the weights are float8 already), block swap and sharding (untried
with the casts). What only the worker can see, a GPU without FP8, it refuses at its start as a
ConfigError (exit 2 on the user's terminal). The CPU emulates the products (tests).
"""

from __future__ import annotations

import torch
from torch import nn

from raytuner.config import ConfigError
from raytuner.placement import sharding

MIN_CAPABILITY = (8, 9)  # Ada and Hopper: FP8 tensor cores
DIVISOR = 16  # float8 matrix products need both sides of the weight a multiple of 16
E4M3 = torch.float8_e4m3fn  # the input and the weight: more precision
E5M2 = torch.float8_e5m2  # the output gradient: more range
EPS = 1e-12  # an all-zero tensor's amax, so that its scale stays finite


def refuse_device(device: torch.device) -> None:
    """A ConfigError unless ``device`` is a GPU with FP8 tensor cores."""
    if device.type in ("cpu", "meta"):  # the CPU emulates the casts (tests; check refuses CPU
        return  # workers); meta: raytuner plan's trace
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise ConfigError(
            f"train.float8_matmul = true: this worker's {name} (compute capability "
            f"{'.'.join(map(str, capability))}) has no FP8 tensor cores (8.9 and newer: L4, "
            "L40S, RTX 4090, H100, H200, B200); set train.float8_matmul = false"
        )


def to_float8(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in ``dtype`` scaled so that its largest magnitude is the format's largest, and the
    float32 scalar that turns it back (``t ≈ float8 * inverse``). One float32 copy of ``t`` is
    made and scaled in place: at most one such copy is alive (Flux's largest input at 1024 px,
    4,608 x 12,288, is 226 MB in float32), where three temporaries one after the other held two."""
    top = torch.finfo(dtype).max
    amax = t.detach().abs().amax().float().clamp(min=EPS)
    scale = top / amax
    scaled = t.detach().to(torch.float32, copy=True).mul_(scale).clamp_(-top, top)
    return scaled.to(dtype), scale.reciprocal()


class _FrozenMatmul(torch.autograd.Function):
    """``x @ weight.T + bias`` in float8, ``x`` 2-D, the weight given as its float8 copy ``w8``
    (row-major) and the scalar that turns it back; the gradient of ``x`` alone."""

    @staticmethod
    def forward(ctx, x, w8, w_inverse, bias, dtype):
        x8, x_inverse = to_float8(x.to(dtype).contiguous(), E4M3)  # row-major
        fused = bias is not None and dtype != torch.float32  # cuBLAS adds a half-precision bias
        out = torch._scaled_mm(
            x8, w8.t(), scale_a=x_inverse, scale_b=w_inverse,
            bias=bias.to(dtype) if fused else None, out_dtype=dtype,
        )  # fmt: skip
        if bias is not None and not fused:
            out = out + bias.to(dtype)
        ctx.save_for_backward(w8, w_inverse)  # the linear's kept copy: nothing new is held
        ctx.x_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        w8, w_inverse = ctx.saved_tensors
        g8, g_inverse = to_float8(grad.contiguous(), E5M2)
        column_major = w8.t().contiguous().t()  # _scaled_mm's second operand: 1 byte a weight
        grad_x = torch._scaled_mm(
            g8, column_major, scale_a=g_inverse, scale_b=w_inverse, out_dtype=ctx.x_dtype
        )
        return grad_x, None, None, None, None


class Float8FrozenLinear(nn.Linear):
    """A linear whose frozen weight multiplies in float8 (``_FrozenMatmul``), in the autocast
    dtype where autocast is on for the input's device, else in the input's dtype. The weight's
    float8 copy is kept (``float8_weight``), a plain attribute: not in ``state_dict``, not a
    buffer (DDP would broadcast it)."""

    _float8: tuple | None = None  # (dtype, the weight's stamp, its float8 copy, inverse scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type  # meta (plan) has no autocast
        autocast = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
        dtype = torch.get_autocast_dtype(kind) if autocast else x.dtype
        w8, w_inverse = self.float8_weight(dtype)
        flat = x.reshape(-1, x.shape[-1])
        out = _FrozenMatmul.apply(flat, w8, w_inverse, self.bias, dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def float8_weight(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight cast to ``dtype``, then to float8 e4m3 (``to_float8``), and its inverse
        scale: made once and kept, made again when the weight's device, storage or version
        (an in-place write; not one through ``.data``, which counts none) or ``dtype`` differ
        from the kept copy's. Compiled code cannot read the version: it takes the kept copy
        when it is of ``dtype`` and on the weight's device (dynamo guards both), else casts
        without keeping (a compiled region writes no module state)."""
        kept, weight = self._float8, self.weight
        if torch.compiler.is_compiling():
            if kept is not None and kept[0] == dtype and kept[2].device == weight.device:
                return kept[2], kept[3]
            return to_float8(weight.to(dtype), E4M3)
        stamp = (weight.device, weight.data_ptr(), weight._version)
        if kept is None or kept[0] != dtype or kept[1] != stamp:
            with torch.inference_mode(False):  # a copy training can save for backward
                kept = self._float8 = (dtype, stamp, *to_float8(weight.to(dtype), E4M3))
        return kept[2], kept[3]

    def _apply(self, fn, recurse=True):
        """``to``, ``cuda``, ``half``...: a kept copy made again at once from the weight as
        moved or cast (one linear's old copy held meanwhile), so that compiled code finds it."""
        out = super()._apply(fn, recurse)
        if self._float8 is not None:
            self.float8_weight(self._float8[0])
        return out


def convert(denoiser: nn.Module, family, dtype: torch.dtype | None = None) -> int:
    """Each frozen base linear (a LoRA layer's ``base_layer``, or a plain frozen linear) inside
    the family's repeated blocks (``blocks.compile``) made a ``Float8FrozenLinear``, in place;
    the LoRA's own linears, every linear outside the blocks and one with a trained bias stay as
    they are. ``dtype``: the step's compute dtype, each one's float8 copy made for it now (on
    meta too, for ``raytuner plan`` to count), else at its first use. Returns how many were
    converted."""
    count = 0
    for block in sharding.of_classes(denoiser, family.blocks.compile):
        for name, m in block.named_modules():
            if type(m) is not nn.Linear or m.weight.requires_grad:
                continue
            trained_bias = m.bias is not None and m.bias.requires_grad
            lora = any(part.startswith("lora_") for part in name.split("."))
            if not trained_bias and not lora and all(d % DIVISOR == 0 for d in m.weight.shape):
                m.__class__ = Float8FrozenLinear
                if dtype is not None:
                    m.float8_weight(dtype)
                count += 1
    return count


def copies(module: nn.Module) -> list[torch.Tensor]:
    """The float8 copies and inverse scales the ``Float8FrozenLinear``s in ``module`` keep."""
    return [t for m in module.modules() if (kept := getattr(m, "_float8", None)) for t in kept[2:]]
