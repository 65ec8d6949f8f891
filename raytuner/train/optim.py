"""The optimizer (``train.optimizer``) and the learning-rate schedule (``train.lr_scheduler``
after ``train.warmup_steps``), from the libraries made for them: torch's AdamW, bitsandbytes'
8-bit AdamW, transformers' Adafactor, prodigyopt's Prodigy, diffusers' ``get_scheduler``.
Their state is a tensors-and-numbers dict, checkpointed and restored like AdamW's."""

from __future__ import annotations

import importlib.util

import torch

# what an optimizer needs beyond raytuner's own dependencies: pip install 'raytuner[lowvram]'
PACKAGES = {"adamw8bit": "bitsandbytes", "prodigy": "prodigyopt"}


def missing_package(name: str) -> str | None:
    """The package ``train.optimizer = name`` needs that is not installed, if any."""
    package = PACKAGES.get(name)
    return package if package and importlib.util.find_spec(package) is None else None


def build_optimizer(name: str, params: list, lr: float, weight_decay: float):
    """``params``: tensors, or param groups (dicts, a group's own ``lr`` where it has one)."""
    if name == "adamw":  # on GPUs, the fused kernel: one launch for every parameter
        tensors = [t for g in params for t in (g["params"] if isinstance(g, dict) else [g])]
        fused = bool(tensors) and tensors[0].device.type == "cuda"
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
    if name == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        # a fixed learning rate (the schedule sets it), not Adafactor's own relative steps
        return Adafactor(
            params,
            lr=lr,
            weight_decay=weight_decay,
            scale_parameter=False,
            relative_step=False,
            warmup_init=False,
        )
    if name == "prodigy":
        from prodigyopt import Prodigy

        return Prodigy(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"train.optimizer = {name!r} is not known")


def build_schedule(name: str, optimizer, warmup: int, steps: int, cycles: int, power: float):
    """diffusers' schedule ``name`` over ``steps`` with a linear warmup of ``warmup`` steps."""
    from diffusers.optimization import get_scheduler

    if name == "constant" and warmup:
        name = "constant_with_warmup"
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=steps,
        num_cycles=cycles,
        power=power,
    )


def state_bytes(name: str, params: list[torch.Tensor]) -> int:
    """What the optimizer's state holds for ``params`` once it has stepped: AdamW two moments
    in the parameters' dtype; 8-bit AdamW two bytes per element (+ a float per 256-element
    block) for tensors of 4096 elements and more; Adafactor a row and a column average per
    matrix; Prodigy four tensors like the parameter."""
    total = 0
    for p in params:
        n, size = p.numel(), p.element_size()
        if name == "adamw":
            total += 2 * n * size
        elif name == "adamw8bit":
            total += 2 * n + 8 * (-(-n // 256)) if n >= 4096 else 8 * n
        elif name == "adafactor":
            total += 4 * (sum(p.shape[-2:]) if p.dim() >= 2 else n)
        else:
            total += 4 * n * size
    return total


def for_run(train, params: list):
    """The optimizer and the schedule the job's ``[train]`` section asks for; ``params``: the
    trained tensors or their param groups (``Weights.param_groups``: the schedule scales every
    group's learning rate)."""
    opt = build_optimizer(train.optimizer, params, train.learning_rate, train.weight_decay)
    sched = build_schedule(
        train.lr_scheduler,
        opt,
        train.warmup_steps,
        train.max_steps,
        train.lr_cycles,
        train.lr_power,
    )
    return opt, sched
