"""What a run trains: a peft LoRA adapter on the denoiser (``train.mode = "lora"``) or the whole
denoiser (``"full"``), optionally with an exponential moving average of the trained weights
(``diffusers.training_utils.EMAModel``), and what each exports."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch
from peft import LoraConfig as PeftLoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn

from raytuner.config import ConfigError
from raytuner.lora import export, kohya
from raytuner.lora import init_from as lora_init
from raytuner.runs import KOHYA_FILE, LORA_DIR, MODEL_DIR


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def autocast_dtype(precision: str, device: torch.device, frozen: torch.dtype):
    """The step's autocast dtype: the frozen weights' when they are half precision (the inputs
    and float32 LoRA layers meet them there), bf16 on a GPU when ``train.mixed_precision =
    "bf16"``, else None (float32 throughout)."""
    if frozen != torch.float32:
        return frozen
    return torch.bfloat16 if precision == "bf16" and device.type == "cuda" else None


def attention_backends(device: torch.device) -> None:
    """Keep cuDNN's fused attention out of training: its backward failed on an H100 (torch
    2.11, Flux at 1024 px: "mha_graph.execute ... is_good()"), where flash attention runs."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


class Weights:
    """The denoiser's trainable weights: their tensors for a checkpoint, their EMA, their export."""

    def __init__(
        self,
        denoiser: nn.Module,
        *,
        mode: str,
        lora,
        targets,
        ema_decay: float,
        dtype: torch.dtype = torch.float32,
        family=None,
    ):
        """``dtype``: the trained weights' (``model.trainable_dtype``), whatever the frozen
        ones are in; ``family``: given, a LoRA starts from ``lora.init_from`` (a resumed run
        then loads its checkpoint over it) and must fit the family's kohya layout."""
        self.denoiser, self.mode = denoiser, mode
        self.provenance = {"ss_training_started_at": str(time.time())}
        denoiser.requires_grad_(mode == "full")
        if mode == "lora":
            denoiser.add_adapter(
                PeftLoraConfig(
                    r=lora.rank,
                    lora_alpha=lora.alpha,
                    lora_dropout=lora.dropout,
                    init_lora_weights="gaussian",
                    target_modules=list(lora.target_modules or targets),
                )
            )
        named = [(n, p) for n, p in denoiser.named_parameters() if p.requires_grad]
        for _, p in named:
            p.data = p.data.to(dtype)
        if mode == "lora" and family is not None:
            self._lora_files(family, lora)
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.ema = None
        if ema_decay:
            from diffusers.training_utils import EMAModel

            self.ema = EMAModel(self.params, decay=ema_decay)

    def _lora_files(self, family, lora) -> None:
        """Refuse targets the family's kohya layout has no name for (before training, not at
        the first checkpoint); read ``lora.init_from`` into the fresh adapter."""
        names = export.kohya_names(family, self.denoiser)
        if names is not None:
            modules = kohya.modules_of(get_peft_model_state_dict(self.denoiser))
            if missing := [m for m in modules if not names(m)]:
                raise ConfigError(
                    f"lora.target_modules reaches {', '.join(missing[:3])}, which "
                    f"{family.name}'s kohya layout ({KOHYA_FILE}) has no name for: "
                    "leave it out of lora.target_modules"
                )
        if lora.init_from:
            self.provenance |= lora_init.start_from(self.denoiser, lora.init_from, lora, family)

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint keeps: the adapter, or the whole denoiser."""
        if self.mode == "lora":
            return _cpu(get_peft_model_state_dict(self.denoiser))
        return _cpu(self.denoiser.state_dict())

    def keys(self) -> set[str]:
        if self.mode == "lora":
            return set(get_peft_model_state_dict(self.denoiser))
        return set(self.denoiser.state_dict())

    def load(self, state: dict[str, torch.Tensor]) -> None:
        if self.mode == "lora":
            set_peft_model_state_dict(self.denoiser, state)
        else:
            self.denoiser.load_state_dict(state)

    def ema_state(self) -> dict[str, torch.Tensor] | None:
        if self.ema is None:
            return None
        return _cpu(dict(zip(self.names, self.ema.shadow_params, strict=True)))

    def load_ema(self, shadow: dict[str, torch.Tensor], step: int) -> None:
        device = self.params[0].device
        self.ema.shadow_params = [shadow[n].to(device) for n in self.names]  # beside its weight
        self.ema.optimization_step = step

    def step(self) -> None:
        """After each optimizer step: move the average."""
        if self.ema is not None:
            self.ema.step(self.params)

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        """The EMA weights in place of the trained ones (a no-op without EMA)."""
        if self.ema is None:
            yield
            return
        self.ema.store(self.params)
        self.ema.copy_to(self.params)
        try:
            yield
        finally:
            self.ema.restore(self.params)

    def export(self, directory: str, family, meta: dict[str, str]) -> None:
        """What the user takes away (the EMA weights when enabled): both LoRA layouts, or the
        denoiser as a diffusers model folder that ``from_pretrained`` loads."""
        with self.averaged():
            if self.mode == "lora":
                adapter = self.denoiser.peft_config["default"].to_dict()
                out = os.path.join(directory, LORA_DIR)
                export.write_lora(
                    out,
                    self.state(),
                    family=family,
                    adapter_config=adapter,
                    meta=meta | self.provenance,
                    denoiser=self.denoiser,
                )
                return
            out = os.path.join(directory, MODEL_DIR, family.denoiser_part)
            self.denoiser.save_pretrained(out)
            with open(os.path.join(out, "raytuner.json"), "w") as f:
                json.dump(meta, f, indent=2, sort_keys=True)


class Trainable(NamedTuple):
    """What a worker trains, placed: the denoiser, its trained Weights, the Source it came from,
    the step's autocast dtype and the placement that keeps every tensor where it belongs."""

    denoiser: nn.Module
    weights: Weights
    source: object  # parts.Source
    amp: torch.dtype | None
    placement: object  # raytuner.placement.DenoiserPlacement


