"""Tensors in Parquet cells: each row's tensor is its own exactly-sized bytes plus its shape and
its checksum (``cache.checksum``), made here, where the bytes are."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from raytuner.data.cache import checksum
from raytuner.families.text import rows_kept

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def cell_column(batch: torch.Tensor, dtype: str) -> tuple[pa.BinaryArray, list[int], pa.Array]:
    """Split [B, ...] into B cells of exactly one row each: an Arrow binary column over the
    bytes of the tensor in the storage ``dtype`` (no copy of them but the cast itself), the
    shape of every cell, and each cell's checksum (stored beside it as ``<tensor>_xxh3``,
    checked on every read), hashed from those same bytes."""
    rows = batch.detach().to("cpu", DTYPES[dtype]).contiguous()
    n = rows.shape[0]
    data = rows.view(torch.uint8).reshape(-1).numpy()  # the tensor's own memory
    size = data.size // max(n, 1)
    offsets = np.arange(0, (n + 1) * size, size, dtype=np.int32)
    cells = pa.BinaryArray.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )
    view = memoryview(data)
    sums = pa.array([checksum(view[i * size : (i + 1) * size]) for i in range(n)], pa.uint64())
    return cells, list(rows.shape[1:]), sums


def ragged_cell_column(
    batch: torch.Tensor, dtype: str
) -> tuple[pa.BinaryArray, list[list[int]], pa.Array]:
    """``cell_column`` of each sample without its trailing all-zero rows (``rows_kept``): its
    tokens alone, each cell of its own shape, which the reader pads back with zero rows."""
    rows = batch.detach().to("cpu", DTYPES[dtype]).contiguous()
    kept = [r[:n].contiguous() for r, n in zip(rows, rows_kept(rows), strict=True)]
    raw = [r.view(torch.uint8).reshape(-1).numpy() for r in kept]
    cells = pa.array([b.tobytes() for b in raw], pa.binary())
    sums = pa.array([checksum(memoryview(b)) for b in raw], pa.uint64())
    return cells, [list(r.shape) for r in kept], sums


def to_cells(batch: torch.Tensor, dtype: str) -> tuple[list[bytes], np.ndarray, list[int]]:
    """``cell_column`` as Python values: B byte strings, their shapes [B, ndim] and their
    checksums."""
    cells, shape, sums = cell_column(batch, dtype)
    shapes = np.tile(np.asarray(shape, dtype=np.int32), (len(cells), 1))
    return cells.to_pylist(), shapes, sums.to_pylist()
