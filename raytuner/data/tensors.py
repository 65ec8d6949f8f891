"""Tensors in Parquet cells: each row's tensor is its own exactly-sized bytes plus its shape and
its checksum (``cache.checksum``), made here, where the bytes are, and read back here
(``from_cell``).

A cell stored in ``float8`` (``preprocess.text_dtype``: text tensors only) is its elements in
float8 e4m3 (divided by a power of two that brings each row of the last axis, a token's
features, within e4m3's range) followed by that float32 scale of every such row
(``cache.cell_bytes``); ``from_cell`` multiplies them back. Every other dtype is the tensor's
own bytes."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import torch

from raytuner.data.cache import FLOAT8, checksum
from raytuner.families.text import rows_kept

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    FLOAT8: torch.float8_e4m3fn,
}
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def _row_bytes(rows: torch.Tensor, dtype: str) -> torch.Tensor:
    """[B, ...] as [B, bytes]: each sample's cell in the storage ``dtype`` (float8: its scaled
    e4m3 elements, then the float32 scale of every row of its last axis)."""
    n = rows.shape[0]
    if dtype != FLOAT8:
        rows = rows.detach().to("cpu", DTYPES[dtype]).contiguous()
        return rows.view(torch.uint8).reshape(n, -1)
    values = rows.detach().to("cpu", torch.float32)
    # a power of two (exact to divide and multiply back: a 0/1 mask stays exact) that brings
    # the row's largest value within e4m3's range; 0 for an all-zero row
    amax = values.abs().amax(dim=-1, keepdim=True)
    power = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    scale = torch.where(amax > 0, power, torch.zeros_like(amax))
    quantized = (values / scale.clamp_min(torch.finfo(torch.float32).tiny)).to(DTYPES[FLOAT8])
    elements = quantized.contiguous().view(torch.uint8).reshape(n, -1)
    scales = scale.contiguous().view(torch.uint8).reshape(n, -1)
    return torch.cat([elements, scales], dim=1)


def cell_column(batch: torch.Tensor, dtype: str) -> tuple[pa.BinaryArray, list[int], pa.Array]:
    """Split [B, ...] into B cells of exactly one row each: an Arrow binary column over the
    bytes of the tensor in the storage ``dtype`` (no copy of them but the cast itself), the
    shape of every cell, and each cell's checksum (stored beside it as ``<tensor>_xxh3``,
    checked on every read), hashed from those same bytes."""
    n = batch.shape[0]
    data = _row_bytes(batch, dtype).reshape(-1).numpy()  # the tensor's own memory
    size = data.size // max(n, 1)
    offsets = np.arange(0, (n + 1) * size, size, dtype=np.int32)
    cells = pa.BinaryArray.from_buffers(
        pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )
    view = memoryview(data)
    sums = pa.array([checksum(view[i * size : (i + 1) * size]) for i in range(n)], pa.uint64())
    return cells, list(batch.shape[1:]), sums


def ragged_cell_column(
    batch: torch.Tensor, dtype: str
) -> tuple[pa.BinaryArray, list[list[int]], pa.Array]:
    """``cell_column`` of each sample without its trailing all-zero rows (``rows_kept``): its
    tokens alone, each cell of its own shape, which the reader pads back with zero rows."""
    rows = batch.detach().to("cpu")
    rows = rows if dtype == FLOAT8 else rows.to(DTYPES[dtype])
    kept = [r[:n] for r, n in zip(rows, rows_kept(rows), strict=True)]
    raw = [_row_bytes(r.unsqueeze(0), dtype).reshape(-1).numpy() for r in kept]
    cells = pa.array([b.tobytes() for b in raw], pa.binary())
    sums = pa.array([checksum(memoryview(b)) for b in raw], pa.uint64())
    return cells, [list(r.shape) for r in kept], sums


def from_cell(data, offset: int, shape, dtype: str, compute: torch.dtype) -> torch.Tensor:
    """The tensor of the cell at ``offset`` of ``data`` (a buffer), of ``shape``, stored in
    ``dtype``: a view of the bytes, or for float8 its elements times their rows' scales in
    ``compute`` (float32 math, then cast)."""
    count = math.prod(shape)
    if dtype != FLOAT8:
        return torch.frombuffer(data, dtype=DTYPES[dtype], offset=offset, count=count).view(
            tuple(shape)
        )
    if not count:
        return torch.zeros(tuple(shape), dtype=compute)
    raw = torch.frombuffer(data, dtype=torch.uint8, offset=offset, count=count)
    elements = raw.view(DTYPES[FLOAT8]).view(tuple(shape)).to(torch.float32)
    rows = math.prod(shape[:-1])
    scales = torch.frombuffer(data, dtype=torch.uint8, offset=offset + count, count=rows * 4)
    scales = scales.clone().view(torch.float32).view(*shape[:-1], 1)  # copied: aligned
    return (elements * scales).to(compute)


def to_cells(batch: torch.Tensor, dtype: str) -> tuple[list[bytes], np.ndarray, list[int]]:
    """``cell_column`` as Python values: B byte strings, their shapes [B, ndim] and their
    checksums."""
    cells, shape, sums = cell_column(batch, dtype)
    shapes = np.tile(np.asarray(shape, dtype=np.int32), (len(cells), 1))
    return cells.to_pylist(), shapes, sums.to_pylist()


def stacked(cells: list[torch.Tensor], dtype: torch.dtype | None, pin: bool = False):
    """The cells as one [B, ...] tensor of ``dtype`` (None: the cells' own), in pinned memory
    when ``pin``: one copy, converting as it goes, in one call (a Python loop over the rows held
    the GIL the training step wanted). Cells of several lengths (the first axis: a family that
    stores a caption's tokens alone) are each followed by zero rows up to the longest."""
    dtype = dtype or cells[0].dtype
    lengths = {c.shape[0] for c in cells} if cells and cells[0].dim() else set()
    if len(lengths) > 1:  # a family's captions of their own lengths: zero rows after each
        out = torch.zeros((len(cells), max(lengths), *cells[0].shape[1:]), dtype=dtype)
        out = out.pin_memory() if pin else out
        for row, cell in zip(out, cells, strict=True):
            row[: cell.shape[0]] = cell
        return out
    out = torch.empty((len(cells), *cells[0].shape), dtype=dtype, pin_memory=pin)
    return torch.stack(cells, out=out)
