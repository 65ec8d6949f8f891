"""``model.merge_adapters``: LoRA / LoKr / LoHa / DoRA files merged into the frozen denoiser
before training (a de-distill "training adapter", a style LoRA trained on top of), each with a
weight. Pure functions: a file -> {module: its ``Change``}; a weight and its changes -> the
merged weight, computed in float32 and applied as ComfyUI applies them, in order:

- LoRA (every layout ``lora.init_from`` reads: raytuner's, diffusers/peft, kohya, musubi's,
  ai-toolkit's, ComfyUI's ``diffusion_model.``): ``W += weight x alpha / rank x up @ down``;
- LoKr (``lokr_w1`` or ``lokr_w1_a/_b``, ``lokr_w2`` or ``lokr_w2_a/_b``): ``W += weight x
  scale x w1 (x) w2``, scale ``alpha / rank`` where a factor is low-rank, 1 where both are whole
  (LyCORIS), ``alpha / r`` of the stored peft config for raytuner's diffusers file (peft);
- LoHa (``hada_w1_a/_b``, ``hada_w2_a/_b``): ``W += weight x alpha / rank x (w1_a @ w1_b) *
  (w2_a @ w2_b)``;
- DoRA: ``W' = m x (W + delta) / ||W + delta||`` per output row (peft's
  ``lora_magnitude_vector`` m) or ``dora_scale x (W + delta) / ||W||`` (the LyCORIS /
  ComfyUI ``dora_scale``), then ``W += weight x (W' - W)``.

Module names are the denoiser's (diffusers'), found through the family's kohya layout, its
LyCORIS template (``adapters.files.lycoris``), ``lora_unet_`` / ``lora_<part>_`` flat names,
``<part>.`` and ComfyUI's ``diffusion_model.``. A key no rule names is refused, never skipped.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import NamedTuple

import torch

from raytuner import storage
from raytuner.config import ConfigError
from raytuner.lora import export, header, init_from, kohya, lycoris_from
from raytuner.lora.init_from import ADAPTER_KEY, COMFY

MAGNITUDES = ("lora_magnitude_vector", "dora_scale")  # peft's DoRA m, LyCORIS' dora_scale
_DEFAULT = re.compile(r"\.default(?=\.|$)")  # peft's adapter name in a key
_TEXT = ("text_encoder", "lora_te")  # a text encoder's LoRA: not merged


class Change(NamedTuple):
    """One module's update in a file: ``kind`` (``lora``, ``lokr``, ``loha``), its tensors by
    their own names (``down``/``up`` for a LoRA), the scale, and DoRA's magnitude (``dora``:
    ``lora_magnitude_vector`` or ``dora_scale``; None for none)."""

    kind: str
    tensors: dict
    scale: float
    dora: str | None = None
    magnitude: torch.Tensor | None = None


def key(i: int) -> str:
    return f"model.merge_adapters[{i}].path"


def changes(tensors: dict, meta: dict, family, denoiser, load=None) -> dict[str, Change]:
    """The file's update per module of ``denoiser`` (its adapter may be in place); ValueError
    for a layout none of the rules reads, a module the denoiser lacks or a shape that is not
    its. ``load``: a tensor's values when ``tensors`` are a header's (meta tensors)."""
    tensors = {_DEFAULT.sub("", k): v for k, v in tensors.items()}
    if text := [k for k in tensors if k.startswith(_TEXT)]:
        raise ValueError(
            f"it holds a text encoder's LoRA (e.g. {text[0]}): only the denoiser is merged; "
            "remove those keys from the file"
        )
    dims = export.out_dims(denoiser)
    names = _names(family, denoiser, dims)
    magnitudes = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[-1] in MAGNITUDES}
    rest = {k: v for k, v in tensors.items() if k not in magnitudes}
    if any(k.rsplit(".", 1)[-1].startswith(("lokr_", "hada_")) for k in rest):
        found = _lycoris(rest, meta, family, denoiser)
    else:
        rest = _template_as_kohya(rest, family, dims)
        lora = init_from.file_modules(rest, meta, family, denoiser, load)
        found = {
            m: Change("lora", {"down": d, "up": u}, alpha / d.shape[0])
            for m, (d, u, alpha) in lora.items()
        }
    for k, value in magnitudes.items():
        name, which = k.rsplit(".", 1)
        module = _module(names, name, k)
        if module not in found:
            raise ValueError(f"{k}: a DoRA magnitude without its module's LoRA")
        found[module] = found[module]._replace(dora=which, magnitude=value)
    if unknown := sorted(m for m in found if m not in dims):
        raise ValueError(
            f"it updates {len(unknown)} modules this model's denoiser does not have "
            f"(e.g. {', '.join(unknown[:4])}): an adapter of another model"
        )
    for module, change in found.items():
        _fits(module, change, denoiser.get_submodule(module))
    return found


def _names(family, denoiser, dims) -> dict[str, tuple[str, ...]]:
    """Every name a file may give a module of the denoiser -> the modules it holds."""
    part = family.parts.denoiser
    table = {}
    for m in dims:
        flat = m.replace(".", "_")
        table |= {m: (m,), f"{part}.{m}": (m,), COMFY + m: (m,), kohya.flat(m): (m,)}
        table[f"lora_{part}_{flat}"] = (m,)
        if template := family.adapters.files.lycoris:
            table[template.format(module=m, flat=flat)] = (m,)
    if (kohya_names := export.kohya_names(family, denoiser)) is not None:
        table |= kohya.reverse(kohya_names, dims)
    return table


def _template_as_kohya(tensors: dict, family, dims) -> dict:
    """A LoRA (DoRA) under the family's LyCORIS names (``lycoris_<flat>``, raytuner's DoRA
    export for a family whose kohya layout fuses modules) in the ``lora_<part>_<flat>`` kohya
    names ``init_from`` reads for every family; other keys as they are."""
    template = family.adapters.files.lycoris
    if not template:
        return tensors
    part = family.parts.denoiser
    kohya_name = {}
    for m in dims:
        flat = m.replace(".", "_")
        kohya_name[template.format(module=m, flat=flat)] = f"lora_{part}_{flat}"
    out = {}
    for k, value in tensors.items():
        name, end = next(((k[: -len(e)], e) for e in kohya.KINDS if k.endswith(e)), (k, ""))
        out[kohya_name[name] + end if end and name in kohya_name else k] = value
    return out


def _module(names: dict, name: str, k: str) -> str:
    """The one module a LyCORIS / DoRA key's name holds; ValueError otherwise."""
    pieces = names.get(name)
    if pieces is None:
        raise ValueError(f"{k}: names no module of this model's denoiser")
    if len(pieces) > 1:
        raise ValueError(
            f"{k}: a LoKr, LoHa or DoRA on {name}, a linear the family fuses from "
            f"{', '.join(pieces)}: not read; use a file on the diffusers modules"
        )
    return pieces[0]


