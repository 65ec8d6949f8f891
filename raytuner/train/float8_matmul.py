"""``train.float8_matmul``: the frozen base linears of a transformer family's repeated blocks run
their matrix products in float8 (torchao's float8 training: the input and the weight cast to
e4m3 with a scale per tensor, the output gradient to e5m2), while the LoRA stays in the compute
dtype and its float32 weights. An opt-in speed setting for GPUs with FP8 tensor cores (compute
capability 8.9 and newer: L4, L40S, RTX 4090, H100, H200, B200); the weights stay stored as
they are (``model.dtype``), cast to float8 on each use.

What ``raytuner check`` refuses up front: CPU workers, the UNet families, float8 storage
(``model.dtype = "float8"``: the weights are float8 already), block swap and sharding (untried
with torchao's casts); the torchao package missing. What only the worker can see, a GPU without
FP8, it refuses at its start as a ConfigError (exit 2 on the user's terminal).
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from raytuner.config import ConfigError
from raytuner.placement import sharding

MIN_CAPABILITY = (8, 9)  # Ada and Hopper: FP8 tensor cores
DIVISOR = 16  # float8 matrix products need both sides of the weight a multiple of 16


def missing_package() -> str | None:
    """``"torchao"`` when it is not installed."""
    return None if importlib.util.find_spec("torchao") else "torchao"


def refuse_device(device: torch.device) -> None:
    """A ConfigError unless ``device`` is a GPU with FP8 tensor cores."""
    if device.type == "cpu":  # the CPU emulates the casts (tests); check refuses CPU workers
        return
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise ConfigError(
            f"train.float8_matmul = true: this worker's {name} (compute capability "
            f"{'.'.join(map(str, capability))}) has no FP8 tensor cores (8.9 and newer: L4, "
            "L40S, RTX 4090, H100, H200, B200); set train.float8_matmul = false"
        )


def convert(denoiser: nn.Module, family) -> int:
    """Each frozen base linear (a LoRA layer's ``base_layer``, or a plain frozen linear) inside
    the family's repeated blocks (``blocks.compile``) made a torchao ``Float8Linear``, in place;
    the LoRA's own linears and every linear outside the blocks stay as they are. Returns how
    many were converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen = set()
    for block in sharding.of_classes(denoiser, family.blocks.compile):
        for name, m in block.named_modules():
            frozen = isinstance(m, nn.Linear) and not m.weight.requires_grad
            lora = any(part.startswith("lora_") for part in name.split("."))
            if frozen and not lora and all(d % DIVISOR == 0 for d in m.weight.shape):
                chosen.add(id(m))
    config = Float8LinearConfig()
    convert_to_float8_training(
        denoiser, module_filter_fn=lambda m, fqn: id(m) in chosen, config=config
    )
    return len(chosen)
