"""``lora.init_from`` of another tool's LyCORIS file (a LoKr or a LoHa): its tensors
(``<key>.lokr_w1`` / ``lokr_w1_a`` / ``lokr_w1_b``, ``lokr_w2`` / ``lokr_w2_a`` / ``lokr_w2_b``,
``hada_w1_a`` ... ``hada_w2_b``, ``.alpha``) under any key naming one of the denoiser's modules
as the trainers and ComfyUI name it:

- LyCORIS' and sd-scripts' / musubi-tuner's ``lora_unet_<module, dots as underscores>``, in the
  family's kohya names (SDXL's ``input_blocks``, BFL's ``double_blocks_0_img_attn_proj``, Wan's
  ``blocks_0_self_attn_q``) or the diffusers names;
- SimpleTuner's ``lycoris_<diffusers module, dots as underscores>``;
- ai-toolkit's and ComfyUI's ``diffusion_model.<module>``, diffusers' ``transformer.<module>``
  (or the pipeline part's name), peft's ``base_model.model.<module>`` and the bare module, in
  either naming.

Each module's tensors become the job's peft adapter's (``peft_state``), which must be of the
same kind and factorization (peft and LyCORIS share the factor shapes: ``lora.rank``,
``lora.factor`` and ``lora.decompose_both`` decide them). The scales differ: LyCORIS (and
ComfyUI) apply ``alpha / rank`` (rank: the rows of ``lokr_w2_b``, else of ``lokr_w1_b``; of
``hada_w1_b`` for a LoHa) where a factor is low-rank and an ``.alpha`` is stored, else 1 (a LoKr
with both factors whole has no scale, whatever alpha it stores); peft applies ``lora.alpha /
lora.rank``. The ratio goes into the first factor (``lokr_w1`` or ``lokr_w1_a``, ``hada_w1_a``),
so that the run starts from the weight the file makes. A LyCORIS piece of a linear the model
fuses (BFL's ``qkv``) is none of the model's modules: refused, naming the key, as is a
Tucker-decomposed convolution (``lokr_t2``, ``hada_t1``) and a DoRA (``dora_scale``).
"""

from __future__ import annotations

from raytuner.lora import export
from raytuner.lora.lycoris import LOHA, LOKR

KIND_OF = {"lokr_": "lokr", "hada_": "loha"}
TENSORS = (*LOKR, *LOHA, "alpha")  # what a key of a LoKr / LoHa holds
REFUSED = ("lokr_t2", "hada_t1", "hada_t2", "dora_scale")  # Tucker convolutions, DoRA
# the prefixes the trainers put before a module's name (the pipeline part's is added)
PREFIXES = ("lora_unet_", "lycoris_", "diffusion_model.", "base_model.model.", "lora_transformer_")


def is_lycoris(keys) -> bool:
    """A file of LyCORIS tensors (a LoKr or LoHa of any tool)."""
    return any(k.rsplit(".", 1)[-1].startswith(tuple(KIND_OF)) for k in keys)


def _flat(name: str) -> str:
    return name.replace(".", "_")


def _names(family, denoiser) -> dict[str, tuple[str, ...]]:
    """A module name as every tool writes it, dots as underscores and without its prefix ->
    the denoiser's modules it holds (one, or the pieces of a linear the model fuses)."""
    dims = export.out_dims(denoiser)
    table = {}
    kohya = export.kohya_names(family, denoiser)
    if kohya is not None:
        for module in dims:
            for name, pieces in kohya(module):
                for prefix in ("lora_unet_", "diffusion_model."):
                    table.setdefault(_flat(name.removeprefix(prefix)), pieces)
    return table | {_flat(m): (m,) for m in dims}  # the diffusers names first


def _module_key(key: str, part: str) -> str:
    """A file key's module name without a trainer's prefix, dots as underscores."""
    for prefix in (*PREFIXES, f"{part}.", f"lora_{part}_"):
        if key.startswith(prefix):
            return _flat(key.removeprefix(prefix))
    return _flat(key)


