"""Where a family's parts come from, in which precision: the one loader of every model part.

``model.pretrained`` names a diffusers folder or hub repo, a single-file checkpoint
(``.safetensors`` in the original LDM/SGM or BFL key layout, as model sites ship them), or a
preset shipped in the package (``configs/<family>.<preset>.json``): every family's ``tiny`` (a
few thousand parameters, for tests and demos) and ``random`` (the released architecture at full
size: for planning, benchmarks and GPU checks without the hub), and a family's other released
sizes as ``random-<size>`` (FLUX.2 [klein] 9B: ``random-9b``). A preset is the family's part
configs; both presets are built by the same code, with seeded random weights, directly in the
requested dtype and on the requested device (the meta device for ``raytuner plan``), so no
float32 copy of a half-precision model is ever made. A folder or repo loads with
``from_pretrained(..., torch_dtype=dtype)``. A single file's parts (the family's
``parts.single_file``) load with diffusers' ``from_single_file`` and its LDM CLIP conversion,
their configs taken from ``model.single_file_config`` (a diffusers folder: no network); the parts
the file lacks (Flux's VAE and text encoders), the tokenizers and the scheduler come from that
repo as from any other.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from raytuner import placement

log = logging.getLogger("raytuner.model")

PRESETS = ("tiny", "random")  # every family's; ``preset_names`` adds a family's other sizes
SINGLE_FILE_SUFFIX = ".safetensors"  # single-file checkpoints raytuner loads (no pickle: .ckpt)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CONFIGS = Path(__file__).parent / "configs"


def is_single_file(pretrained: str) -> bool:
    """Whether ``model.pretrained`` names a single-file checkpoint rather than a folder, a hub
    id or a preset."""
    return pretrained.lower().endswith(SINGLE_FILE_SUFFIX)


@dataclass(frozen=True)
class Source:
    """Which weights to load (a preset name, a folder, a hub id or a single ``.safetensors``
    file) and the dtype of the frozen ones (``model.dtype`` resolved for the device that runs
    them). ``single_file_config``: a single file's diffusers folder or hub id (resolved: never
    empty for a single file built by :func:`source`)."""

    pretrained: str
    revision: str = ""
    dtype: torch.dtype = torch.float32
    single_file_config: str = ""

    @property
    def preset(self) -> str | None:
        return self.pretrained if self.pretrained in _all_presets() else None

    @property
    def full_size(self) -> bool:
        """A preset of a released architecture (``random``, ``random-9b``): not ``tiny``."""
        return self.preset is not None and self.preset != "tiny"

    @property
    def single_file(self) -> bool:
        return is_single_file(self.pretrained)

    @property
    def repo(self) -> str:
        """The diffusers folder or hub id ``from_pretrained`` reads: ``pretrained`` itself, or a
        single file's config repo (its part configs, tokenizers, scheduler, the parts it lacks)."""
        if not self.single_file:
            return self.pretrained
        if not self.single_file_config:
            raise ValueError(
                f"model.pretrained = {self.pretrained!r} is a single file: set "
                "model.single_file_config to the diffusers folder or hub id that describes it"
            )
        return self.single_file_config

    def hub(self, subfolder: str | None = None) -> dict:
        """``from_pretrained`` keyword arguments for a subfolder (or the whole folder / repo)."""
        kwargs = {"subfolder": subfolder} if subfolder else {}
        return kwargs | ({"revision": self.revision} if self.revision else {})


def resolve_dtype(name: str, device: str | torch.device) -> torch.dtype:
    """``model.dtype`` for a device: ``auto`` is bfloat16 on a GPU and float32 elsewhere;
    ``float8`` loads in bfloat16 (the denoiser's linear weights are then stored in float8 by
    :func:`float8_storage`)."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return torch.bfloat16 if name == FLOAT8 else DTYPES[name]


FLOAT8 = "float8"  # the model.dtype that stores the frozen denoiser in float8


class _ScaledFloat8(torch.nn.Module):
    """A linear weight stored as float8 (e4m3) times a per-tensor scale (``original0``,
    ``original1``), upcast to ``compute`` each time the layer runs (a parametrization:
    ``layer.weight`` is the upcast)."""

    def __init__(self, compute: torch.dtype):
        super().__init__()
        self.compute = compute

    def forward(self, stored: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return stored.to(self.compute) * scale.to(self.compute)

    def right_inverse(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fp8 = torch.float8_e4m3fn
        scale = weight.detach().abs().amax().float() / torch.finfo(fp8).max
        scale = scale.clamp(min=1e-12)
        return (weight.detach().float() / scale).to(fp8), scale


def float8_storage(module: torch.nn.Module, compute: torch.dtype = torch.bfloat16) -> int:
    """Store the frozen weight of every linear layer of ``module`` in scaled float8, computed in
    ``compute``; returns how many layers were converted (LoRA layers added later keep theirs)."""
    from torch.nn.utils import parametrize

    layers = [
        m
        for m in module.modules()
        if isinstance(m, torch.nn.Linear)
        and not m.weight.requires_grad
        and not parametrize.is_parametrized(m, "weight")
    ]
    for layer in layers:
        parametrize.register_parametrization(layer, "weight", _ScaledFloat8(compute))
    return len(layers)


def source(
    pretrained: str,
    revision: str,
    dtype: str,
    device,
    *,
    family: str = "",
    single_file_config: str = "",
) -> Source:
    """The job's ``[model]`` keys as a Source for parts run on ``device``; a single file's
    config repo defaults to the ``family``'s (:func:`default_config`)."""
    if is_single_file(pretrained) and not single_file_config and family:
        single_file_config = default_config(family)
    return Source(pretrained, revision, resolve_dtype(dtype, device), single_file_config)


