"""The LoRA a user takes away, safetensors with the run's metadata, in the layouts the family's
tools read (``family.adapters.files``):

- ``pytorch_lora_weights.safetensors``: the diffusers/peft layout the family's pipeline loads
  with ``load_lora_weights`` (written by the family's own ``save_lora``), every family;
- ``lora_kohya.safetensors``: sd-scripts' layout (``raytuner.lora.kohya``) that ComfyUI,
  AUTOMATIC1111 / Forge and kohya's tools read, where the family has one.

Both carry raytuner's keys, the ``ss_*`` keys sd-scripts writes (A1111 / Forge classify a LoRA
by ``ss_base_model_version``) and the SAI model-spec ``modelspec.*`` keys as sd-scripts writes
them. Their tensors are in the dtype the metadata names (``raytuner.save_dtype``, from
``lora.save_dtype``), as sd-scripts' ``--save_precision``; training keeps its own.
"""

from __future__ import annotations

import datetime
import json
import os
import time

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from raytuner.checkpoint.layout import DIFFUSERS_FILE, KOHYA_FILE
from raytuner.lora import kohya, lycoris
from raytuner.version import __version__

MODELSPEC_VERSION = "1.0.1"  # the SAI model spec sd-scripts writes
SAVE_DTYPE = "raytuner.save_dtype"  # the metadata key naming the files' tensor dtype
KIND = "raytuner.kind"  # the metadata key naming the adapter's kind (lora.kind)
LYCORIS_MODULE = "lycoris.kohya"  # ss_network_module of LyCORIS' networks (LoKr, LoHa)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


MERGED = "raytuner.merged_adapters"  # the adapters merged into the base while training


def metadata(
    *, family: str, model, lora, step: int, run: str, fingerprint: str, merged=()
) -> dict[str, str]:
    """What a LoRA file says about itself: raytuner's keys plus kohya's ``ss_*`` ones; with
    ``merged`` (``model.merge_adapters``: path, weight and sha256 of each) the adapters that
    were merged into the base while it trained, which the file does not hold."""
    # the expert of a mixture of experts the file's LoRA is on (model.expert)
    expert = {"raytuner.expert": model.expert} if getattr(model, "expert", "") else {}
    if getattr(model, "expert", "") == "both":  # each file names its own expert over this
        expert["raytuner.expert_switch_every"] = str(model.expert_switch_every)
    return expert | ({MERGED: json.dumps(list(merged))} if merged else {}) | {
        "raytuner.family": family,
        "raytuner.base_model": model.pretrained,
        "raytuner.revision": model.revision,
        KIND: lora.kind,
        "raytuner.dora": str(lora.dora).lower(),
        "raytuner.rank": str(lora.rank),
        "raytuner.alpha": str(lora.alpha),
        "raytuner.steps": str(step),
        "raytuner.run": run,
        "raytuner.cache_fingerprint": fingerprint,
        SAVE_DTYPE: lora.save_dtype,
        "raytuner.text_encoder": str(lora.text_encoder).lower(),
        "ss_network_module": "networks.lora" if lora.kind == "lora" else LYCORIS_MODULE,
        "ss_network_dim": str(lora.rank),
        "ss_network_alpha": str(lora.alpha),
        "ss_network_dropout": str(lora.dropout),
        # sd-scripts' flag for a LoRA without text-encoder modules
        "ss_network_train_unet_only": str(not lora.text_encoder),
        "ss_steps": str(step),
        "ss_output_name": run,
        "ss_sd_model_name": model.pretrained,
        "ss_v2": "False",
    } | ({"ss_network_args": json.dumps(args)} if (args := network_args(lora)) else {}) | (
        {
            "raytuner.text_encoder_rank": str(lora.text_rank),
            "raytuner.text_encoder_alpha": str(lora.text_alpha),
        }
        if lora.text_encoder
        else {}
    )


def network_args(lora) -> dict[str, str]:
    """sd-scripts' ``--network_args`` as LyCORIS writes them (``ss_network_args``)."""
    if lora.kind == "lora":
        return {"use_dora": "true"} if lora.dora else {}
    out = {"algo": lora.kind}
    out |= {"rank_dropout": str(lora.rank_dropout), "module_dropout": str(lora.module_dropout)}
    if lora.kind == "lokr":
        out |= {"factor": str(lora.factor or -1), "decompose_both": str(lora.decompose_both)}
    return out


def family_metadata(family, meta: dict[str, str], now: float | None = None) -> dict[str, str]:
    """The keys the UIs read that depend on the family: ``ss_base_model_version``, sd-scripts'
    network module (LyCORIS' for LoKr / LoHa) and the model-spec keys (none where the family
    has no model-spec id)."""
    files, now = family.adapters.files, time.time() if now is None else now
    module = files.network_module if meta.get(KIND, "lora") == "lora" else LYCORIS_MODULE
    out = {"ss_network_module": module, "ss_training_finished_at": str(now)}
    if files.base_model_version:
        out["ss_base_model_version"] = files.base_model_version
    if files.architecture:
        side = family.geometry.default_resolution
        out |= {
            "modelspec.sai_model_spec": MODELSPEC_VERSION,
            "modelspec.architecture": f"{files.architecture}/lora",
            "modelspec.implementation": files.implementation,
            "modelspec.implementation_version": f"raytuner/{__version__}",
            "modelspec.title": meta.get("raytuner.run", "LoRA"),
            "modelspec.resolution": f"{side}x{side}",
            "modelspec.date": datetime.datetime.fromtimestamp(int(now)).isoformat(),
        }
    return out


