"""The kohya (sd-scripts) file layout of a denoiser LoRA (and of a text encoder's), both ways.

A kohya LoRA names each adapted module ``lora_unet_<module, dots as underscores>`` and stores
``lora_down.weight`` (A), ``lora_up.weight`` (B) and ``alpha``; a loader applies
``alpha / rank x up @ down`` with rank = the rows of ``lora_down``. Which module a name means is
the model's business: each family's ``adapters.kohya_names`` (``unet_names`` here, the diffusers
module name itself, for SD1.5; Stability's ``sgm`` block names for SDXL in ``families/sdxl.py``;
Black Forest Labs' names for Flux in ``families/flux.py``, where one fused linear holds several
diffusers modules: q, k, v; q, k, v and the MLP's input in a single block). A text encoder's
LoRA (``lora.text_encoder``) is named ``<prefix>_<module from the CLIP's text_model>``
(``text_names``: ``lora_te_`` for SD1.5's, ``lora_te1_`` and ``lora_te2_`` for SDXL's).

A fused linear carries its pieces' rank-r LoRAs as one of rank n x r: the pieces' downs stacked,
their ups block-diagonal (as sd-scripts' ``split_qkv`` saves them), a piece the run did not train
as zeros, and alpha n x the trained alpha, so that every loader's ``alpha / rank`` is the trained
``alpha / r`` (diffusers' converter then splits it back into the pieces exactly).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

PREFIX = "lora_unet_"
# module name -> its kohya names (the first is the one written) and the modules fused there
Names = Callable[[str], list[tuple[str, tuple[str, ...]]]]


def flat(module: str) -> str:
    """A module's kohya name in the diffusers naming: ``lora_unet_`` and dots as underscores."""
    return PREFIX + module.replace(".", "_")


def unet_names(module: str) -> list[tuple[str, tuple[str, ...]]]:
    return [(flat(module), (module,))]


def text_names(prefix: str, root: str) -> Names:
    """sd-scripts' names of a text encoder's LoRA: ``<prefix>_`` and the module's path from
    ``root`` with dots as underscores (``lora_te1_text_model_encoder_layers_0_self_attn_q_proj``
    for CLIP's ``text_model.encoder.layers.0.self_attn.q_proj``: ``root`` is added to a model
    whose module names lack it)."""

    def names(module: str) -> list[tuple[str, tuple[str, ...]]]:
        path = module if module.startswith(root) else root + module
        return [(f"{prefix}_{path.replace('.', '_')}", (module,))]

    return names


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


KINDS = (".lora_down.weight", ".lora_up.weight", ".alpha")  # a kohya name's tensors


def _name(key: str) -> str | None:
    """The kohya name of a tensor's key (a name may hold dots: Wan's ``diffusion_model.``
    layout); None for a key of no kohya kind."""
    for kind in KINDS:
        if key.endswith(kind):
            return key[: -len(kind)]
    return None


def from_kohya(tensors: dict, table: dict, out_dims: dict[str, int]) -> dict:
    """kohya tensors -> {module: (down, up, alpha)} with ``alpha / rank`` of each the scale a
    kohya loader applies. Raises ValueError naming the kohya names the model has no module for."""
    odd = sorted(k for k in tensors if _name(k) is None)
    names = sorted({_name(k) for k in tensors if k not in odd})
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
