"""Adapter setup and checkpoint contents: safetensors for weights, torch tensors-only files for
optimizer state (loaded with ``weights_only=True``), JSON for the rest."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pickle import UnpicklingError

import pyarrow.fs as pafs
import torch
from peft import LoraConfig as PeftLoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from raytuner import storage
from raytuner.config import LoraConfig

ADAPTER = "adapter.safetensors"
OPTIMIZER = "optimizer.pt"
STATE = "state.json"
RUN = "run.json"  # cache fingerprint and the settings a resume must not change
JOB = "job.json"  # the resolved job config that trained up to this checkpoint (a record)
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


class CheckpointError(ValueError):
    """A checkpoint folder that is incomplete or unreadable."""


def save_checkpoint(
    directory: str, denoiser, optimizer, lr_schedule, state: TrainState, save_export, records
) -> None:
    """Weights, optimizer, export and the JSON ``records`` (file name -> content: the run's
    identity, the resolved job); ``state.json`` last, so a folder without it is incomplete."""
    adapter = lora_state(denoiser)
    save_file(adapter, os.path.join(directory, ADAPTER))
    torch.save(
        {"optimizer": optimizer.state_dict(), "lr_schedule": lr_schedule.state_dict()},
        os.path.join(directory, OPTIMIZER),
    )
    save_export(os.path.join(directory, EXPORT), adapter)
    for name, record in records.items():
        with open(os.path.join(directory, name), "w") as f:
            json.dump(record, f, indent=2, sort_keys=True)
    with open(os.path.join(directory, STATE), "w") as f:
        json.dump(asdict(state), f)


def read_checkpoint(directory: str, expected_keys) -> tuple[dict, dict, TrainState]:
    """(adapter, optimizer and LR state, train state), all read and checked before any is
    applied; raises CheckpointError naming what is wrong."""
    try:
        with open(os.path.join(directory, STATE)) as f:
            state = TrainState(**json.load(f))
        adapter = load_file(os.path.join(directory, ADAPTER))
        extra = torch.load(os.path.join(directory, OPTIMIZER), weights_only=True)
        extra["optimizer"], extra["lr_schedule"]  # noqa: B018 (both must be there)
    except (OSError, ValueError, TypeError, KeyError, SafetensorError, UnpicklingError) as e:
        raise CheckpointError(f"{directory}: {type(e).__name__}: {e}") from e
    if set(adapter) != set(expected_keys):
        missing = sorted(set(expected_keys) - set(adapter))[:3]
        raise CheckpointError(f"{directory}: adapter does not match the model (missing {missing})")
    return adapter, extra, state


def load_checkpoint(directory: str, denoiser, optimizer, lr_schedule) -> TrainState:
    adapter, extra, state = read_checkpoint(directory, get_peft_model_state_dict(denoiser))
    set_peft_model_state_dict(denoiser, adapter)
    optimizer.load_state_dict(extra["optimizer"])
    lr_schedule.load_state_dict(extra["lr_schedule"])
    return state


def run_identity(model, lora, train, fingerprint: str) -> dict:
    """What a resumed run must share with the run that wrote the checkpoint: the cache, the
    model, the adapter's shape and the schedule (the cursor means nothing under another)."""
    schedule = {k: getattr(train, k) for k in ("seed", "global_batch_size", "remainder")}
    return {"fingerprint": fingerprint, "model": asdict(model), "lora": asdict(lora)} | {
        "schedule": schedule
    }


def identity_changes(saved: dict, current: dict) -> list[str]:
    """Dotted keys whose values differ between two run identities."""
    changes = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section), current.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += [f"{section}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            changes.append(section)
    return changes


def checkpoint_folders(run_dir: str) -> tuple[pafs.FileSystem, list[str]]:
    """The run's checkpoint folders, newest first (Ray names them by timestamp)."""
    fs, root = storage.resolve(run_dir)
    if not storage.exists(fs, root):
        return fs, []
    folders = [
        info.path
        for info in storage.listdir(fs, root)
        if info.base_name.startswith("checkpoint_") and info.type == pafs.FileType.Directory
    ]
    return fs, folders[::-1]