def _lycoris(tensors: dict, meta: dict, family, denoiser) -> dict[str, Change]:
    """A LyCORIS file's (or raytuner's peft LoKr / LoHa file's) modules, named as
    ``lora.init_from`` reads other tools' LyCORIS names (``lycoris_from.grouped``)."""
    peft = _peft_config(meta)
    out = {}
    for module, (name, t) in lycoris_from.grouped(tensors, family, denoiser).items():
        kind = "lokr" if any(k.startswith("lokr_") for k in t) else "loha"
        need = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b") if kind == "loha" else ()
        if kind == "lokr" and not (
            ("lokr_w1" in t or {"lokr_w1_a", "lokr_w1_b"} <= set(t))
            and ("lokr_w2" in t or {"lokr_w2_a", "lokr_w2_b"} <= set(t))
        ):
            need = ("lokr_w1", "lokr_w2")
        if missing := [n for n in need if n not in t]:
            raise ValueError(f"{name}: a {kind} without {', '.join(missing)}")
        if "alpha" not in t and peft.get("r"):  # peft's scale: alpha / r, always
            scale = float(peft.get("alpha", peft.get("lora_alpha", peft["r"]))) / peft["r"]
        else:  # LyCORIS' and ComfyUI's
            scale = lycoris_from.file_scale(t, lambda a: a)
        factors = {k: v for k, v in t.items() if k != "alpha"}
        out[module] = Change(kind, factors, scale)
    return out


def _peft_config(meta: dict) -> dict:
    """The peft config diffusers stored with the file (its keys without the part's prefix)."""
    stored = json.loads(meta.get(ADAPTER_KEY, "{}"))
    return {k.rsplit(".", 1)[-1]: v for k, v in stored.items()}


def delta(change: Change, shape) -> torch.Tensor:
    """The module's update in float32, as a weight of ``shape`` (before ``weight``), without
    DoRA's normalisation. Meta tensors give a meta delta (the shape checks of ``check``)."""
    t = {k: v.float() for k, v in change.tensors.items()}
    if change.kind == "lora":
        d = t["up"].flatten(1) @ t["down"].flatten(1)
    elif change.kind == "loha":
        d = (t["hada_w1_a"] @ t["hada_w1_b"]) * (t["hada_w2_a"] @ t["hada_w2_b"])
    else:
        w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
        w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"].flatten(1)
        d = torch.kron(w1.flatten(1), w2.flatten(1))
    if d.numel() != torch.Size(shape).numel() or d.shape[0] != shape[0]:
        raise ValueError(f"an update of shape {tuple(d.shape)} for a weight of {tuple(shape)}")
    return d.reshape(shape) * change.scale


