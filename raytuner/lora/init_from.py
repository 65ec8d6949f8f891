"""``lora.init_from``: a LoRA file training starts from, in the diffusers/peft layout or a kohya
one (raytuner's own exports, sd-scripts' SDXL ``input_blocks`` names, sd-scripts' Flux
layout), read into the run's freshly made peft adapter before the first step. Its rank and
alpha must be the job's ``lora.rank`` / ``lora.alpha``; a key that names no adapted module of
the model is refused, never skipped. A resumed run reads its checkpoint afterwards, which wins.
"""

from __future__ import annotations

import hashlib
import json
import struct

import torch
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load as load_tensors

from raytuner import storage
from raytuner.config import ConfigError
from raytuner.lora import export, kohya

ADAPTER_KEY = "lora_adapter_metadata"  # the peft config diffusers' save_lora_weights stores
# what the export keeps of the file's own metadata (sd-scripts' dataset keys are long)
SOURCE_PREFIXES = ("raytuner.", "ss_", "modelspec.")
SOURCE_SKIP = ("ss_tag_frequency", "ss_dataset_dirs", "ss_reg_dataset_dirs", "ss_datasets")
SOURCE_SKIP += ("ss_bucket_info", "modelspec.thumbnail")


def read(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str], str]:
    """A safetensors file, local or a pyarrow URI (``s3://``): tensors, metadata, sha256."""
    fs, where = storage.resolve(path)
    try:
        data = storage.read_bytes(fs, where)
    except (FileNotFoundError, OSError) as e:
        raise ConfigError(f"lora.init_from = {path!r}: cannot read it ({e})") from None
    try:
        (size,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
        tensors = load_tensors(data)
    except (struct.error, ValueError) as e:
        raise ConfigError(f"lora.init_from = {path!r}: not a safetensors file ({e})") from None
    return tensors, meta, hashlib.sha256(data).hexdigest()


def _adapter_alpha(meta: dict[str, str], part: str) -> dict:
    """alpha / alpha_pattern of the peft config diffusers stored with the file, if any."""
    if ADAPTER_KEY not in meta:
        return {}
    config = json.loads(meta[ADAPTER_KEY])
    config = {k.removeprefix(f"{part}."): v for k, v in config.items()}
    return {"alpha": config.get("lora_alpha"), "pattern": config.get("alpha_pattern") or {}}


def from_diffusers(tensors: dict, meta: dict[str, str], part: str) -> dict:
    """diffusers/peft keys (``<part>.<module>.lora_A.weight`` or the older ``lora.down``)
    -> {module: (down, up, alpha)}; alpha from the stored adapter config, ``.alpha`` keys or
    the rank (diffusers' default)."""
    adapter, out, odd = _adapter_alpha(meta, part), {}, []
    ends = {"lora_A.weight": 0, "lora.down.weight": 0, "lora_B.weight": 1, "lora.up.weight": 1}
    pairs: dict[str, list] = {}
    for key, value in tensors.items():
        name = key.removeprefix(f"{part}.")
        end = next((e for e in ends if name.endswith("." + e)), None)
        if end is None:
            if not name.endswith(".alpha"):
                odd.append(key)
            continue
        pairs.setdefault(name[: -len(end) - 1], [None, None])[ends[end]] = value
    odd += [f"{m} (half of a LoRA)" for m, (a, b) in pairs.items() if a is None or b is None]
    if odd:
        raise ValueError(f"keys that are no LoRA of the {part} (e.g. {', '.join(odd[:4])})")
    for module, (down, up) in pairs.items():
        out[module] = (down, up, _alpha(tensors, adapter, part, module, down.shape[0]))
    return out


def _alpha(tensors: dict, adapter: dict, part: str, module: str, rank: int) -> float:
    """A module's alpha in a diffusers file: its ``.alpha`` key, the stored peft config's
    (``alpha_pattern`` first), else the rank (what diffusers then applies: scale 1)."""
    alpha = tensors.get(f"{part}.{module}.alpha", tensors.get(f"{module}.alpha"))
    if alpha is not None:
        return float(alpha)
    if adapter.get("alpha") is None:
        return float(rank)
    patterns = [a for k, a in adapter["pattern"].items() if module.endswith(k)]
    return float(patterns[0] if patterns else adapter["alpha"])


def file_modules(tensors: dict, meta: dict, family, denoiser) -> dict:
    """The file's LoRA per module of the denoiser: {module: (down, up, alpha)}."""
    dims = export.out_dims(denoiser)
    if not any(k.endswith(".lora_down.weight") for k in tensors):
        return from_diffusers(tensors, meta, family.denoiser_part)
    # a family without a kohya layout: the diffusers names, as kohya writes them
    names = family.kohya_names(denoiser.config) or kohya.unet_names
    table = kohya.reverse(names, dims)
    # diffusers' convert_state_dict_to_kohya (raytuner's earlier exports) names the part
    part = f"lora_{family.denoiser_part}_"
    table = {part + m.replace(".", "_"): (m,) for m in dims} | table
    return kohya.from_kohya(tensors, table, dims)


def _match(found: dict, adapted: set[str], known: set[str], lora) -> dict[str, torch.Tensor]:
    """peft state of the adapter from the file's modules; ValueError where they disagree."""
    if unknown := sorted(m for m in found if m not in known):
        raise ValueError(
            f"it has a LoRA on {len(unknown)} modules this model does not have "
            f"(e.g. {', '.join(unknown[:4])}): a LoRA of another model"
        )
    extra = [m for m, (_, up, _) in found.items() if m not in adapted and up.any()]
    if extra:
        raise ValueError(
            f"it has a LoRA on {len(extra)} modules lora.target_modules does not reach "
            f"(e.g. {', '.join(sorted(extra)[:4])}): add them to lora.target_modules"
        )
    state = {}
    for module, (down, up, alpha) in found.items():
        if module not in adapted:
            continue  # a zero piece of a fused kohya linear the run does not train
        rank = down.shape[0]
        if rank != lora.rank or abs(alpha - lora.alpha) > 1e-6 * max(1.0, abs(alpha)):
            raise ValueError(
                f"its LoRA on {module} has rank {rank} and alpha {alpha:g}, the job "
                f"lora.rank = {lora.rank} and lora.alpha = {lora.alpha:g}: set lora.rank = "
                f"{rank} and lora.alpha = {alpha:g} to continue from it"
            )
        state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"] = down, up
    return state


def start_from(denoiser, path: str, lora, family) -> tuple[dict[str, torch.Tensor], dict]:
    """``path`` read and checked against the denoiser's peft adapter: its tensors under the
    adapter's peft names (``get_peft_model_state_dict``), and the provenance the export keeps.
    The caller puts them into the adapter (sharded or not)."""
    tensors, meta, sha = read(path)
    current = get_peft_model_state_dict(denoiser)
    adapted = set(kohya.modules_of(current))
    try:
        found = file_modules(tensors, meta, family, denoiser)
        state = _match(found, adapted, set(export.out_dims(denoiser)), lora)
        for key, value in state.items():
            if value.shape != current[key].shape:
                raise ValueError(
                    f"{key} is {tuple(value.shape)}, the model's "
                    f"{tuple(current[key].shape)}: a LoRA of another model"
                )
    except (KeyError, ValueError) as e:
        raise ConfigError(f"lora.init_from = {path!r}: {e}") from None
    source = {
        k: v for k, v in meta.items() if k.startswith(SOURCE_PREFIXES) and k not in SOURCE_SKIP
    }
    return state, {
        "raytuner.init_from": path,
        "raytuner.init_from_sha256": sha,
        "raytuner.init_from_modules": str(len(state) // 2),
        "raytuner.init_from_metadata": json.dumps(source, sort_keys=True),
    }
