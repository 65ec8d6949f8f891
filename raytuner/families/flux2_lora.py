"""FLUX.2's LoRA in Black Forest Labs' module names: the layout of ``lora_kohya.safetensors``
(``lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight``, ``….alpha``), as musubi-tuner
writes FLUX.2 LoRAs, diffusers' ``Flux2LoraLoaderMixin`` converts them
(``_convert_kohya_flux2_lora_to_diffusers``) and ComfyUI maps ``lora_unet_<BFL name>`` onto its
FLUX.2 model; the one layout both tools read with its alpha (diffusers' loader refuses ``.alpha``
keys in the others, ComfyUI reads no alpha from a diffusers file's metadata). ai-toolkit writes
the same names under ``diffusion_model.`` with ``lora_A`` / ``lora_B``: ``lora.init_from``
reads both.

The double blocks' q, k and v (image and text stream) are one fused ``qkv`` linear there, so
their LoRAs are written as one of rank 3r (``raytuner.lora.kohya``); a single block's fused
q/k/v/MLP input is one linear in both namings.
"""

from __future__ import annotations

import re

from raytuner.lora import kohya

# diffusers' names inside a double block -> BFL's; a tuple: the pieces of one fused linear
DOUBLE = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "img_attn.proj": "attn.to_out.0",
    "txt_attn.proj": "attn.to_add_out",
    "img_mlp.0": "ff.linear_in",
    "img_mlp.2": "ff.linear_out",
    "txt_mlp.0": "ff_context.linear_in",
    "txt_mlp.2": "ff_context.linear_out",
}
SINGLE = {"linear1": "attn.to_qkv_mlp_proj", "linear2": "attn.to_out"}
# outside the blocks (the names diffusers' converter knows; the shared modulations and the
# guidance embedder too, by BFL's names); norm_out.linear has none: its halves are swapped there
OUTER = {
    "img_in": "x_embedder",
    "txt_in": "context_embedder",
    "final_layer.linear": "proj_out",
    "time_in.in_layer": "time_guidance_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_guidance_embed.timestep_embedder.linear_2",
    "guidance_in.in_layer": "time_guidance_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.lin": "double_stream_modulation_img.linear",
    "double_stream_modulation_txt.lin": "double_stream_modulation_txt.linear",
    "single_stream_modulation.lin": "single_stream_modulation.linear",
}


def _table() -> dict[str, tuple[str, tuple[str, ...]]]:
    """diffusers' module (``double.attn.to_q``, ``x_embedder``) -> (BFL's linear, its pieces)."""
    table = {}
    for where, names in (("double.", DOUBLE), ("single.", SINGLE), ("", OUTER)):
        for bfl, modules in names.items():
            pieces = modules if isinstance(modules, tuple) else (modules,)
            for module in pieces:
                table[where + module] = (bfl, pieces)
    return table


_TABLE = _table()


def kohya_names(module: str) -> list[tuple[str, tuple[str, ...]]]:
    """The BFL name (``lora_unet_``, dots as underscores) of the linear holding ``module`` and
    the diffusers modules fused there; [] for a module it has none for."""
    if module in _TABLE:
        bfl, pieces = _TABLE[module]
        return [(kohya.PREFIX + bfl.replace(".", "_"), pieces)]
    m = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)", module)
    if m is None:
        return []
    blocks, i, inner = m.groups()
    kind = "double" if blocks == "transformer_blocks" else "single"
    if f"{kind}.{inner}" not in _TABLE:
        return []
    bfl, pieces = _TABLE[f"{kind}.{inner}"]
    name = f"{kohya.PREFIX}{kind}_blocks_{i}_{bfl.replace('.', '_')}"
    return [(name, tuple(f"{blocks}.{i}.{p}" for p in pieces))]


def names(config) -> kohya.Names:
    """BFL's names, the same for every FLUX.2 transformer config."""
    return kohya_names
