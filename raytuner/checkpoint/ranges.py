"""Distributed Checkpoint (DCP) folders in its safetensors format, read through a pyarrow
filesystem (local disk, a shared filesystem, object storage): ``RangeReader``, a DCP storage
reader that fetches each file's header, then only the bytes of the rows asked for.

``HuggingFaceStorageWriter(save_distributed=True)`` writes such a folder: each worker's rows of
every tensor in a file of its own, the rows' offsets in the tensor in the file's header
(``DCP_SHARDING_INFO``). A plain safetensors file (no offsets: every tensor whole) reads the
same way. DCP's own ``HuggingFaceStorageReader`` reads local files only, whole files mapped; a
resumed worker of a 143 GB checkpoint on object storage must fetch its rows alone.
"""

from __future__ import annotations

import json
import math
import struct
import uuid
from dataclasses import dataclass

import pyarrow.fs as pafs
import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.futures import Future

from raytuner import storage
from raytuner.checkpoint import checksums

# safetensors' dtype names
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


@dataclass(frozen=True)
class _Chunk:
    """Where a worker's rows of a tensor lie: the file, their shape and dtype, the offset of
    their first byte; their checksums (one per ``step`` bytes of whole rows; None: unchecked)."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    sums: tuple[str, ...] | None = None
    step: int = 0


class RangeReader(StorageReader):
    """DCP's reader of a folder of safetensors files written by ``HuggingFaceStorageWriter``
    (each file a worker's rows, their offsets in its header), through a pyarrow filesystem:
    the headers are read once, then each requested piece of rows by a ranged read of exactly
    its bytes (a piece that is not whole rows: its chunk, then sliced). DCP's own
    ``HuggingFaceStorageReader`` does the same on local files only."""

    def __init__(
        self, fs: pafs.FileSystem, folder: str, sums: checksums.Sums | None = None
    ) -> None:
        """``folder``: a folder of safetensors files, or one such file; ``sums``: the
        checkpoint's checksums, checked on every read (none: unchecked)."""
        super().__init__()
        self.fs, self.folder, self.sums = fs, folder, sums
        self.chunks: dict[MetadataIndex, _Chunk] = {}
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id=None) -> None:
        self.load_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self._metadata is None:
            self._metadata = self._read_headers()
        return self._metadata

    def _read_headers(self) -> Metadata:
        tensors: dict[str, TensorStorageMetadata] = {}
        for path in self.files():
            header, start = _header(self.fs, path, self.sums)
            offsets = json.loads(header.pop("__metadata__", {}).get(SHARDING, "{}"))
            record = self.sums.of(path) if self.sums is not None else None
            for name, entry in header.items():
                shape, dtype = tuple(entry["shape"]), DTYPES[entry["dtype"]]
                offset = offsets.get(name, {}).get("saved_offsets", [0] * len(shape))
                chunk = ChunkStorageMetadata(torch.Size(offset), torch.Size(shape))
                if name not in tensors:
                    tensors[name] = TensorStorageMetadata(
                        TensorProperties(dtype=dtype), torch.Size(shape), []
                    )
                meta = tensors[name]
                meta.chunks.append(chunk)
                end = [o + n for o, n in zip(offset, shape, strict=True)]
                meta.size = torch.Size(max(a, b) for a, b in zip(meta.size, end, strict=True))
                at = start + entry["data_offsets"][0]
                sums, step = None, 0
                if record is not None:  # this chunk's checksums, a block of rows each
                    sums = tuple(record["tensors"].get(name, ()))
                    step = checksums.block_bytes(shape, dtype.itemsize, record["block"])
                index = MetadataIndex(name, offset)
                self.chunks[index] = _Chunk(path, shape, dtype, at, sums, step)
        return Metadata(state_dict_metadata=tensors, storage_data=self.chunks)

    def files(self) -> list[str]:
        if self.fs.get_file_info(self.folder).type == pafs.FileType.File:
            return [self.folder]
        found = storage.listdir(self.fs, self.folder)
        return sorted(i.path for i in found if i.path.endswith(".safetensors"))

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor's whole shape and dtype."""
        saved = self.read_metadata().state_dict_metadata
        return {k: (tuple(m.size), m.properties.dtype) for k, m in saved.items()}

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The named tensors whole, in this process alone (no collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        shapes = self.shapes()
        out = {n: torch.empty(shapes[n][0], dtype=shapes[n][1]) for n in names}
        planner = DefaultLoadPlanner(allow_partial_load=True)
        try:
            dcp.load(out, storage_reader=self, planner=planner, no_dist=True)
        except CheckpointException as e:  # a BaseException: the error this process raised
            raise next(iter(e.failures.values()))[0] from None
        return out

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *a, **k) -> None:
        self.chunks = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner) -> Future:
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.chunks[item.storage_index].path, []).append(item)
        for path, items in by_file.items():
            with self.fs.open_input_file(path) as f:
                for item in items:
                    piece = _read_piece(f, self.chunks[item.storage_index], item)
                    target = planner.resolve_tensor(item).detach()
                    target.copy_(piece)
                    planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done