def _fits(module: str, change: Change, layer) -> None:
    """ValueError when ``change`` is no update of ``layer``'s weight (shapes only)."""
    weight = getattr(layer, "base_layer", layer).weight
    meta = change._replace(tensors={k: v.to("meta") for k, v in change.tensors.items()})
    try:
        delta(meta, weight.shape)
    except (ValueError, RuntimeError) as e:
        raise ValueError(
            f"{module}: {str(e).splitlines()[0]}: an adapter of another model"
        ) from None
    if change.magnitude is not None and change.magnitude.numel() != weight.shape[0]:
        raise ValueError(f"{module}: a DoRA magnitude of {change.magnitude.numel()} rows")


def merged(weight: torch.Tensor, updates: list[tuple[Change, float]]) -> torch.Tensor:
    """``weight`` with each (change, weight) applied in order, in float32, in its own dtype."""
    w = weight.detach().float()
    for change, strength in updates:
        d = delta(change, w.shape).to(w.device)
        if change.dora is None:
            w = w + strength * d
            continue
        rows = (w.shape[0],) + (1,) * (w.dim() - 1)
        m = change.magnitude.float().to(w.device).reshape(rows)
        full = w + d
        norm = (full if change.dora == MAGNITUDES[0] else w).reshape(w.shape[0], -1).norm(dim=1)
        w = w + strength * (full * m / norm.reshape(rows) - w)
    return w.to(weight.dtype)


def _per_denoiser(adapters, family, denoiser) -> list[tuple]:
    """(family, model, name prefix, [(index, adapter)]) of each model the entries merge into:
    every expert of a mixture trained in turn (``denoiser.experts()``) its own entries (their
    ``expert``), names under its part; else the denoiser every entry."""
    experts = getattr(denoiser, "experts", None)
    if experts is None or not family.turns:
        return [(family, denoiser, "", list(enumerate(adapters)))]
    return [
        (family.with_expert(e.name), module, f"{part}.",
         [(i, a) for i, a in enumerate(adapters) if a.expert == e.name])
        for (part, module), e in zip(experts(), family.turns, strict=True)
    ]  # fmt: skip


def read(adapters, family, denoiser) -> dict[str, list[tuple[Change, float]]]:
    """Each ``[[model.merge_adapters]]`` file read: module -> its (change, weight) in the
    files' order (a mixture's experts: each entry's into its ``expert``); ConfigError naming
    the entry where a file does not fit the denoiser."""
    out: dict[str, list] = {}
    for of, model, prefix, numbered in _per_denoiser(adapters, family, denoiser):
        for i, adapter in numbered:
            tensors, meta, _ = init_from.read(adapter.path, key(i))
            try:
                found = changes(tensors, meta, of, model)
            except (KeyError, ValueError) as e:
                raise ConfigError(f"{key(i)} = {adapter.path!r}: {e}") from None
            for module, change in found.items():
                out.setdefault(prefix + module, []).append((change, adapter.weight))
    return out


def check(adapters, family, denoiser) -> None:
    """What ``read`` refuses, from each file's header (its weights unread but for its
    alphas and where a kohya layout hangs on them): ``raytuner check``."""
    for of, model, _, numbered in _per_denoiser(adapters, family, denoiser):
        for i, adapter in numbered:
            _check_file(i, adapter, of, model)


def _check_file(i: int, adapter, family, denoiser) -> None:
    tensors, meta, load = header.checked(adapter.path, key(i))
    try:
        changes(tensors, meta, family, denoiser, load)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{key(i)} = {adapter.path!r}: {e}") from None


def into(denoiser, updates: dict[str, list]) -> None:
    """Merge ``updates`` (``read``) into a whole denoiser's weights, in place."""
    with torch.no_grad():
        for module, changes_of in updates.items():
            layer = denoiser.get_submodule(module)
            weight = getattr(layer, "base_layer", layer).weight
            weight.copy_(merged(weight, changes_of))


def identity(adapters) -> list[dict]:
    """What a run records of its merged adapters (its identity, the export's metadata): each
    file's path, weight and sha256, in order."""
    out = []
    for i, adapter in enumerate(adapters):
        fs, where = storage.resolve(adapter.path)
        digest = hashlib.sha256()
        try:
            with fs.open_input_stream(where) as f:
                while chunk := f.read(storage.COPY_CHUNK):
                    digest.update(chunk)
        except OSError as e:
            raise ConfigError(f"{key(i)} = {adapter.path!r}: cannot read it ({e})") from None
        record = {"path": adapter.path, "weight": adapter.weight, "sha256": digest.hexdigest()}
        out.append(record | ({"expert": adapter.expert} if adapter.expert else {}))
    return out
