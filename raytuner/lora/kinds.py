"""The adapter kinds a run trains (``lora.kind``, ``lora.dora``), all through peft: a LoRA
(``LoraConfig``; with ``lora.dora``, DoRA: ``use_dora``), LyCORIS' LoKr (``LoKrConfig``: the
update is ``alpha / rank x w1 (x) w2``, a Kronecker product whose factors may be low-rank) and
LoHa (``LoHaConfig``: ``alpha / rank x (w1_a @ w1_b) * (w2_a @ w2_b)``, a Hadamard product).

What differs between the kinds lives here: the peft config of ``[lora]``, which parameter names
belong to the adapter, their peft state names, and their first values drawn on the CPU from the
run's seed (the same on any device, sharded or not). DoRA's magnitudes start at the base
weight's row norms (``dora_magnitudes``), as peft starts them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# the first part of every adapter parameter's or state key's last names: peft's LoRA (and
# DoRA's ``lora_magnitude_vector``), LoKr's and LoHa's
ADAPTER_PARTS = ("lora_", "lokr_", "hada_")
MAGNITUDE = "lora_magnitude_vector"  # DoRA's trained magnitude (one per output row)
# the tensors that start at zero, so that a fresh adapter changes nothing: a LoRA's up (B),
# LoKr's w1 (whole or its low-rank a), LoHa's second up (w2_b); the rest start random
ZERO_START = ("lora_B", "lokr_w1", "lokr_w1_a", "hada_w2_b")


def is_adapter(name: str) -> bool:
    """A parameter / state name of the adapter (any kind), not of the frozen model."""
    return any(part.startswith(ADAPTER_PARTS) for part in name.split("."))


def peft_config(lora, targets, text: bool = False):
    """The peft config of the job's ``[lora]`` section on ``targets`` (``lora.target_modules``
    when set): its kind, rank, alpha and the kind's options. The LoRA's start is drawn by
    ``draw`` (peft's "gaussian"), LoKr's and LoHa's by peft's own rule there too."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    modules = list(lora.target_modules or targets)
    if lora.kind == "lora":
        return LoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            init_lora_weights="gaussian",
            use_dora=lora.dora,
            target_modules=modules,
        )
    common = dict(
        r=lora.rank,
        alpha=lora.alpha,
        rank_dropout=lora.rank_dropout,
        module_dropout=lora.module_dropout,
        target_modules=modules,
    )
    if lora.kind == "lokr":
        return LoKrConfig(
            **common, decompose_both=lora.decompose_both, decompose_factor=lora.factor or -1
        )
    return LoHaConfig(**common)


def peft_name(parameter: str) -> str:
    """A parameter's name in peft's state (``get_peft_model_state_dict``): without the adapter's
    name (``default``), DoRA's magnitude without ``.weight``."""
    name = parameter.replace(".default", "")
    return name.removesuffix(".weight") if name.endswith(f"{MAGNITUDE}.weight") else name


def draw(names: list[str], params: list[torch.Tensor], seed: int, rank: int) -> dict:
    """Every adapter tensor's first values, drawn on the CPU from ``seed`` in the adapter's
    order: a LoRA's down ~ N(0, 1/rank) (peft's "gaussian"), the ``ZERO_START`` tensors zero,
    LoKr's and LoHa's others as peft draws them (Kaiming-uniform: U(-b, b), b = 1 / sqrt(fan
    in)); DoRA's magnitudes zero here (``dora_magnitudes`` sets them once the base weights
    are in place)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in zip(names, params, strict=True):
        last = [part for part in name.split(".") if part.startswith(ADAPTER_PARTS)][-1]
        if last == "lora_A":
            out[name] = torch.randn(p.shape, generator=generator) / rank
        elif last in ZERO_START or last == MAGNITUDE:
            out[name] = torch.zeros(p.shape)
        else:
            bound = 1 / math.sqrt(math.prod(p.shape[1:]))
            out[name] = (torch.rand(p.shape, generator=generator) * 2 - 1) * bound
    return out


def dora_layers(module: nn.Module) -> dict[str, nn.Module]:
    """Module name -> its peft DoRA layer (the LoRA layers with a magnitude)."""
    return {
        name: m
        for name, m in module.named_modules()
        if hasattr(m, MAGNITUDE) and "default" in getattr(m, MAGNITUDE)
    }


def dora_magnitudes(denoiser: nn.Module, gather) -> dict[str, torch.Tensor]:
    """DoRA's first magnitudes: each adapted weight's output-row norms (its up is zero, so
    ``||W + scale B A||`` is ``||W||``), by parameter name; ``gather``: a whole tensor from a
    sharded one (``sharding.gather``: every worker calls it in the same order)."""
    out = {}
    for name, layer in dora_layers(denoiser).items():
        param = getattr(layer, MAGNITUDE)["default"].weight
        if param.is_meta:
            continue
        weight = gather(layer.get_base_layer().weight).detach().float()
        norm = weight.reshape(weight.shape[0], -1).norm(dim=1)
        out[f"{name}.{MAGNITUDE}.default.weight"] = norm.reshape(param.shape)
    return out
