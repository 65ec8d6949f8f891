"""A part's weights by name, for a sharded worker that fills its rows of an empty model one
tensor at a time (``train/weights.py``'s ``_sharded``): read from a diffusers folder's or hub
repo's safetensors files as they are asked for, or, where the files cannot be read that way,
from the part built whole by ``parts.load``."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

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
