"""A safetensors file read as far as a check needs, not further: its header (each tensor's name,
dtype, shape and place; the metadata) and, on demand, single tensors by ranged reads. A local
path or a pyarrow URI (``s3://``). ``raytuner check`` reads a ``lora.init_from`` file this way:
its LoRA's ranks, modules and shapes without its weights."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable

import torch

from raytuner import storage

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER = 100 << 20  # safetensors' own limit on the header's length


class Header:
    """A safetensors file's header; ``tensors()`` the tensors as it describes them."""

    def __init__(self, path: str):
        """Read the header of ``path``; ValueError when it is no safetensors file, OSError
        when it cannot be read."""
        self.fs, self.where = storage.resolve(path)
        with self.fs.open_input_file(self.where) as f:
            size = f.size()
            (length,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
            if not 2 <= length <= min(MAX_HEADER, size - 8):
                raise ValueError(f"header length {length} in a file of {size} bytes")
            entries = json.loads(f.read(length))
        if not isinstance(entries, dict):
            raise ValueError("its header is not a JSON object")
        self.metadata: dict[str, str] = entries.pop("__metadata__", None) or {}
        self.start = 8 + length
        self.entries = entries
        for name, e in entries.items():
            begin, end = e["data_offsets"]
            if e["dtype"] not in DTYPES or end - begin != _nbytes(e) or self.start + end > size:
                raise ValueError(f"tensor {name}: {e['dtype']} {e['shape']} at {begin}..{end}")

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def load(self, name: str) -> torch.Tensor:
        """One tensor's values, read from the file (its bytes only)."""
        e = self.entries[name]
        begin, end = e["data_offsets"]
        with self.fs.open_input_file(self.where) as f:
            data = bytearray(f.read_at(end - begin, self.start + begin))
        dtype = DTYPES[e["dtype"]]
        if not data:
            return torch.empty(self.shape(name), dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(self.shape(name))

    def tensors(self, read_below: int = 16) -> dict[str, torch.Tensor]:
        """Every tensor as the header describes it: its values read where it has fewer than
        ``read_below`` elements (a LoRA's alpha scalars), else on the meta device (its dtype
        and shape; ``load`` reads it)."""
        return {
            name: self.load(name)
            if math.prod(e["shape"]) < read_below
            else torch.empty(e["shape"], dtype=DTYPES[e["dtype"]], device="meta")
            for name, e in self.entries.items()
        }


def _nbytes(entry: dict) -> int:
    return math.prod(entry["shape"]) * DTYPES[entry["dtype"]].itemsize


def checked(path: str, key: str) -> tuple[dict, dict[str, str], Callable]:
    """What a check reads of the file ``key`` names: its tensors (``Header.tensors``), its
    metadata and ``load``, a tensor's values when it is a header's (meta) tensor; ConfigError
    naming ``key`` where the file cannot be read or is not safetensors."""
    from raytuner.config import ConfigError

    try:
        file = Header(path)
    except OSError as e:
        raise ConfigError(f"{key} = {path!r}: cannot read it ({e})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{key} = {path!r}: not a safetensors file ({e})") from None
    tensors = file.tensors()
    names = {id(t): name for name, t in tensors.items()}

    def load(t: torch.Tensor) -> torch.Tensor:
        return file.load(names[id(t)]) if t.is_meta else t

    return tensors, file.metadata, load
