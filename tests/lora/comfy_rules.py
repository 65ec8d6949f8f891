"""ComfyUI's rules for a LoRA / LyCORIS file, written from its source (Comfy-Org/ComfyUI at
commit 2025-10-12 ``comfy/lora.py``: ``model_lora_keys_unet``, ``load_lora``,
``calculate_weight``; ``comfy/weight_adapter/lora.py``, ``lokr.py``, ``loha.py`` and
``base.py``'s ``weight_decompose``; for Wan, Qwen-Image and FLUX.2 the ``comfy/lora.py`` of
commit 17358c8f73b5 and ``comfy/utils.py``'s ``flux_to_diffusers`` of 09708eae709a, 2026), to
check raytuner's files against without ComfyUI:

- which keys its loader maps to a weight of the model (``accepted``), per model branch of
  ``model_lora_keys_unet``, from the diffusers module names (ComfyUI's converters
  ``unet_to_diffusers`` / ``flux_to_diffusers`` / ``z_image_to_diffusers`` cover every weight of
  those models: a q/k/v of Flux or Z-Image maps to its rows of the fused linear, which is the
  same rows as the diffusers module's own weight), plus the names of its own state dict
  (``lora_unet_<name>``), which for SDXL and Flux are sd-scripts' names: the families' kohya
  tables, themselves checked against diffusers' kohya converters (test_lora_files.py);
  Wan's keys are ComfyUI's generic rule for every model (``diffusion_model.<its module>`` and
  ``lora_unet_<its module>``) on the names of ComfyUI's Wan model (``comfy/ldm/wan/model.py``:
  ``blocks.<i>.self_attn.q``), which diffusers' own converter of Wan checkpoints
  (``convert_wan_transformer_to_diffusers``) ties to the diffusers modules (``wan_native``);
  Qwen-Image's are its ``QwenImage`` branch (its model's names are diffusers'); LTX-2's the
  rule of every model on its blocks, whose names in ComfyUI's LTX-2 model are diffusers'
  (``comfy/ldm/lightricks/model.py`` at e03185cf, ``av_model.py`` at 0a29ddae, 2026); FLUX.2 is a
  ``Flux`` model there, so its branch is Flux's, ``flux_to_diffusers`` mapping FLUX.2's
  diffusers names too (``FLUX_DIFFUSERS``: the modules that map names);
- which tensor names each adapter reads after such a key (a key it reads no tensor of is one
  ComfyUI logs as "lora key not loaded");
- the weight each adapter makes of the base weight (``comfy_weight``), strength 1.
"""

from __future__ import annotations

import re

import torch

# ComfyUI's model branch of each family (a family of another branch needs its rules here);
# Sana has none: ComfyUI has no Sana model (custom nodes only)
BRANCH = {
    "sd15": "unet",
    "sdxl": "unet",
    "flux": "flux",
    "z-image": "lumina2",
    "flux2-klein": "flux",
    "flux2-dev": "flux",
    "qwen-image": "qwen",
    "qwen-image-edit": "qwen",  # ComfyUI loads Qwen-Image-Edit as a QwenImage model
    "wan": "native",
    "ltx2": "lightricks",
}
# the diffusers modules flux_to_diffusers maps (Flux.1's and FLUX.2's names; its q/k/v of a
# block onto their rows of the fused qkv / linear1), besides the outer ones of FLUX_OUTER
_DOUBLE = r"attn\.(to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)|norm1(_context)?\.linear"
_DOUBLE += r"|ff(_context)?\.(net\.0\.proj|net\.2|linear_in|linear_out)"
_SINGLE = r"attn\.(to_[qkv]|to_qkv_mlp_proj|to_out)|proj_mlp|proj_out|norm\.linear"
FLUX_DIFFUSERS = re.compile(
    rf"transformer_blocks\.\d+\.({_DOUBLE})|single_transformer_blocks\.\d+\.({_SINGLE})"
    r"|proj_out|x_embedder|context_embedder|norm_out\.linear"
    r"|time_text_embed\.(timestep|text|guidance)_embedder\.linear_[12]"
)
# ComfyUI's Wan model's modules (comfy/ldm/wan/model.py) a LoRA of raytuner may be on
WAN_BLOCK = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q")
WAN_BLOCK += ("cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")
WAN_OUTER = ("text_embedding.0", "text_embedding.2", "time_embedding.0", "time_embedding.2")
WAN_OUTER += ("time_projection.1", "head.head")
SUFFIXES = {
    "lora": ("lora_up.weight", "lora_down.weight", "lora_A.weight", "lora_B.weight"),
    "lokr": ("lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_t2"),
    "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2"),
    "common": ("alpha", "dora_scale"),
}