def model_source(model, device) -> Source:
    """A job's ``[model]`` (a ModelConfig) as a Source for parts run on ``device``."""
    return source(
        model.pretrained,
        model.revision,
        model.dtype,
        device,
        family=model.family,
        single_file_config=model.single_file_config,
    )


def default_config(family: str) -> str:
    """The hub repo whose configs describe a family's single file when
    ``model.single_file_config`` is empty: the released repo its ``random`` preset holds."""
    repos = preset(family, "random").get("_repos", [])
    if not repos:
        raise ValueError(f"family {family!r} names no default repo for a single-file checkpoint")
    return repos[0]


def single_file_identity(path: str) -> dict:
    """What tells a single-file checkpoint from another without reading its gigabytes: its size,
    modification time and the sha256 of its safetensors header (tensor names, dtypes, shapes,
    offsets, metadata). A file replaced or rewritten gets another identity."""
    stat = os.stat(path)
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= min(stat.st_size - 8, 100 << 20):
            raise ValueError(
                f"model.pretrained = {path!r} is not a safetensors file (header length {length})"
            )
        header = f.read(length)
    digest = hashlib.sha256(header).hexdigest()
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns, "header_sha256": digest}


@functools.cache
def _all_presets() -> frozenset[str]:
    """The preset names any family ships (a name that is no folder or hub id)."""
    return frozenset(p.name.split(".", 1)[1].removesuffix(".json") for p in CONFIGS.glob("*.json"))


@functools.cache
def preset_names(family: str) -> tuple[str, ...]:
    """The presets ``family`` ships: ``tiny``, ``random``, then its other sizes."""
    own = {p.name.split(".", 1)[1].removesuffix(".json") for p in CONFIGS.glob(f"{family}.*.json")}
    return tuple(n for n in PRESETS if n in own) + tuple(sorted(own - set(PRESETS)))


@functools.cache
def preset(family: str, name: str) -> dict:
    """A preset's part configs: part name -> {"config": constructor kwargs, "seed": ...}."""
    path = CONFIGS / f"{family}.{name}.json"
    if not path.exists():
        raise ValueError(
            f"model.pretrained = {name!r}: family {family!r} has no such preset; its presets: "
            + ", ".join(preset_names(family))
        )
    return json.loads(path.read_text())


def tokenizer_length(family: str, source: Source, tokenizer: str, default: int) -> int:
    """How many tokens a preset's (tiny, built-in-code) tokenizer keeps: the real model's
    length for ``random``, a short one for ``tiny``."""
    return preset(family, source.preset).get("_tokenizers", {}).get(tokenizer, default)


def class_of(path: str):
    """The class a "module.Class" path names (a family's ``parts.classes``, its pipeline)."""
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _construct(cls, config: dict):
    if cls.__module__.startswith("transformers"):
        return cls(cls.config_class(**config))
    return cls.from_config(config)


def released(family: str, pretrained: str) -> str | None:
    """The preset that holds the architecture of a released hub repo (its ``_repos``), so that
    ``raytuner plan`` needs no download for the models the shipped jobs name."""
    for name in preset_names(family):
        if pretrained in preset(family, name).get("_repos", []):
            return name
    return None


def config(family: str, source: Source, part: str, cls_path: str) -> dict:
    """A part's architecture config, without its weights: a preset's, a released repo's (from
    the package), else the folder's or hub repo's own."""
    if name := source.preset or released(family, source.repo):
        return preset(family, name)[part]["config"]
    cls = class_of(cls_path)
    if cls.__module__.startswith("transformers"):
        return cls.config_class.from_pretrained(source.repo, **source.hub(part)).to_dict()
    return dict(cls.load_config(source.repo, **source.hub(part)))


