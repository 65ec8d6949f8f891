"""Checksums of a checkpoint's files, written with them and checked wherever they are read, as the
cache checks its cells: the xxh3-64 of the bytes (``xxhash``: tens of GB/s, the GIL released).

Each worker lists the files it wrote in ``checksums/rank-<rank>.json`` inside the checkpoint
(Ray's upload merges every worker's folder into one), a record per file, by its path inside the
checkpoint:

- a file read whole (``optimizer.pt``, the JSON records, a LoRA's export): its size and the
  xxh3 of its bytes;
- a file of trained tensors read by ranges (``weights/``, ``ema/``, ``optimizer/``: every
  worker's rows in safetensors files; ``weights.safetensors``, ``ema.safetensors``): its size,
  the xxh3 of its header and, for every tensor, one per block of whole rows of about ``BLOCK``
  bytes. A worker reading some rows of a tensor (``shards.RangeReader``) checks the blocks that
  hold them, reading at most a block more on either side; every byte of such a file is under
  its header's checksum or a block's.

A checkpoint without ``checksums/`` was written before them: read unchecked. A damaged file is
a ``DamagedFileError`` naming it.
"""

from __future__ import annotations

import json
import math
import os
import struct

import pyarrow.fs as pafs
import xxhash

from raytuner import storage
from raytuner.checkpoint.layout import CHECKSUMS

BLOCK = 8 * 1024 * 1024  # a tensor's rows are checksummed in blocks of about this many bytes


class DamagedFileError(ValueError):
    """A checkpoint file whose bytes are not the ones written (flipped, truncated, replaced);
    the message starts with its path."""