def wan_native(num_layers: int) -> dict[str, str]:
    """ComfyUI's Wan module (``blocks.0.self_attn.q``) -> the diffusers module diffusers' own
    converter of Wan checkpoints makes of it, for a transformer of ``num_layers`` blocks."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    natives = [f"blocks.{i}.{m}" for i in range(num_layers) for m in WAN_BLOCK] + list(WAN_OUTER)
    checkpoint = {f"{n}.weight": torch.tensor([float(i)]) for i, n in enumerate(natives)}
    converted = convert_wan_transformer_to_diffusers(dict(checkpoint))
    by_value = {int(v.item()): k.removesuffix(".weight") for k, v in converted.items()}
    return {n: by_value[i] for i, n in enumerate(natives)}


def accepted(family_name: str, modules, kohya_names=None, wan_layers: int = 0) -> dict[str, str]:
    """ComfyUI's key -> the diffusers module whose weight it patches, for a denoiser of these
    module names (``kohya_names``: the family's sd-scripts names, ComfyUI's own for SDXL/Flux;
    ``wan_layers``: a Wan transformer's blocks)."""
    branch, out = BRANCH[family_name], {}
    if branch == "native":  # the rule of every model: diffusion_model.<its name>, lora_unet_
        for native, m in wan_native(wan_layers).items():
            out |= {f"diffusion_model.{native}": m, f"lora_unet_{native.replace('.', '_')}": m}
        return out
    for m in modules:
        flat = m.replace(".", "_")
        if branch == "unet":  # unet_to_diffusers: lora_unet_ and SimpleTuner's lycoris_
            out |= {f"lora_unet_{flat}": m, f"lycoris_{flat}": m}
        elif branch == "flux" and FLUX_DIFFUSERS.fullmatch(m):
            # flux_to_diffusers: transformer., lycoris_, lora_transformer_, DiffSynth's bare
            out |= {f"transformer.{m}": m, f"lycoris_{flat}": m, f"lora_transformer_{flat}": m}
        elif branch == "lumina2":  # z_image_to_diffusers: diffusion_model. and transformer.
            out |= {f"diffusion_model.{m}": m, f"transformer.{m}": m}
        elif branch == "lightricks" and m.startswith("transformer_blocks."):
            # the rule of every model; its LTX-2 model's blocks have diffusers' names
            # (comfy/ldm/lightricks/model.py, av_model.py: attn1.to_q, ff.net.0.proj, ...),
            # its outer modules not (patchify_proj, adaln_single)
            out |= {f"diffusion_model.{m}": m, f"lora_unet_{flat}": m}
        elif branch == "qwen":  # its QwenImage branch and the rule of every model
            out |= {m: m, f"transformer.{m}": m, f"lycoris_{flat}": m}
            out |= {f"diffusion_model.{m}": m, f"lora_unet_{flat}": m}
        if kohya_names is not None:
            for name, pieces in kohya_names(m):
                if pieces == (m,):  # ComfyUI's own weight: one module alone
                    out[name] = m
    return out


def loaded(tensors: dict, keys: dict[str, str]) -> dict[str, dict[str, torch.Tensor]]:
    """``load_lora``: each accepted key's tensors by their own name; AssertionError naming the
    file's keys ComfyUI would not load."""
    every = {s for group in SUFFIXES.values() for s in group}
    out: dict[str, dict] = {}
    for key, value in tensors.items():
        # the key whose rest is a tensor name ComfyUI reads (``to_out`` is no key of ``to_out.0``)
        known = [p for p in keys if key.startswith(p + ".") and key[len(p) + 1 :] in every]
        assert known, f"ComfyUI would not load {key}"
        prefix = max(known, key=len)
        suffix = key[len(prefix) + 1 :]
        out.setdefault(keys[prefix], {})[suffix] = value.float()
    return out


def comfy_weight(weight: torch.Tensor, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight ComfyUI's adapter makes of ``weight`` from a key's tensors ``t``, strength 1."""
    alpha = t.get("alpha")
    w = weight.float()
    if "lokr_w1" in t or "lokr_w1_a" in t or "lokr_w2" in t:
        dim = None
        w1 = t.get("lokr_w1")
        if w1 is None:
            dim, w1 = t["lokr_w1_b"].shape[0], t["lokr_w1_a"] @ t["lokr_w1_b"]
        w2 = t.get("lokr_w2")
        if w2 is None:
            dim, w2 = t["lokr_w2_b"].shape[0], t["lokr_w2_a"] @ t["lokr_w2_b"]
        if w2.dim() == 4:
            w1 = w1[:, :, None, None]
        scale = float(alpha) / dim if alpha is not None and dim is not None else 1.0
        diff = torch.kron(w1, w2).reshape(w.shape)
    elif "hada_w1_a" in t:
        scale = float(alpha) / t["hada_w1_b"].shape[0] if alpha is not None else 1.0
        m1, m2 = t["hada_w1_a"] @ t["hada_w1_b"], t["hada_w2_a"] @ t["hada_w2_b"]
        diff = (m1 * m2).reshape(w.shape)
    else:
        up, down = (
            t.get("lora_up.weight", t.get("lora_B.weight")),
            t.get("lora_down.weight", t.get("lora_A.weight")),
        )
        scale = float(alpha) / down.shape[0] if alpha is not None else 1.0
        diff = (up.flatten(1) @ down.flatten(1)).reshape(w.shape)
    if "dora_scale" not in t:
        return w + scale * diff
    return _weight_decompose(t["dora_scale"], w, diff * scale, weight.dtype)


def _weight_decompose(dora_scale, weight, diff, dtype) -> torch.Tensor:
    """``weight_decompose``: a scale whose first side is the output rows divides by the base
    weight's row norms; any other by the merged weight's column norms; plus the dtype's eps."""
    merged = weight + diff
    if dora_scale.shape[0] == merged.shape[0]:
        norm = weight.reshape(weight.shape[0], -1).norm(dim=1, keepdim=True)
        norm = norm.reshape(weight.shape[0], *[1] * (weight.dim() - 1))
    else:
        cols = merged.transpose(0, 1).reshape(merged.shape[1], -1).norm(dim=1, keepdim=True)
        norm = cols.reshape(merged.shape[1], *[1] * (merged.dim() - 1)).transpose(0, 1)
    norm = norm + torch.finfo(dtype).eps
    return merged * (dora_scale / norm)
