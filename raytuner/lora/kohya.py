"""The kohya (sd-scripts) key layouts of a denoiser LoRA, both ways.

A kohya LoRA names each adapted module ``lora_unet_<module, dots as underscores>`` and stores
``lora_down.weight`` (A), ``lora_up.weight`` (B) and ``alpha``; a loader applies
``alpha / rank x up @ down`` with rank = the rows of ``lora_down``. Which module a name means is
the layout's business:

- ``"unet"``: the diffusers module name itself (SD1.5: sd-scripts' own UNet uses these names);
- ``"sgm"``: SDXL as sd-scripts writes it, in Stability's ``sgm`` block names
  (``input_blocks_4_1_transformer_blocks_0_attn1_to_q``); the diffusers names are read too;
- ``"flux"``: Flux as sd-scripts writes it, in Black Forest Labs' names
  (``double_blocks_0_img_attn_qkv``, ``single_blocks_0_linear1``), where one fused linear holds
  several diffusers modules (q, k, v; q, k, v and the MLP's input in a single block).

A fused linear carries its pieces' rank-r LoRAs as one of rank n x r: the pieces' downs stacked,
their ups block-diagonal (as sd-scripts' ``split_qkv`` saves them), a piece the run did not train
as zeros, and alpha n x the trained alpha, so that every loader's ``alpha / rank`` is the trained
``alpha / r`` (diffusers' converter then splits it back into the pieces exactly).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch

PREFIX = "lora_unet_"
# module name -> its kohya names (the first is the one written) and the modules fused there
Names = Callable[[str], list[tuple[str, tuple[str, ...]]]]


def _flat(module: str) -> str:
    return PREFIX + module.replace(".", "_")


def unet_names(module: str) -> list[tuple[str, tuple[str, ...]]]:
    return [(_flat(module), (module,))]


# the Flux transformer's diffusers modules -> Black Forest Labs' names (per block)
_FLUX_DOUBLE = {
    "attn.to_out.0": "img_attn_proj",
    "attn.to_add_out": "txt_attn_proj",
    "ff.net.0.proj": "img_mlp_0",
    "ff.net.2": "img_mlp_2",
    "ff_context.net.0.proj": "txt_mlp_0",
    "ff_context.net.2": "txt_mlp_2",
    "norm1.linear": "img_mod_lin",
    "norm1_context.linear": "txt_mod_lin",
}
_FLUX_DOUBLE_FUSED = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_FLUX_SINGLE = {"proj_out": "linear2", "norm.linear": "modulation_lin"}
_FLUX_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
_FLUX_OUTER = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in_in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in_out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in_in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in_out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in_in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in_out_layer",
    "proj_out": "final_layer_linear",
}


def flux_names(module: str) -> list[tuple[str, tuple[str, ...]]]:
    """sd-scripts' Flux names; [] for a module it has none for (``norm_out.linear``: its halves
    are in the other order there, which no converter here undoes for a LoRA)."""
    if module in _FLUX_OUTER:
        return [(PREFIX + _FLUX_OUTER[module], (module,))]
    m = re.fullmatch(r"(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)", module)
    if m is None:
        return []
    blocks, i, inner = m.groups()
    double = blocks == "transformer_blocks"
    plain, fused = (
        (_FLUX_DOUBLE, _FLUX_DOUBLE_FUSED) if double else (_FLUX_SINGLE, _FLUX_SINGLE_FUSED)
    )
    head = f"{PREFIX}{'double' if double else 'single'}_blocks_{i}_"
    if inner in plain:
        return [(head + plain[inner], (module,))]
    for name, pieces in fused.items():
        if inner in pieces:
            return [(head + name, tuple(f"{blocks}.{i}.{p}" for p in pieces))]
    return []


_RESNET = {"conv1": "in_layers.2", "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1"}
_RESNET |= {"conv_shortcut": "skip_connection", "norm1": "in_layers.0", "norm2": "out_layers.0"}
_SGM_OUTER = {
    "conv_in": "input_blocks.0.0",
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "add_embedding.linear_1": "label_emb.0.0",
    "add_embedding.linear_2": "label_emb.0.2",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
}


def sgm_names(config) -> Names:
    """SDXL's sgm block names for a UNet of this config (``layers_per_block`` resnets a down
    block, one more an up block), as sd-scripts writes them; the diffusers names too."""
    per = config.layers_per_block
    attn_up = ["CrossAttn" in t for t in config.up_block_types]

    def sgm(module: str) -> str | None:
        if module in _SGM_OUTER:
            return _SGM_OUTER[module]
        if m := re.fullmatch(r"down_blocks\.(\d+)\.(attentions|resnets)\.(\d+)\.(.+)", module):
            i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
            rest = _RESNET.get(rest, rest) if kind == "resnets" else rest
            return f"input_blocks.{1 + i * (per + 1) + j}.{int(kind == 'attentions')}.{rest}"
        if m := re.fullmatch(r"down_blocks\.(\d+)\.downsamplers\.0\.conv", module):
            return f"input_blocks.{(int(m[1]) + 1) * (per + 1)}.0.op"
        if m := re.fullmatch(r"mid_block\.(attentions|resnets)\.(\d+)\.(.+)", module):
            kind, j, rest = m[1], int(m[2]), m[3]
            if kind == "attentions":
                return f"middle_block.1.{rest}"
            return f"middle_block.{2 * j}.{_RESNET.get(rest, rest)}"
        if m := re.fullmatch(r"up_blocks\.(\d+)\.(attentions|resnets)\.(\d+)\.(.+)", module):
            i, kind, j, rest = int(m[1]), m[2], int(m[3]), m[4]
            rest = _RESNET.get(rest, rest) if kind == "resnets" else rest
            return f"output_blocks.{i * (per + 1) + j}.{int(kind == 'attentions')}.{rest}"
        if m := re.fullmatch(r"up_blocks\.(\d+)\.upsamplers\.0\.conv", module):
            i = int(m[1])
            return f"output_blocks.{i * (per + 1) + per}.{1 + attn_up[i]}.conv"
        return None

    def names(module: str) -> list[tuple[str, tuple[str, ...]]]:
        name = sgm(module)
        return ([(_flat(name), (module,))] if name else []) + unet_names(module)

    return names


def layout(kind: str, config) -> Names:
    """The family's ``lora_files.kohya`` layout for a denoiser of this config."""
    if kind == "sgm":
        return sgm_names(config)
    return {"unet": unet_names, "flux": flux_names}[kind]


