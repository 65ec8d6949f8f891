"""The LoRA a user takes away, in two layouts, both safetensors with the run's metadata:

- ``pytorch_lora_weights.safetensors``: the diffusers/peft layout the family's pipeline loads
  with ``load_lora_weights`` (written by the family's own ``save_lora``);
- ``lora_kohya.safetensors``: the kohya key layout (``lora_unet_…`` / ``lora_transformer_…``,
  ``lora_down`` / ``lora_up`` / ``alpha``) that ComfyUI, AUTOMATIC1111 and kohya tools read,
  converted by ``diffusers.utils.convert_state_dict_to_kohya``.
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
KOHYA_FILE = "lora_kohya.safetensors"


def metadata(*, family: str, model, lora, step: int, run: str, fingerprint: str) -> dict[str, str]:
    """What a LoRA file says about itself: raytuner's keys plus kohya's ``ss_*`` ones."""
    return {
        "raytuner.family": family,
        "raytuner.base_model": model.pretrained,
        "raytuner.revision": model.revision,
        "raytuner.rank": str(lora.rank),
        "raytuner.alpha": str(lora.alpha),
        "raytuner.steps": str(step),
        "raytuner.run": run,
        "raytuner.cache_fingerprint": fingerprint,
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(lora.rank),
        "ss_network_alpha": str(lora.alpha),
        "ss_steps": str(step),
    }


def to_kohya(lora_state: dict[str, torch.Tensor], prefix: str, alpha: float) -> dict:
    """peft keys of the denoiser -> kohya keys under ``lora_<prefix>``, with the run's alpha."""
    from diffusers.utils import convert_state_dict_to_kohya

    state = convert_state_dict_to_kohya({f"{prefix}.{k}": v for k, v in lora_state.items()})
    out = {}
    for key, value in state.items():
        key = key if key.startswith("lora_") else f"lora_{key}"
        out[key] = torch.tensor(float(alpha)) if key.endswith(".alpha") else value.contiguous()
    return out


def _add_metadata(path: str, meta: dict[str, str]) -> None:
    with safe_open(path, framework="pt") as f:
        existing = f.metadata() or {}
    tensors = load_file(path)
    save_file(tensors, path + ".tmp", metadata=existing | meta)
    os.replace(path + ".tmp", path)


def write_lora(
    directory: str, lora_state: dict, *, family, adapter_config: dict, meta: dict
) -> None:
    """Both layouts into ``directory``, each with ``meta``; ``adapter_config``: the peft
    LoraConfig as a dict, so loaders apply the trained alpha / rank scale."""
    family.save_lora(directory, lora_state, adapter_config)
    _add_metadata(os.path.join(directory, DIFFUSERS_FILE), meta)
    kohya = to_kohya(lora_state, family.denoiser_part, adapter_config["lora_alpha"])
    save_file(kohya, os.path.join(directory, KOHYA_FILE), metadata=meta)
