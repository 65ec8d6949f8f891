"""A part's weights by name, for a sharded worker that fills its rows of an empty model one
tensor at a time (``train/weights.py``'s ``_sharded``): read from a diffusers folder's or hub
repo's safetensors files as they are asked for, or, where the files cannot be read that way,
from the part built whole by ``parts.load``."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from raytuner.families import parts
from raytuner.families.parts import Source, load


class _Safetensors(Mapping):
    """Tensors by name from a part's safetensors files, each read when asked for (the files are
    mapped, not loaded): a sharded worker reads a 24 GB model one tensor at a time."""

    def __init__(self, files: list[str]) -> None:
        from safetensors import safe_open

        self._where: dict[str, str] = {}
        for path in files:
            with safe_open(path, framework="pt") as f:
                self._where |= dict.fromkeys(f.keys(), path)  # noqa: SIM118 (not a dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._where[name], framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


WEIGHTS_NAME = "diffusion_pytorch_model"  # a diffusers model's weights: <name>.safetensors


def _part_files(source: Source, part: str) -> list[str]:
    """The local safetensors files of a diffusers folder's / hub repo's ``part`` (one file, or
    the shards its index lists; the hub's are downloaded once into its cache); [] when it has
    none (a ``.bin`` only repo)."""
    index, single = f"{WEIGHTS_NAME}.safetensors.index.json", f"{WEIGHTS_NAME}.safetensors"
    if os.path.isdir(source.repo):
        folder = Path(source.repo, part)
        if (folder / index).is_file():
            names = set(json.loads((folder / index).read_text())["weight_map"].values())
            return [str(folder / n) for n in sorted(names)]
        return [str(folder / single)] if (folder / single).is_file() else []
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    kwargs = {"subfolder": part} | ({"revision": source.revision} if source.revision else {})
    try:
        path = hf_hub_download(source.repo, index, **kwargs)
    except EntryNotFoundError:
        try:
            return [hf_hub_download(source.repo, single, **kwargs)]
        except EntryNotFoundError:
            return []
    names = set(json.loads(Path(path).read_text())["weight_map"].values())
    return [hf_hub_download(source.repo, n, **kwargs) for n in sorted(names)]


def tensors(family, source: Source, part: str, cls_path: str) -> Mapping[str, torch.Tensor]:
    """``part``'s weights by their names in the model's state dict (what ``load`` would put in
    it), for a worker that fills its shard of an empty model: read one tensor at a time from a
    diffusers folder's or hub repo's safetensors files; a preset, a single file (whose keys
    diffusers converts as a whole) and a ``.bin``-only repo are built whole on the CPU, in
    ``source.dtype``, once per worker."""
    if not (source.preset or source.single_file) and (files := _part_files(source, part)):
        return _Safetensors(files)
    return load(family, source, part, cls_path).state_dict()


def computed_buffers(family, source: Source, part: str) -> dict[str, torch.Tensor]:
    """The buffers ``part``'s constructor computes and its files lack (Wan's rotary tables: not
    persistent), on the CPU, by name, for a model built on the meta device (a sharded worker's):
    the architecture built on meta once to find the modules that own buffers, again with their
    classes' constructor arguments recorded, then each of them built alone on the CPU."""
    cls_path = family.parts.classes[part]
    spec = parts.preset(family.name, source.preset)[part] if source.preset else {}
    architecture = spec.get("config") or parts.config(family.name, source, part, cls_path)

    def build():
        with parts._default_dtype(source.dtype), torch.device("meta"):
            return parts._construct(parts.class_of(cls_path), architecture)

    def owners(model) -> dict[str, torch.nn.Module]:
        return {
            name: m
            for name, m in model.named_modules()
            if any(b is not None and b.is_meta for b in m._buffers.values())
        }

    classes = {type(m) for m in owners(build()).values()}
    made: dict[int, tuple] = {}
    with _recording_inits(classes, made):
        model = build()
    out = {}
    for name, module in owners(model).items():
        klass, args, kwargs = made[id(module)]
        with parts._default_dtype(source.dtype):
            fresh = klass(*args, **kwargs)
        prefix = f"{name}." if name else ""
        own = {n: b for n, b in module._buffers.items() if b is not None and b.is_meta}
        out |= {prefix + n: fresh._buffers[n].to(b.dtype) for n, b in own.items()}
    return out


@contextlib.contextmanager
def _recording_inits(classes, made: dict[int, tuple]):
    """Each instance of ``classes`` made inside records its constructor's arguments in
    ``made`` (by id); the classes' own ``__init__`` put back after."""
    originals = {klass: klass.__dict__["__init__"] for klass in classes}

    def recording(original):
        def init(self, *args, **kwargs):
            made[id(self)] = (type(self), args, kwargs)
            original(self, *args, **kwargs)

        return init

    try:
        for klass, original in originals.items():
            klass.__init__ = recording(original)
        yield
    finally:
        for klass, original in originals.items():
            klass.__init__ = original
