"""Tensors in Parquet cells: each row's tensor is its own exactly-sized bytes plus its shape."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def to_cells(batch: torch.Tensor, dtype: str) -> tuple[list[bytes], np.ndarray]:
    """Split [B, ...] into B byte strings of exactly one row each, and their shapes [B, ndim]."""
    rows = batch.detach().to("cpu", DTYPES[dtype]).contiguous()
    cells = [row.view(torch.uint8).numpy().tobytes() for row in rows]
    shapes = np.tile(np.asarray(rows.shape[1:], dtype=np.int32), (len(cells), 1))
    return cells, shapes


def from_cells(cells: Sequence[bytes], shapes: Sequence[Sequence[int]], dtype: str) -> torch.Tensor:
    """Stack same-shaped cells back into one [B, ...] float tensor."""
    rows = [
        torch.frombuffer(bytearray(cell), dtype=DTYPES[dtype]).reshape(tuple(shape))
        for cell, shape in zip(cells, shapes, strict=True)
    ]
    return torch.stack(rows)