def grouped(tensors: dict, family, denoiser) -> dict[str, tuple[str, dict]]:
    """The file's tensors by the denoiser's module: {module: (the file's key, {tensor: value})};
    ValueError naming a key of no module, of a fused linear's pieces or of a kind not read."""
    names, part = _names(family, denoiser), family.parts.denoiser
    out: dict[str, tuple[str, dict]] = {}
    for key, value in tensors.items():
        base, _, tensor = key.rpartition(".")
        if tensor in REFUSED:
            raise ValueError(
                f"{key}: a Tucker-decomposed convolution or a DoRA, which lora.init_from does "
                "not read from a LyCORIS file"
            )
        if tensor not in TENSORS:
            raise ValueError(f"{key}: no LoKr or LoHa tensor (e.g. {base}.lokr_w1, .hada_w1_a)")
        pieces = names.get(_module_key(base, part))
        if pieces is None and base.startswith(("lora_te", "text_encoder")):
            raise ValueError(
                f"{key}: a text encoder's LoKr / LoHa, which lora.init_from does not read (it "
                "starts a text encoder's LoRA only): remove the text encoder's keys"
            )
        if pieces is None:
            raise ValueError(f"{key}: names no module of this model: a LyCORIS of another model")
        if len(pieces) > 1:
            raise ValueError(
                f"{key}: an adapter on the fused linear of {', '.join(pieces)}, which the model "
                "keeps apart: a Kronecker or Hadamard product of the whole is none of its pieces'"
            )
        out.setdefault(pieces[0], (base, {}))[1][tensor] = value
    return out


def file_scale(t: dict, load) -> float:
    """The scale LyCORIS and ComfyUI apply to a key's product (``load``: an alpha's value)."""
    alpha = t.get("alpha")
    low = t.get("lokr_w2_b", t.get("lokr_w1_b", t.get("hada_w1_b")))
    if alpha is None or low is None:
        return 1.0
    return float(load(alpha)) / low.shape[0]


def _same_kind(tensors: dict, lora) -> None:
    """ValueError naming a key of another kind than the job's (a LoRA or DoRA job too)."""
    for key in tensors:
        tensor = key.rpartition(".")[2]
        kind = next((k for p, k in KIND_OF.items() if tensor.startswith(p)), None)
        if kind is not None and (kind != lora.kind or lora.dora):
            job = "lora.dora = true" if lora.dora else f"lora.kind = {lora.kind!r}"
            raise ValueError(
                f"{key} is a {kind} (a LyCORIS file), the job's {job}: set lora.kind = "
                f"{kind!r} to start from it"
            )


def peft_state(tensors: dict, current: dict, lora, family, denoiser, load=None) -> dict:
    """The file's LoKr / LoHa as the job's peft state (``current``: the fresh adapter's, by
    peft name), the scale ratio folded into the first factor; ValueError naming the key and
    the job's keys where they disagree."""
    load = load or (lambda t: t)
    _same_kind(tensors, lora)
    found = grouped(tensors, family, denoiser)
    adapted: dict[str, dict] = {}
    for name, value in current.items():
        module, _, tensor = name.rpartition(".")
        adapted.setdefault(module, {})[tensor] = value
    if extra := sorted(m for m in found if m not in adapted):
        raise ValueError(
            f"it has an adapter on {len(extra)} modules lora.target_modules does not reach "
            f"(e.g. {', '.join(extra[:4])}): add them to lora.target_modules"
        )
    state, peft_scale = {}, lora.alpha / lora.rank
    for module, (key, t) in found.items():
        kind = KIND_OF[next(n for n in t if n != "alpha")[:5]]
        mine = adapted[module]
        theirs = {n: tuple(v.shape) for n, v in t.items() if n != "alpha"}
        if kind != lora.kind or theirs != {n: tuple(v.shape) for n, v in mine.items()}:
            raise ValueError(
                f"{key} is a {kind} of {theirs}, the job's lora.kind = {lora.kind!r} adapter on "
                f"{module} {({n: tuple(v.shape) for n, v in mine.items()})}: set lora.kind, "
                "lora.rank, lora.factor and lora.decompose_both as the file's"
            )
        ratio = file_scale(t, load) / peft_scale
        first = next(n for n in ("lokr_w1", "lokr_w1_a", "hada_w1_a") if n in t)
        for n in theirs:
            value = t[n] * ratio if n == first else t[n]
            state[f"{module}.{n}"] = value.to(mine[n].dtype)
    return state