def digest(data) -> str:
    """The xxh3-64 of ``data`` (any buffer) as 16 hex digits."""
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def block_bytes(shape, itemsize: int, block: int) -> int:
    """The bytes of a checksum block of a tensor of ``shape``: whole rows (a row: the tensor's
    elements under its first index), as many as fit in ``block``, at least one."""
    row = math.prod(shape[1:]) * itemsize if len(shape) else itemsize
    return max(row, 1) * max(1, block // max(row, 1))


def _header_bytes(f) -> bytes:
    """A safetensors file's 8-byte length and its JSON header, read from an open file."""
    prefix = f.read(8)
    (length,) = struct.unpack("<Q", prefix)
    return prefix + f.read(length)


def _tensor_sums(path: str, block: int) -> dict:
    """The record of a local safetensors file of trained tensors."""
    with open(path, "rb") as f:
        header = _header_bytes(f)
        entries = json.loads(header[8:])
        entries.pop("__metadata__", None)
        sums = {}
        for name, entry in entries.items():
            start, end = entry["data_offsets"]
            step = block_bytes(entry["shape"], _ITEMSIZE[entry["dtype"]], block)
            f.seek(len(header) + start)
            sums[name] = [digest(f.read(min(step, end - at))) for at in range(start, end, step)]
            sums[name] = sums[name] or [digest(b"")]
    size = os.path.getsize(path)
    return {"size": size, "header": digest(header), "block": block, "tensors": sums}


def _whole_sum(path: str) -> dict:
    hasher = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(storage.COPY_CHUNK):
            hasher.update(chunk)
    return {"size": os.path.getsize(path), "xxh3": hasher.hexdigest()}


def write(directory: str, name: str, ranged, block: int = BLOCK) -> None:
    """The checksums of every file under the local folder ``directory`` (read back from the
    disk) into ``checksums/<name>``; ``ranged(path inside the folder)``: whether the file holds
    trained tensors read by ranges."""
    files = {}
    for folder, _, names in os.walk(directory):
        for file in names:
            path = os.path.join(folder, file)
            rel = os.path.relpath(path, directory).replace(os.sep, "/")
            if rel.split("/")[0] != CHECKSUMS:
                files[rel] = _tensor_sums(path, block) if ranged(rel) else _whole_sum(path)
    os.makedirs(os.path.join(directory, CHECKSUMS), exist_ok=True)
    with open(os.path.join(directory, CHECKSUMS, name), "w") as f:
        json.dump({"format": 1, "files": files}, f, indent=1, sort_keys=True)


class Sums:
    """A checkpoint's checksums (every worker's list), checked against its files by path."""

    def __init__(self, root: str, files: dict[str, dict]) -> None:
        self.root, self.files = root.rstrip("/"), files

    @classmethod
    def read(cls, fs: pafs.FileSystem, checkpoint: str) -> Sums | None:
        """The checksums of a checkpoint on ``fs``; None where it has none (written before)."""
        folder = storage.join(checkpoint, CHECKSUMS)
        if not storage.exists(fs, folder):
            return None
        files: dict[str, dict] = {}
        for info in storage.listdir(fs, folder):
            try:
                files |= storage.read_json(fs, info.path)["files"]
            except (ValueError, KeyError, TypeError) as e:
                raise DamagedFileError(f"{info.path}: not a checksum list ({e})") from None
        return cls(checkpoint, files)

    def of(self, path: str) -> dict:
        """The record of the file at ``path`` (inside the checkpoint)."""
        rel = path[len(self.root) + 1 :] if path.startswith(self.root + "/") else path
        if rel not in self.files:
            raise DamagedFileError(f"{path}: the checkpoint's {CHECKSUMS}/ lists no such file")
        return self.files[rel]

    def under(self, folder: str) -> list[str]:
        """The paths of the listed files under ``folder`` (inside the checkpoint)."""
        rel = folder[len(self.root) + 1 :].rstrip("/") + "/"
        return [storage.join(self.root, f) for f in sorted(self.files) if f.startswith(rel)]

    def copy(self, fs: pafs.FileSystem, path: str, out_fs: pafs.FileSystem, out: str) -> None:
        """Copy a file read whole (``storage.copy_stream``), checked on the way: a damaged file
        raises before it is in place at ``out``."""
        record, hasher, size = self.of(path), xxhash.xxh3_64(), 0
        with fs.open_input_stream(path) as f, storage.atomic_output(out_fs, out) as target:
            while chunk := f.read(storage.COPY_CHUNK):
                hasher.update(chunk)
                size += len(chunk)
                target.write(chunk)
            check_size(path, size, record)
            compare(path, "its bytes", hasher.hexdigest(), record.get("xxh3", "none"))

    def check(self, fs: pafs.FileSystem, path: str) -> None:
        """Read the whole file at ``path`` and compare it with its checksums."""
        record = self.of(path)
        check_size(path, fs.get_file_info(path).size, record)
        with fs.open_input_stream(path) as f:
            if "xxh3" in record:
                hasher = xxhash.xxh3_64()
                while chunk := f.read(storage.COPY_CHUNK):
                    hasher.update(chunk)
                compare(path, "its bytes", hasher.hexdigest(), record["xxh3"])
            else:
                _check_tensors(path, f, record)


def check_size(path: str, size: int, record: dict) -> None:
    if size != record["size"]:
        raise DamagedFileError(
            f"{path}: {size:,} bytes, {record['size']:,} were written (truncated or replaced)"
        )


def compare(path: str, what: str, got: str, written: str) -> None:
    if got != written:
        raise DamagedFileError(
            f"{path}: {what} differ from the checksum written with them (xxh3 {got}, "
            f"written {written}): the file is damaged"
        )


def _check_tensors(path: str, f, record: dict) -> None:
    """A safetensors file of trained tensors read whole from the stream ``f``."""
    header = bytes(_header_bytes(f))
    compare(path, "its header's bytes", digest(header), record["header"])
    entries = json.loads(header[8:])
    entries.pop("__metadata__", None)
    at = 0  # data bytes read so far (safetensors: the tensors one after the other, in order)
    for name, entry in sorted(entries.items(), key=lambda e: e[1]["data_offsets"][0]):
        start, end = entry["data_offsets"]
        f.read(start - at)
        step = block_bytes(entry["shape"], _ITEMSIZE[entry["dtype"]], record["block"])
        sums = record["tensors"].get(name, [])
        for i, offset in enumerate(range(start, end, step)):
            data = f.read(min(step, end - offset))
            written = sums[i] if i < len(sums) else "none"
            compare(path, f"the bytes of {name} (block {i})", digest(data), written)
        at = end


# safetensors' dtype names -> bytes per element
_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}  # fmt: skip
