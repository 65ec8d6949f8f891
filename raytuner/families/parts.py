"""Where a family's parts come from, in which precision: the one loader of every model part.

``model.pretrained`` names a diffusers folder or hub repo, or one of two presets shipped in the
package (``configs/<family>.<preset>.json``): ``tiny`` (a few thousand parameters, for tests and
demos) and ``random`` (the released architecture at full size: for planning, benchmarks and GPU
checks without the hub). A preset is the family's part configs; both presets are built by the
same code, with seeded random weights, directly in the requested dtype and on the requested
device (the meta device for ``raytuner plan``), so no float32 copy of a half-precision model is
ever made. A folder or repo loads with ``from_pretrained(..., torch_dtype=dtype)``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from raytuner import placement

PRESETS = ("tiny", "random")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CONFIGS = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class Source:
    """Which weights to load (a preset name, a folder or a hub id) and the dtype of the frozen
    ones (``model.dtype`` resolved for the device that runs them)."""

    pretrained: str
    revision: str = ""
    dtype: torch.dtype = torch.float32

    @property
    def preset(self) -> str | None:
        return self.pretrained if self.pretrained in PRESETS else None

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


def source(pretrained: str, revision: str, dtype: str, device) -> Source:
    """The job's ``[model]`` keys as a Source for parts run on ``device``."""
    return Source(pretrained, revision, resolve_dtype(dtype, device))


@functools.cache
def preset(family: str, name: str) -> dict:
    """A preset's part configs: part name -> {"config": constructor kwargs, "seed": ...}."""
    path = CONFIGS / f"{family}.{name}.json"
    if not path.exists():
        raise ValueError(f"model.pretrained = {name!r}: family {family!r} has no such preset")
    return json.loads(path.read_text())


def tokenizer_length(family: str, source: Source, tokenizer: str, default: int) -> int:
    """How many tokens a preset's (tiny, built-in-code) tokenizer keeps: the real model's
    length for ``random``, a short one for ``tiny``."""
    return preset(family, source.preset).get("_tokenizers", {}).get(tokenizer, default)


def _class(path: str):
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
    for name in PRESETS:
        path = CONFIGS / f"{family}.{name}.json"
        if path.exists() and pretrained in preset(family, name).get("_repos", []):
            return name
    return None


def config(family: str, source: Source, part: str, cls_path: str) -> dict:
    """A part's architecture config, without its weights: a preset's, a released repo's (from
    the package), else the folder's or hub repo's own."""
    if name := source.preset or released(family, source.pretrained):
        return preset(family, name)[part]["config"]
    cls = _class(cls_path)
    if cls.__module__.startswith("transformers"):
        return cls.config_class.from_pretrained(source.pretrained, **source.hub(part)).to_dict()
    return dict(cls.load_config(source.pretrained, **source.hub(part)))


def load(
    family: str, source: Source, part: str, cls_path: str, *, device="cpu", weights: bool = True
):
    """One part of a family (``unet``, ``vae``, ``text_encoder``…: also its subfolder in a
    diffusers folder) in eval mode, its weights in ``source.dtype`` on ``device``: a preset's
    are drawn there directly. ``weights=False``: the architecture alone, with random weights
    (``raytuner plan`` builds it on the meta device)."""
    cls = _class(cls_path)
    if source.preset or not weights:
        spec = preset(family, source.preset)[part] if source.preset else {}
        architecture = spec.get("config") or config(family, source, part, cls_path)
        # the seed drawn on the device that builds the weights; every global RNG put back
        place = torch.device(device)
        devices = [place.index or 0] if place.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), _default_dtype(source.dtype):
            torch.manual_seed(spec.get("seed", 0))
            with torch.device(device):
                model = _construct(cls, architecture)
        return model.eval()
    key = "dtype" if cls.__module__.startswith("transformers") else "torch_dtype"
    model = cls.from_pretrained(source.pretrained, **source.hub(part), **{key: source.dtype})
    return placement.move(model, device).eval()


def loader(family: str, classes: dict[str, str]):
    """A family's part loader: ``(source, part, device="cpu", weights=True) -> module``, the
    part's class looked up in ``classes``."""

    def load_part(source: Source, part: str, device="cpu", weights: bool = True):
        return load(family, source, part, classes[part], device=device, weights=weights)

    return load_part