def trainable_model(
    model, train, lora, family, device: torch.device, memory=None, source=None
) -> Trainable:
    """The denoiser a worker trains, placed for ``device`` in train mode (frozen weights in
    ``model.dtype``, trained ones in ``model.trainable_dtype``, ``memory.blocks_to_swap`` of
    its blocks streamed): one setup for the loop, both benches and ``raytuner plan``.

    ``source``: the parts' Source when not the job's own on ``device`` (plan: the GPU's
    dtypes, a released repo's shipped architecture). On the meta device (plan) nothing is
    loaded, read or streamed: the architecture alone, every weight resident, no
    ``lora.init_from`` (its values change no size); plan counts the streamed blocks itself."""
    from raytuner import placement
    from raytuner.config import MemoryConfig
    from raytuner.families import parts

    memory = memory or MemoryConfig()
    trainable = parts.DTYPES[model.trainable_dtype]
    source = source or parts.model_source(model, device)
    if train.mode == "full":
        source = dataclasses.replace(source, dtype=trainable)
    attention_backends(device)
    float8 = model.dtype == parts.FLOAT8
    if device.type == "meta":
        denoiser = family.denoiser(source, "meta", weights=False)
        lora, swapped = dataclasses.replace(lora, init_from=""), 0
    else:
        denoiser = family.denoiser(source, str(placement.load_device(device, memory, float8)))
        swapped = memory.blocks_to_swap
    denoiser.train()
    if float8:
        parts.float8_storage(denoiser.requires_grad_(False))
    if train.gradient_checkpointing:
        denoiser.enable_gradient_checkpointing()
    weights = Weights(
        denoiser,
        mode=train.mode,
        lora=lora,
        targets=family.lora_targets,
        ema_decay=train.ema_decay,
        dtype=trainable,
        family=family,
    )
    placed = placement.DenoiserPlacement(denoiser, family, device, swapped, memory.swap_ring)
    placed.average(weights.ema)
    amp = autocast_dtype(train.mixed_precision, device, source.dtype)
    return Trainable(denoiser, weights, source, amp, placed)
