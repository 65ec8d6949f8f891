"""``lora.init_from``: a LoRA file training starts from, in the diffusers/peft layout or a kohya
one (raytuner's own exports, sd-scripts' SDXL ``input_blocks`` names, sd-scripts' Flux
layout; another tool's LoKr or LoHa: ``lycoris_from``), read into the run's freshly made peft
adapter before the first step. Its rank and
alpha must be the job's ``lora.rank`` / ``lora.alpha``; a key that names no adapted module of
the model is refused, never skipped. A resumed run reads its checkpoint afterwards, which wins.
A file's text-encoder LoRA (``text_encoder.*``, ``lora_te_*``: SD1.5's and SDXL's) starts the
run's text-encoder adapters (``lora.text_encoder = true``; their rank and alpha the job's
``text_encoder_rank`` / ``text_encoder_alpha``), and is refused by a job that trains none.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from typing import NamedTuple

import torch
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load as load_tensors

from raytuner import storage
from raytuner.checkpoint.layout import DIFFUSERS_FILE
from raytuner.config import ConfigError
from raytuner.lora import export, header, kohya, lycoris, lycoris_from

COMFY = "diffusion_model."  # ComfyUI's name of the denoiser in LoRA keys
_PEFT_DEFAULT = re.compile(r"\.(lora_[AB])\.default\.weight$")
ADAPTER_KEY = "lora_adapter_metadata"  # the peft config diffusers' save_lora_weights stores
# what the export keeps of the file's own metadata (sd-scripts' dataset keys are long)
SOURCE_PREFIXES = ("raytuner.", "ss_", "modelspec.")
SOURCE_SKIP = ("ss_tag_frequency", "ss_dataset_dirs", "ss_reg_dataset_dirs", "ss_datasets")
SOURCE_SKIP += ("ss_bucket_info", "modelspec.thumbnail")


def read(path: str, key: str = "lora.init_from") -> tuple[dict[str, torch.Tensor], dict, str]:
    """A safetensors file, local or a pyarrow URI (``s3://``): tensors, metadata, sha256;
    ConfigError naming ``key`` where it cannot be read."""
    fs, where = storage.resolve(path)
    try:
        data = storage.read_bytes(fs, where)
    except (FileNotFoundError, OSError) as e:
        raise ConfigError(f"{key} = {path!r}: cannot read it ({e})") from None
    try:
        (size,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8 : 8 + size]).get("__metadata__") or {}
        tensors = load_tensors(data)
    except (struct.error, ValueError) as e:
        raise ConfigError(f"{key} = {path!r}: not a safetensors file ({e})") from None
    return tensors, meta, hashlib.sha256(data).hexdigest()


def expert_files(path: str, family) -> list[tuple[object, str]]:
    """(the family training that expert, its file) of each expert of a run of every expert of
    a mixture (``model.expert = "both"``): ``path`` is a folder with a sub-folder per expert
    (``high/``, ``low/``), as a run of both exports its ``lora/``, each holding raytuner's
    ``pytorch_lora_weights.safetensors`` or one ``.safetensors`` file (another trainer's file
    of that expert); ConfigError naming what to put where."""
    fs, where = storage.resolve(path)
    out = []
    for expert in family.turns:
        try:
            found = storage.listdir(fs, storage.join(where, expert.name))
        except (FileNotFoundError, OSError):
            found = []
        names = [i.base_name for i in found if i.base_name.endswith(".safetensors")]
        pick = [DIFFUSERS_FILE] if DIFFUSERS_FILE in names else names
        if len(pick) != 1:
            listed = "/, ".join(e.name for e in family.turns)
            raise ConfigError(
                f'lora.init_from = {path!r} with model.expert = "both": its {expert.name}/ '
                f"folder holds {len(names)} .safetensors files; a run of every expert starts "
                f"from a folder with one LoRA file per expert ({listed}/), as such a run "
                "exports its lora/ folder"
            )
        out.append((family.with_expert(expert.name), storage.join(path, expert.name, pick[0])))
    return out


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


def file_modules(tensors: dict, meta: dict, family, denoiser, load=None) -> dict:
    """The file's LoRA per module of the denoiser: {module: (down, up, alpha)}. ``load``: a
    tensor's values when ``tensors`` are the header's (``check_file``)."""
    dims, denoiser_part = export.out_dims(denoiser), f"{family.lora_part}."
    # peft's adapter name in the keys (``lora_A.default.weight``), as ComfyUI and diffusers'
    # Qwen-Image loader read them
    tensors = {_PEFT_DEFAULT.sub(r".\1.weight", k): v for k, v in tensors.items()}
    names = export.kohya_names(family, denoiser)
    if not any(k.endswith(".lora_down.weight") for k in tensors):
        # the diffusers module names under ComfyUI's name of the denoiser, as ComfyUI-side
        # trainers write them (diffusers' Z-Image loader takes them so); a kohya layout's
        # names in peft's keys there (ai-toolkit's FLUX.2 and Wan files) as that layout
        tensors = {
            denoiser_part + k.removeprefix(COMFY) if k.startswith(COMFY) else k: v
            for k, v in tensors.items()
        }
        if names is not None:
            tensors = _native_as_kohya(tensors, denoiser_part, dims)
    if not any(k.endswith(".lora_down.weight") for k in tensors):
        return from_diffusers(tensors, meta, family.lora_part)
    # a family without a kohya layout: the diffusers names, as kohya writes them
    names = names or kohya.unet_names
    table = kohya.reverse(names, dims)
    # diffusers' convert_state_dict_to_kohya (raytuner's earlier exports) names the part
    part = f"lora_{family.parts.denoiser}_"
    table = {part + m.replace(".", "_"): (m,) for m in dims} | table
    if load is not None:  # how a fused linear's LoRA splits depends on its up's values
        fused = {f"{name}.lora_up.weight" for name, pieces in table.items() if len(pieces) > 1}
        tensors = {k: load(v) if k in fused else v for k, v in tensors.items()}
    return kohya.from_kohya(tensors, table, dims)


def _native_as_kohya(tensors: dict, part: str, dims: dict) -> dict:
    """A peft-style file (``lora_A`` / ``lora_B``) whose modules are none of the denoiser's,
    named as the family's kohya layout names them without its prefix (ai-toolkit's FLUX.2
    LoRAs: BFL's ``double_blocks.0.img_attn.qkv`` under ``diffusion_model.``), in that
    layout's keys; any other file as it is."""
    ends = {".lora_A.weight": ".lora_down.weight", ".lora_B.weight": ".lora_up.weight"}
    ends[".alpha"] = ".alpha"
    renamed = {}
    for key, value in tensors.items():
        end = next((e for e in ends if key.endswith(e)), None)
        module = key.removeprefix(part)[: -len(end)] if end else ""
        if end is None or module in dims:
            return tensors
        renamed[kohya.flat(module) + ends[end]] = value
    return renamed


class Shape(NamedTuple):
    """The adapter a file's LoRA must fit: its rank and alpha, and the job's keys for them."""

    rank: int
    alpha: float
    keys: tuple[str, str, str] = ("lora.rank", "lora.alpha", "lora.target_modules")


def _match(found: dict, adapted: set[str], known: set[str], shape: Shape, load=None) -> dict:
    """peft state of the adapter from the file's modules; ValueError where they disagree.
    ``load``: a tensor's values when ``found`` holds the header's (``check_file``)."""
    rank_key, alpha_key, targets_key = shape.keys
    if unknown := sorted(m for m in found if m not in known):
        raise ValueError(
            f"it has a LoRA on {len(unknown)} modules this model does not have "
            f"(e.g. {', '.join(unknown[:4])}): a LoRA of another model"
        )
    values = load or (lambda t: t)
    extra = [m for m, (_, up, _) in found.items() if m not in adapted and values(up).any()]
    if extra:
        raise ValueError(
            f"it has a LoRA on {len(extra)} modules {targets_key} does not reach "
            f"(e.g. {', '.join(sorted(extra)[:4])}): add them to {targets_key}"
        )
    state = {}
    for module, (down, up, alpha) in found.items():
        if module not in adapted:
            continue  # a zero piece of a fused kohya linear the run does not train
        rank = down.shape[0]
        if rank != shape.rank or abs(alpha - shape.alpha) > 1e-6 * max(1.0, abs(alpha)):
            raise ValueError(
                f"its LoRA on {module} has rank {rank} and alpha {alpha:g}, the job "
                f"{rank_key} = {shape.rank} and {alpha_key} = {shape.alpha:g}: set {rank_key} "
                f"= {rank} and {alpha_key} = {alpha:g} to continue from it"
            )
        state[f"{module}.lora_A.weight"], state[f"{module}.lora_B.weight"] = down, up
    return state


def _checked(state: dict, current: dict) -> dict:
    """``state`` when every tensor has the shape of the adapter's (``current``)."""
    for key, value in state.items():
        if value.shape != current[key].shape:
            raise ValueError(
                f"{key} is {tuple(value.shape)}, the model's "
                f"{tuple(current[key].shape)}: a LoRA of another model"
            )
    return state


def _text_tensors(tensors: dict, family) -> tuple[dict, dict]:
    """The file's tensors split into the denoiser's and each text encoder's, by its part's
    diffusers prefix or its kohya prefix (``"?"``: a text encoder's name in either naming that
    is none of the family's)."""
    owners = {}
    for spec in family.adapters.text_encoders:
        owners |= {f"{spec.part}.": spec.part, f"{spec.kohya}_": spec.part}
    texts: dict[str, dict] = {}
    for key in list(tensors):
        part = next((p for prefix, p in owners.items() if key.startswith(prefix)), None)
        if part is None and key.startswith(("text_encoder", "lora_te")):
            part = "?"
        if part is not None:
            texts.setdefault(part, {})[key] = tensors.pop(key)
    return tensors, texts


def _untrained(texts: dict, family, text) -> None:
    """ValueError for a text-encoder LoRA the job does not train (``text``: the trained ones)
    or the family has no encoder for."""
    if "?" in texts:
        key = next(iter(texts["?"]))
        raise ValueError(
            f"it holds a LoRA of text encoders {family.name} has none of (e.g. {key}): a LoRA "
            "of another model"
            if family.adapters.text_encoders
            else f"it holds a LoRA of the text encoders (e.g. {key}), and raytuner trains no "
            f"{family.name} text encoder: remove those keys from the file"
        )
    if texts and not text:
        key = next(iter(next(iter(texts.values()))))
        raise ValueError(
            f"it holds a LoRA of the text encoders (e.g. {key}): set lora.text_encoder = true "
            "to start them from it too"
        )


def _text_state(tensors: dict, meta: dict, spec, encoder, lora, load) -> dict:
    """A text encoder's LoRA in the file (its keys only) as the adapter's checkpoint names
    (``<part>.<peft name>``): sd-scripts' names or diffusers' (from the CLIP's ``text_model``,
    or the model's own module names)."""
    dims = export.out_dims(encoder)
    if any(k.endswith(".lora_down.weight") for k in tensors):
        table = kohya.reverse(kohya.text_names(spec.kohya, spec.root), dims)
        found = kohya.from_kohya(tensors, table, dims)
    else:
        own = {(m if m.startswith(spec.root) else spec.root + m): m for m in dims}
        found = {own.get(m, m): v for m, v in from_diffusers(tensors, meta, spec.part).items()}
    current = get_peft_model_state_dict(encoder)
    keys = ("lora.text_encoder_rank", "lora.text_encoder_alpha", "lora.text_encoder_target_modules")
    shape = Shape(lora.text_rank, lora.text_alpha, keys)
    adapted = set(kohya.modules_of(current))
    state = _checked(_match(found, adapted, set(dims), shape, load), current)
    return {f"{spec.part}.{k}": v for k, v in state.items()}


def start_from(denoiser, path: str, lora, family, text=()) -> tuple[dict, dict, dict]:
    """``path`` read and checked against the denoiser's peft adapter and the text encoders'
    (``text``: (``TextEncoderLora``, encoder) of each, ``lora.text_encoder``): its denoiser
    tensors under the adapter's peft names (``get_peft_model_state_dict``), its text encoders'
    under their checkpoint names (``<part>.<peft name>``, none where the file has none), and
    the provenance the export keeps. The caller puts them into the adapters (sharded or not)."""
    tensors, meta, sha = read(path)
    state, texts = _states(tensors, meta, denoiser, path, lora, family, text)
    source = {
        k: v for k, v in meta.items() if k.startswith(SOURCE_PREFIXES) and k not in SOURCE_SKIP
    }
    return (
        state,
        texts,
        {
            "raytuner.init_from": path,
            "raytuner.init_from_sha256": sha,
            "raytuner.init_from_modules": str(len(lycoris.grouped(state | texts))),
            "raytuner.init_from_metadata": json.dumps(source, sort_keys=True),
        },
    )


def _states(tensors, meta, denoiser, path, lora, family, text, load=None) -> tuple[dict, dict]:
    """The file's tensors as the peft states of the denoiser's adapter and of the text
    encoders' (``start_from``); ConfigError naming ``lora.init_from`` where they do not fit."""
    current = get_peft_model_state_dict(denoiser)
    adapted = set(kohya.modules_of(current))
    texts = {}
    try:
        if export.KIND not in meta and lycoris_from.is_lycoris(tensors):  # another tool's
            return lycoris_from.peft_state(tensors, current, lora, family, denoiser, load), {}
        _same_kind(meta, lora)
        if not all(".lora_A." in k or ".lora_B." in k for k in current):
            return _kind_state(tensors, meta, current, lora, family.lora_part), {}
        tensors, by_part = _text_tensors(dict(tensors), family)
        found = file_modules(tensors, meta, family, denoiser, load) if tensors else {}
        shape = Shape(lora.rank, lora.alpha)
        known = set(export.out_dims(denoiser))
        state = _checked(_match(found, adapted, known, shape, load), current)
        _untrained(by_part, family, text)
        for spec, encoder in text:
            if spec.part in by_part:
                texts |= _text_state(by_part[spec.part], meta, spec, encoder, lora, load)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"lora.init_from = {path!r}: {e}") from None
    return state, texts


