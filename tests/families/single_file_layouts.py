"""Diffusers models written in the original single-file key layouts, the inverse of what
diffusers' single-file loaders read (and, for Flux, of raytuner's BFL conversion): LDM for SD1.5
(``model.diffusion_model.``, ``first_stage_model.``, ``cond_stage_model.``), Stability's SGM
for SDXL (``conditioner.embedders.0.`` CLIP-L, ``.1.`` OpenCLIP), Black Forest Labs' for the
Flux transformer. Written for the tiny test models (``tests/families/test_single_file.py``)."""

from __future__ import annotations

import torch
from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

_RESNET = {  # a UNet resnet's diffusers name -> LDM's
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}


def _unet_block(block: str, kind: str, rest: list[str]) -> str:
    if kind == "resnets":
        return f"{block}.0.{_RESNET['.'.join(rest[:-1])]}.{rest[-1]}"
    return f"{block}.1.{'.'.join(rest)}"


def ldm_unet(state: dict, layers: int) -> dict:
    """A diffusers UNet2DConditionModel's tensors under LDM's ``model.diffusion_model.`` names."""
    fixed = DIFFUSERS_TO_LDM_MAPPING["unet"]["layers"]
    fixed = fixed | DIFFUSERS_TO_LDM_MAPPING["unet"]["addition_embed_type"]  # SDXL's label_emb
    out = {}
    for key, tensor in state.items():
        p = key.split(".")
        if key in fixed:
            name = fixed[key]
        elif p[0] == "down_blocks" and p[2] == "downsamplers":
            name = f"input_blocks.{(int(p[1]) + 1) * (layers + 1)}.0.op.{p[-1]}"
        elif p[0] == "down_blocks":
            index = 1 + int(p[1]) * (layers + 1) + int(p[3])
            name = _unet_block(f"input_blocks.{index}", p[2], p[4:])
        elif p[0] == "mid_block" and p[1] == "resnets":
            name = f"middle_block.{2 * int(p[2])}.{_RESNET['.'.join(p[3:-1])]}.{p[-1]}"
        elif p[0] == "mid_block":
            name = f"middle_block.1.{'.'.join(p[3:])}"
        elif p[0] == "up_blocks" and p[2] == "upsamplers":
            attention = any(k.startswith(f"up_blocks.{p[1]}.attentions.") for k in state)
            index = int(p[1]) * (layers + 1) + layers
            name = f"output_blocks.{index}.{2 if attention else 1}.conv.{p[-1]}"
        else:
            index = int(p[1]) * (layers + 1) + int(p[3])
            name = _unet_block(f"output_blocks.{index}", p[2], p[4:])
        out[f"model.diffusion_model.{name}"] = tensor
    return out


_VAE_ATTENTION = {
    "group_norm": "norm",
    "to_q": "q",
    "to_k": "k",
    "to_v": "v",
    "to_out.0": "proj_out",
}


def ldm_vae(state: dict) -> dict:
    """A diffusers AutoencoderKL's tensors under LDM's ``first_stage_model.`` names (attention
    projections as 1x1 convolutions, as the originals store them)."""
    fixed = DIFFUSERS_TO_LDM_MAPPING["vae"]
    ups = len({k.split(".")[2] for k in state if k.startswith("decoder.up_blocks.")})
    out = {}
    for key, tensor in state.items():
        p = key.split(".")
        resnet = ".".join(p[5:]).replace("conv_shortcut", "nin_shortcut")
        if key in fixed:
            name = fixed[key]
        elif p[1] == "down_blocks" and p[3] == "resnets":
            name = f"encoder.down.{p[2]}.block.{p[4]}.{resnet}"
        elif p[1] == "down_blocks":
            name = f"encoder.down.{p[2]}.downsample.conv.{p[-1]}"
        elif p[1] == "up_blocks" and p[3] == "resnets":
            name = f"decoder.up.{ups - 1 - int(p[2])}.block.{p[4]}.{resnet}"
        elif p[1] == "up_blocks":
            name = f"decoder.up.{ups - 1 - int(p[2])}.upsample.conv.{p[-1]}"
        elif p[2] == "resnets":
            rest = ".".join(p[4:]).replace("conv_shortcut", "nin_shortcut")
            name = f"{p[0]}.mid.block_{int(p[3]) + 1}.{rest}"
        else:
            sub = ".".join(p[4:-1])
            name = f"{p[0]}.mid.attn_1.{_VAE_ATTENTION[sub]}.{p[-1]}"
            if p[-1] == "weight" and sub != "group_norm":
                tensor = tensor[:, :, None, None]
        out[f"first_stage_model.{name}"] = tensor
    return out


