"""Tensors in Parquet cells: each row's tensor is its own exactly-sized bytes plus its shape and
its checksum (``cache.checksum``), made here, where the bytes are."""

from __future__ import annotations

import numpy as np
import torch

from raytuner.data.cache import checksum

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def to_cells(batch: torch.Tensor, dtype: str) -> tuple[list[bytes], np.ndarray, list[int]]:
    """Split [B, ...] into B byte strings of exactly one row each, their shapes [B, ndim] and
    their checksums (stored beside them as ``<tensor>_xxh3``, checked on every read)."""
    rows = batch.detach().to("cpu", DTYPES[dtype]).contiguous()
    cells = [row.view(torch.uint8).numpy().tobytes() for row in rows]
    shapes = np.tile(np.asarray(rows.shape[1:], dtype=np.int32), (len(cells), 1))
    return cells, shapes, [checksum(cell) for cell in cells]