def load(family, source: Source, part: str, cls_path: str, *, device="cpu", weights: bool = True):
    """One part (``unet``, ``vae``, ``text_encoder``…: also its subfolder in a diffusers
    folder) of ``family`` (the family object: its ``name``, its single-file layout) in eval
    mode, its weights in ``source.dtype`` on ``device``: a preset's are drawn there directly.
    ``weights=False``: the architecture alone, with random weights (``raytuner plan`` builds it
    on the meta device)."""
    cls = class_of(cls_path)
    if source.preset or not weights:
        spec = preset(family.name, source.preset)[part] if source.preset else {}
        architecture = spec.get("config") or config(family.name, source, part, cls_path)
        place = torch.device(device)
        drawn = _draw_device(cls, architecture, source, place) if weights else place
        # the seed drawn on the device that builds the weights; every global RNG put back
        devices = [drawn.index or 0] if drawn.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), _default_dtype(source.dtype):
            torch.manual_seed(spec.get("seed", 0))
            with torch.device(drawn):
                model = _construct(cls, architecture)
        return placement.move(model, place).eval()
    started = time.perf_counter()
    _log_where_nobody_configured_logging()
    where = f"{source.pretrained} ({source.repo})" if source.single_file else source.repo
    name = family.name
    log.info("loading %s %s from %s in %s", name, part, where, _dtype_name(source.dtype))
    prefixes = dict(family.parts.single_file) if source.single_file else {}
    if part in prefixes:
        model = _from_single_file(family, source, part, cls, prefixes[part])
    else:
        key = "dtype" if cls.__module__.startswith("transformers") else "torch_dtype"
        model = cls.from_pretrained(source.repo, **source.hub(part), **{key: source.dtype})
    model = placement.move(model, device).eval()
    log.info("loaded %s %s in %.1f s", name, part, time.perf_counter() - started)
    return model


def _draw_device(cls, architecture: dict, source: Source, place: torch.device) -> torch.device:
    """Where a preset's random weights are drawn: ``place``, except that a full-size preset
    (``random``, ``random-9b``) meant for the host (block swap, float8 storage) is drawn on the
    GPU when one is there with room for it, then moved: drawing 12 B weights on a CPU takes
    minutes."""
    if not source.full_size or place.type != "cpu" or not torch.cuda.is_available():
        return place
    with _default_dtype(source.dtype), torch.device("meta"):
        size = sum(p.numel() * p.element_size() for p in _construct(cls, architecture).parameters())
    free, _ = torch.cuda.mem_get_info()
    return torch.device("cuda") if size < 0.8 * free else place


def _log_where_nobody_configured_logging() -> None:
    """Model loads are logged in every process, also where nothing set logging up (Ray Data's
    encoder actors): a load of a full-size model takes minutes, and its line tells why."""
    if not log.isEnabledFor(logging.INFO):
        log.setLevel(logging.INFO)
    if not log.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _from_single_file(family, source: Source, part: str, cls, prefix: str):
    """``part`` from a single-file checkpoint: its tensors (the keys under ``prefix``) in the
    family's ``single_file_state`` layout, then diffusers' ``from_single_file`` (diffusers
    models) or its LDM CLIP conversion (transformers text encoders), the architecture from the
    config repo's ``<part>/config.json`` (no model type is guessed from the file)."""
    from safetensors import safe_open

    with safe_open(source.pretrained, framework="pt") as f:
        names = [k for k in f.keys() if k.startswith(prefix)]  # noqa: SIM118 (not a dict)
        state = {k: f.get_tensor(k) for k in names}
    if not state:
        raise ValueError(
            f"model.pretrained = {source.pretrained!r} holds no {part} weights (no tensor named "
            f"{prefix}…): is it a {family.name} checkpoint in the original layout?"
        )
    state = family.single_file_state(part, state)
    if hasattr(cls, "from_single_file"):
        revision = {"config_revision": source.revision} if source.revision else {}
        model = cls.from_single_file(
            state, config=source.repo, subfolder=part, torch_dtype=source.dtype, **revision
        )
    else:
        from diffusers.loaders.single_file_utils import create_diffusers_clip_model_from_ldm

        model = create_diffusers_clip_model_from_ldm(
            cls, state, subfolder=part, config=source.repo, torch_dtype=source.dtype
        )
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        raise ValueError(
            f"model.pretrained = {source.pretrained!r}: its {part} lacks {len(missing)} tensors "
            f"of the architecture in {source.repo!r} (e.g. {missing[0]}): does "
            "model.single_file_config describe this file?"
        )
    return model
