"""A LoKr or LoHa file of raytuner's (``lora.kind``) put on a pipeline's denoiser through peft,
for the families whose diffusers loader does not take it (``load_lora_weights`` takes LoRA and
DoRA everywhere, LoKr for Z-Image and Flux.2 only, LoHa nowhere): the peft config stored
with the file (diffusers' ``lora_adapter_metadata``) and its tensors, as trained. diffusers'
``unload_lora_weights`` removes it as it removes a LoRA."""

from __future__ import annotations

import json

from safetensors import safe_open

from raytuner.lora.export import KIND
from raytuner.lora.init_from import ADAPTER_KEY

PEFT_KINDS = ("lokr", "loha")  # the kinds applied here rather than by diffusers


def kind_of(path: str) -> str:
    """The adapter kind a raytuner LoRA file records (``lora`` for any other file)."""
    with safe_open(path, framework="pt") as f:
        return (f.metadata() or {}).get(KIND, "lora")


def apply_file(denoiser, path: str, part: str) -> None:
    """Add the adapter of raytuner's diffusers file ``path`` to ``denoiser`` (the pipeline's
    ``part``: its keys' prefix) with its stored peft config and values."""
    from peft import PeftConfig
    from peft.utils import set_peft_model_state_dict

    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        keys = [k for k in f.keys() if k.startswith(f"{part}.")]  # noqa: SIM118
        state = {k.removeprefix(f"{part}."): f.get_tensor(k) for k in keys}
    if ADAPTER_KEY not in meta or not state:
        raise ValueError(
            f"{path}: no {part} adapter with its peft config ({ADAPTER_KEY}): a LoKr or LoHa "
            "applies from raytuner's diffusers file, pytorch_lora_weights.safetensors"
        )
    stored = json.loads(meta[ADAPTER_KEY])
    config = PeftConfig.from_peft_type(**{k.removeprefix(f"{part}."): v for k, v in stored.items()})
    denoiser.add_adapter(config)
    dtype = next(denoiser.parameters()).dtype
    set_peft_model_state_dict(denoiser, {k: v.to(dtype) for k, v in state.items()})