def _same_kind(meta: dict[str, str], lora) -> None:
    """ValueError for a raytuner file of another adapter kind than the job's (a file of
    another trainer is taken for a LoRA and read as one)."""
    kind, dora = meta.get(export.KIND, "lora"), meta.get("raytuner.dora", "false") == "true"
    if (kind, dora) != (lora.kind, lora.dora):
        what = "a DoRA" if dora else f"a {kind}"
        raise ValueError(
            f"it holds {what} adapter (its {export.KIND}), the job lora.kind = {lora.kind!r} "
            f"and lora.dora = {str(lora.dora).lower()}: set them as the file's to start from it"
        )


def _kind_state(tensors: dict, meta: dict, current: dict, lora, part: str) -> dict:
    """A LoKr, LoHa or DoRA in raytuner's diffusers file (``<part>.<peft name>`` keys and the
    peft config stored with it) as the adapter's peft state: the same modules, tensor shapes,
    rank, alpha and LoKr factorization as the job's."""
    state = {k.removeprefix(f"{part}."): v for k, v in tensors.items()}
    if set(state) != set(current):
        odd = sorted(set(state) ^ set(current))
        raise ValueError(
            f"its adapter and the job's differ in {len(odd)} tensors (e.g. {', '.join(odd[:3])}): "
            f"start from raytuner's diffusers file of a run on the same lora.target_modules"
        )
    stored = json.loads(meta.get(ADAPTER_KEY, "{}"))
    config = {k.removeprefix(f"{part}."): v for k, v in stored.items()}
    alpha = config.get("lora_alpha", config.get("alpha"))
    if (config.get("r"), alpha) != (lora.rank, lora.alpha):
        raise ValueError(
            f"its adapter has rank {config.get('r')} and alpha {alpha}, the job lora.rank = "
            f"{lora.rank} and lora.alpha = {lora.alpha:g}: set them as the file's"
        )
    return _checked(state, current)


def check_file(denoiser, path: str, lora, family, text=()) -> None:
    """Refuse what ``start_from`` would refuse of ``path``, from the file's header (its keys,
    ranks and shapes): the weights are not read but for its alphas and where the layout hangs
    on their values (the up of a fused kohya linear, one of a module the job's targets do not
    reach). ``denoiser`` (and the encoders of ``text``) may be on the meta device, their
    adapters in place: `raytuner check` refuses a file that would fail every worker."""
    tensors, meta, load = header.checked(path, "lora.init_from")
    _states(tensors, meta, denoiser, path, lora, family, text, load)