def modules_of(state: dict[str, torch.Tensor]) -> list[str]:
    """The modules of a peft LoRA state (``<module>.lora_A.weight`` ...), in order."""
    return list(dict.fromkeys(k.rsplit(".lora_", 1)[0] for k in state if ".lora_" in k))


def to_kohya(state: dict, names: Names, alpha: float, out_dims: dict[str, int]) -> dict:
    """A peft LoRA state of the denoiser -> kohya tensors; ``out_dims``: each module's output
    features (a fused linear needs its untrained pieces' sizes too)."""
    out, done = {}, set()
    for module in modules_of(state):
        candidates = names(module)
        if not candidates:
            raise ValueError(f"the kohya layout has no name for the LoRA on {module}")
        name, pieces = candidates[0]
        if name in done:
            continue
        done.add(name)
        downs = [state.get(f"{p}.lora_A.weight") for p in pieces]
        ups = [state.get(f"{p}.lora_B.weight") for p in pieces]
        if len(pieces) == 1:
            down, up = downs[0], ups[0]
        else:
            down, up = _stack([d for d in downs if d is not None][0], downs, ups, pieces, out_dims)
        out[f"{name}.lora_down.weight"] = down.contiguous()
        out[f"{name}.lora_up.weight"] = up.contiguous()
        out[f"{name}.alpha"] = torch.tensor(float(alpha) * len(pieces))
    return out


def _stack(like: torch.Tensor, downs, ups, pieces, out_dims):
    """Rank-r LoRAs of the pieces of one fused linear -> one of rank n x r."""
    r = like.shape[0]
    down = torch.cat([d if d is not None else torch.zeros_like(like) for d in downs])
    dims = [out_dims[p] for p in pieces]
    up = like.new_zeros(sum(dims), r * len(pieces))
    row = 0
    for j, (piece_up, dim) in enumerate(zip(ups, dims, strict=True)):
        if piece_up is not None:
            up[row : row + dim, j * r : (j + 1) * r] = piece_up
        row += dim
    return down, up


def reverse(names: Names, modules: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """kohya name -> the modules it holds, for every name of the model's ``modules``."""
    table = {}
    for module in modules:
        for name, pieces in names(module):
            table.setdefault(name, pieces)
    return table


def from_kohya(tensors: dict, table: dict, out_dims: dict[str, int]) -> dict:
    """kohya tensors -> {module: (down, up, alpha)} with ``alpha / rank`` of each the scale a
    kohya loader applies. Raises ValueError naming the kohya names the model has no module for."""
    kinds = {"lora_down.weight", "lora_up.weight", "alpha"}
    odd = sorted(k for k in tensors if k.split(".", 1)[-1] not in kinds)
    names = sorted({k.split(".", 1)[0] for k in tensors if k not in odd})
    unknown = odd + [n for n in names if n not in table]
    if unknown:
        raise ValueError(
            f"{len(unknown)} keys name no module of this model in a kohya LoRA "
            f"(e.g. {', '.join(unknown[:4])})"
        )
    out = {}
    for name in names:
        down, up = tensors[f"{name}.lora_down.weight"], tensors[f"{name}.lora_up.weight"]
        alpha = float(tensors.get(f"{name}.alpha", torch.tensor(down.shape[0])))
        pieces = table[name]
        if len(pieces) == 1:
            out[pieces[0]] = (down, up, alpha)
        else:
            out |= _split(name, down, up, alpha, pieces, out_dims)
    return out


def _split(name, down, up, alpha, pieces, out_dims) -> dict:
    """One fused linear's LoRA -> its pieces': block-diagonal ups (n x r) give rank-r pieces,
    any other (sd-scripts' default: one rank-r LoRA on the fused linear) the shared down."""
    n, rank = len(pieces), down.shape[0]
    dims = [out_dims[p] for p in pieces]
    if up.shape[0] != sum(dims):
        raise ValueError(f"{name}: lora_up has {up.shape[0]} rows, the model's {sum(dims)}")
    rows = torch.split(up, dims)
    if rank % n == 0:
        r = rank // n
        off = [torch.cat([row[:, : j * r], row[:, (j + 1) * r :]], 1) for j, row in enumerate(rows)]
        if not any(o.any() for o in off):
            downs = torch.chunk(down, n)
            blocks = [row[:, j * r : (j + 1) * r] for j, row in enumerate(rows)]
            return {p: (downs[j], blocks[j], alpha / n) for j, p in enumerate(pieces)}
    return {p: (down, rows[j], alpha) for j, p in enumerate(pieces)}
