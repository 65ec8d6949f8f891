"""Adapter setup and checkpoint contents: safetensors for weights, torch tensors-only files for
optimizer state (loaded with ``weights_only=True``), JSON for the rest."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
from peft import LoraConfig as PeftLoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch import nn

from raytuner.config import LoraConfig

ADAPTER = "adapter.safetensors"
OPTIMIZER = "optimizer.pt"
STATE = "state.json"
EXPORT = "lora"  # the family's loadable LoRA layout, inside every checkpoint


@dataclass
class TrainState:
    """Where training stands: the global step and the data cursor (next global batch)."""

    step: int = 0
    epoch: int = 0
    index: int = 0
    first_loss: float | None = None
    loss: float | None = None


def add_lora(denoiser: nn.Module, lora: LoraConfig, default_targets: tuple[str, ...]) -> list:
    """Freeze the denoiser, add a peft LoRA adapter, return the trainable parameters."""
    denoiser.requires_grad_(False)
    denoiser.add_adapter(
        PeftLoraConfig(
            r=lora.rank,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            init_lora_weights="gaussian",
            target_modules=list(lora.target_modules or default_targets),
        )
    )
    return [p for p in denoiser.parameters() if p.requires_grad]


def lora_state(denoiser: nn.Module) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(denoiser).items()
    }


def save_checkpoint(
    directory: str, denoiser, optimizer, lr_schedule, state: TrainState, save_export
) -> None:
    adapter = lora_state(denoiser)
    save_file(adapter, os.path.join(directory, ADAPTER))
    torch.save(
        {"optimizer": optimizer.state_dict(), "lr_schedule": lr_schedule.state_dict()},
        os.path.join(directory, OPTIMIZER),
    )
    save_export(os.path.join(directory, EXPORT), adapter)
    with open(os.path.join(directory, STATE), "w") as f:
        json.dump(asdict(state), f)


def load_checkpoint(directory: str, denoiser, optimizer, lr_schedule) -> TrainState:
    set_peft_model_state_dict(denoiser, load_file(os.path.join(directory, ADAPTER)))
    extra = torch.load(os.path.join(directory, OPTIMIZER), weights_only=True)
    optimizer.load_state_dict(extra["optimizer"])
    lr_schedule.load_state_dict(extra["lr_schedule"])
    with open(os.path.join(directory, STATE)) as f:
        return TrainState(**json.load(f))