SHARDING = "DCP_SHARDING_INFO"  # the safetensors metadata key DCP writes the rows' offsets to


def _header(fs: pafs.FileSystem, path: str, sums: checksums.Sums | None) -> tuple[dict, int]:
    """A safetensors file's header and where its data starts (two ranged reads), checked
    against the file's size (a truncated file) and, with ``sums``, its checksum."""
    with fs.open_input_file(path) as f:
        size = f.size()
        if size < 8:
            raise checksums.DamagedFileError(f"{path}: {size} bytes, no safetensors header")
        prefix = bytes(f.read_at(8, 0))
        (length,) = struct.unpack("<Q", prefix)
        raw = bytes(f.read_at(length, 8)) if length <= size - 8 else b""
    if sums is not None:
        record = sums.of(path)
        checksums.check_size(path, size, record)
        got = checksums.digest(prefix + raw)
        checksums.compare(path, "its header's bytes", got, record["header"])
    try:
        header = json.loads(raw)
    except ValueError:
        raise checksums.DamagedFileError(f"{path}: its safetensors header is damaged") from None
    ends = [e["data_offsets"][1] for k, e in header.items() if k != "__metadata__"]
    if 8 + length + max(ends, default=0) > size:
        raise checksums.DamagedFileError(
            f"{path}: {size:,} bytes, its header needs {8 + length + max(ends):,} (truncated)"
        )
    return header, 8 + length


def _read_piece(f, chunk: _Chunk, item) -> torch.Tensor:
    """The piece of a stored chunk a read item asks for: whole rows by one ranged read of
    their bytes, anything else from the chunk read whole. With checksums, the read widens to
    the whole blocks that hold the rows, each checked."""
    offsets, lengths = list(item.storage_offsets), list(item.lengths)
    size = chunk.dtype.itemsize
    if not chunk.shape:
        return _tensor(_read_rows(f, chunk, 0, 1, size), chunk.dtype, ())
    row = math.prod(chunk.shape[1:]) * size
    if offsets[1:] == [0] * (len(offsets) - 1) and tuple(lengths[1:]) == chunk.shape[1:]:
        data = _read_rows(f, chunk, offsets[0], lengths[0], row)
        return _tensor(data, chunk.dtype, tuple(lengths))
    whole = _tensor(_read_rows(f, chunk, 0, chunk.shape[0], row), chunk.dtype, chunk.shape)
    return whole[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]


def _read_rows(f, chunk: _Chunk, first: int, count: int, row: int):
    """The bytes of rows ``first`` .. ``first + count`` of a chunk (``row`` bytes each), their
    checksum blocks checked when the chunk has checksums."""
    if chunk.sums is None or not count or not row:
        return f.read_at(count * row, chunk.start + first * row)
    total = (chunk.shape[0] if chunk.shape else 1) * row
    begin = first * row // chunk.step * chunk.step
    end = min(total, -(-(first + count) * row // chunk.step) * chunk.step)
    data = memoryview(f.read_at(end - begin, chunk.start + begin))
    for at in range(0, end - begin, chunk.step):
        i = (begin + at) // chunk.step
        written = chunk.sums[i] if i < len(chunk.sums) else "none"
        got = checksums.digest(data[at : at + chunk.step])
        checksums.compare(chunk.path, f"the bytes of a tensor's rows (block {i})", got, written)
    skip = first * row - begin
    return data[skip : skip + count * row]


def _tensor(data, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not len(data):  # a worker's empty rows (fewer rows than workers)
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