def out_dims(denoiser: torch.nn.Module) -> dict[str, int]:
    """Each linear / conv module's output features (a fused kohya linear's pieces' sizes)."""
    dims = {}
    for name, module in denoiser.named_modules():
        layer = getattr(module, "base_layer", module)  # a peft LoRA layer wraps its linear
        if isinstance(layer, torch.nn.Linear):
            dims[name] = layer.out_features
        elif isinstance(layer, torch.nn.Conv2d):
            dims[name] = layer.out_channels
    return dims


def kohya_names(family, denoiser: torch.nn.Module):
    """The family's kohya layout for this denoiser; None where the family writes no kohya file."""
    names = family.adapters.kohya_names
    return names(denoiser.config) if names else None


def _add_metadata(path: str, meta: dict[str, str]) -> None:
    with safe_open(path, framework="pt") as f:
        existing = f.metadata() or {}
    tensors = load_file(path)
    save_file(tensors, path + ".tmp", metadata=existing | meta)
    os.replace(path + ".tmp", path)


def saved(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """The tensors in the save dtype ``dtype`` (``lora.save_dtype``); a value beyond its range
    (float16: 65504) is refused rather than written as infinity."""
    out = {k: v.to(DTYPES[dtype]) for k, v in tensors.items()}
    for key, value in out.items():
        if torch.isfinite(tensors[key]).all() and not torch.isfinite(value).all():
            peak = tensors[key].abs().max().item()
            raise ValueError(
                f"lora.save_dtype = {dtype!r}: {key} holds {peak:.4g}, beyond {dtype}'s range; "
                'set lora.save_dtype = "bfloat16" or "float32"'
            )
    return out


def _rooted(state: dict, root: str) -> dict:
    """A text encoder's peft state named from ``root`` (its ``TextEncoderLora.root``: CLIP's
    ``text_model.``, which transformers 5's CLIPTextModel lacks), as diffusers writes it and
    every loader reads it."""
    return {k if k.startswith(root) else root + k: v for k, v in state.items()}


def comfy_keys(family, denoiser, modules):
    """How the LyCORIS file names each of ``modules`` (module -> key), or None where the family
    has no name ComfyUI maps: the family's kohya names where its kohya layout names every one
    of them alone (sd-scripts' LyCORIS files: SD1.5, SDXL), else its ``files.lycoris`` template
    (``lycoris_<diffusers module>``, SimpleTuner's, for a kohya layout that fuses modules: a
    Kronecker or Hadamard product of pieces is none of the fused linear)."""
    names = kohya_names(family, denoiser)
    if names is not None:
        table = {m: (names(m) or [("", ())])[0] for m in modules}
        if all(pieces == (m,) for m, (_, pieces) in table.items()):
            return lambda m: table[m][0]
    template = family.adapters.files.lycoris
    if not template:
        return None
    return lambda m: template.format(module=m, flat=m.replace(".", "_"))


def write_lora(
    directory: str,
    lora_state: dict,
    *,
    family,
    adapter_config: dict,
    meta: dict,
    denoiser,
    text_encoders=(),
    dora_scale: dict | None = None,
) -> None:
    """The family's layouts into ``directory``, each with ``meta`` and the family's keys, their
    tensors in the dtype ``meta`` names (``SAVE_DTYPE``; float32 when it names none);
    ``adapter_config``: the peft config as a dict, so loaders apply the trained alpha /
    rank scale; ``denoiser``: the model the LoRA is on (its module sizes and config);
    ``text_encoders``: (``TextEncoderLora``, peft state, adapter config) of each trained text
    encoder (``lora.text_encoder``): ``text_encoder.*`` / ``text_encoder_2.*`` keys in the
    diffusers file, ``lora_te_*`` / ``lora_te1_*`` / ``lora_te2_*`` in the kohya file.
    A LoKr, LoHa or DoRA (``dora_scale``: its ComfyUI scales, ``lycoris.dora_scales``) gets the
    LyCORIS layout (``lycoris.to_lycoris``) in place of sd-scripts' LoRA layout."""
    meta = meta | family_metadata(family, meta)
    dtype = meta.setdefault(SAVE_DTYPE, "float32")
    lora_state = saved(lora_state, dtype)
    text = [(spec, saved(state, dtype), config) for spec, state, config in text_encoders]
    layers = {spec.part: (_rooted(state, spec.root), config) for spec, state, config in text}
    family.save_lora(directory, lora_state, adapter_config, layers)
    _add_metadata(os.path.join(directory, DIFFUSERS_FILE), meta)
    plain = all(".lora_A." in k or ".lora_B." in k for k in lora_state)
    tensors = _kohya(lora_state, family, adapter_config, denoiser, text) if plain else None
    if not plain:
        keys = comfy_keys(family, denoiser, lycoris.grouped(lora_state))
        if keys is None:
            return
        alpha = adapter_config.get("lora_alpha", adapter_config.get("alpha"))
        tensors = lycoris.to_lycoris(
            lora_state, keys, alpha=alpha, rank=adapter_config["r"], dora_scale=dora_scale
        )
    if tensors is None:
        return
    path = os.path.join(directory, KOHYA_FILE)
    save_file(saved(tensors, dtype), path + ".tmp", metadata=meta)
    os.replace(path + ".tmp", path)


def _kohya(lora_state, family, adapter_config, denoiser, text) -> dict | None:
    """sd-scripts' layout of a LoRA (and its text encoders'), None where the family has none."""
    names = kohya_names(family, denoiser)
    if names is None:
        return None
    alpha = adapter_config["lora_alpha"]
    tensors = kohya.to_kohya(lora_state, names, alpha, out_dims(denoiser))
    for spec, state, config in text:
        te_names = kohya.text_names(spec.kohya, spec.root)
        tensors |= kohya.to_kohya(state, te_names, config["lora_alpha"], {})
    return tensors