def ldm_clip(state: dict, prefix: str = "cond_stage_model.") -> dict:
    """A transformers CLIPTextModel's tensors under LDM's ``cond_stage_model.`` names (SGM's
    first text encoder: ``conditioner.embedders.0.``)."""
    own = f"{prefix}transformer.text_model."
    return {own + k.removeprefix("text_model."): v for k, v in state.items()}


_OPEN_CLIP = {  # a layer's diffusers name -> OpenCLIP's
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
    "self_attn.out_proj": "attn.out_proj",
}


def sgm_open_clip(state: dict) -> dict:
    """A transformers CLIPTextModelWithProjection's tensors as SDXL's OpenCLIP text encoder under
    ``conditioner.embedders.1.model.`` (q, k, v fused into ``in_proj``, the projection
    transposed)."""
    prefix = "conditioner.embedders.1.model."
    fixed = DIFFUSERS_TO_LDM_MAPPING["openclip"]["layers"]
    out = {prefix + fixed[k]: v for k, v in state.items() if k in fixed}
    out[prefix + "text_projection"] = state["text_projection.weight"].T.contiguous()
    layers = {k.split(".")[3] for k in state if k.startswith("text_model.encoder.layers.")}
    for i in layers:
        own, ldm = f"text_model.encoder.layers.{i}.", f"{prefix}transformer.resblocks.{i}."
        for key, tensor in state.items():
            stem, _, leaf = key.removeprefix(own).rpartition(".")
            if key.startswith(own) and stem in _OPEN_CLIP:
                out[f"{ldm}{_OPEN_CLIP[stem]}.{leaf}"] = tensor
        for leaf, name in (("weight", "in_proj_weight"), ("bias", "in_proj_bias")):
            qkv = [state[f"{own}self_attn.{p}_proj.{leaf}"] for p in "qkv"]
            out[f"{ldm}attn.{name}"] = torch.cat(qkv)
    return out


_FLUX_TOP = {
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "context_embedder": "txt_in",
    "x_embedder": "img_in",
    "proj_out": "final_layer.linear",
}
_FLUX_DOUBLE = {
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
    "attn.norm_q": "img_attn.norm.query_norm",
    "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm",
    "attn.norm_added_k": "txt_attn.norm.key_norm",
}
_FLUX_SINGLE = {
    "norm.linear": "modulation.lin",
    "proj_out": "linear2",
    "attn.norm_q": "norm.query_norm",
    "attn.norm_k": "norm.key_norm",
}
_FUSED = {  # BFL's fused tensor -> the diffusers tensors it concatenates, in order
    "double_blocks": {
        "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
        "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    },
    "single_blocks": {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")},
}


def bfl_flux(state: dict) -> dict:
    """A diffusers FluxTransformer2DModel's tensors under BFL's names (norm scales as ``scale``,
    q/k/v fused, the final modulation as (shift, scale))."""
    out = {}
    for key, tensor in state.items():
        stem, leaf = key.rsplit(".", 1)
        if stem in _FLUX_TOP:
            out[f"{_FLUX_TOP[stem]}.{leaf}"] = tensor
        elif stem == "norm_out.linear":
            scale, shift = tensor.chunk(2)
            out[f"final_layer.adaLN_modulation.1.{leaf}"] = torch.cat([shift, scale])
    for diffusers, bfl, table in (
        ("transformer_blocks", "double_blocks", _FLUX_DOUBLE),
        ("single_transformer_blocks", "single_blocks", _FLUX_SINGLE),
    ):
        blocks = {k.split(".")[1] for k in state if k.startswith(diffusers + ".")}
        for i in blocks:
            own = f"{diffusers}.{i}."
            for key, tensor in state.items():
                if not key.startswith(own):
                    continue
                stem, leaf = key.removeprefix(own).rsplit(".", 1)
                if stem in table:
                    norm = stem.startswith("attn.norm_")
                    out[f"{bfl}.{i}.{table[stem]}.{'scale' if norm else leaf}"] = tensor
            for fused, names in _FUSED[bfl].items():
                for leaf in ("weight", "bias"):
                    pieces = [state[f"{own}{n}.{leaf}"] for n in names]
                    out[f"{bfl}.{i}.{fused}.{leaf}"] = torch.cat(pieces)
    return out
