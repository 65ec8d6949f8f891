"""Where a tensor cell lies in a cache data file (the format ``data/cache.py`` describes): a
PLAIN byte array's length prefix, each cell's byte offset from the Parquet footer, checked
against the cell's length and its checksum, and the row a byte offset falls in. The commit
locates every cell once (``locate``, ``describe``); the training reader reads at those offsets
(``data/reader.py``)."""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raytuner import storage
from raytuner.data.cache import (
    Version,
    cell_bytes,
    checksum,
    checksum_column,
    column_dtype,
    shape_column,
    tensor_columns,
)

LENGTH_PREFIX = 4  # PLAIN byte arrays: a little-endian uint32 length before the bytes


def row_at(meta: pq.FileMetaData, column: str, offset: int) -> int | None:
    """The row (= row group) of a data file whose ``column`` chunk holds byte ``offset``."""
    leaf = [meta.row_group(0).column(j).path_in_schema for j in range(meta.num_columns)]
    if column not in leaf:
        return None
    j = leaf.index(column)
    for g in range(meta.num_row_groups):
        chunk = meta.row_group(g).column(j)
        start = chunk.dictionary_page_offset or chunk.data_page_offset
        if start <= offset < start + chunk.total_compressed_size:
            return g
    return None


def read_parquet(data: pa.Buffer, columns: list[str] | None = None) -> pa.Table:
    """A data file held in memory (``storage.read_buffer``), read in the calling thread.

    ``pq.read_table`` scans on Arrow's worker threads, which may drop their last reference to
    the file's memory after the call returns; when that memory was Python's and the interpreter
    was exiting, the thread could not take the GIL and the process aborted (exit code 134 of
    ``raytuner cache verify``). Here no worker thread is started and none holds the memory."""
    reader = pq.ParquetFile(pa.BufferReader(data), pre_buffer=False)
    return reader.read(columns=columns, use_threads=False)


def locate(data: pa.Buffer, dtype: str, text_dtype: str | None = None):
    """The file's small columns (with ``<tensor>_xxh3``, every cell's checksum) plus
    ``<tensor>_at``, the byte offset of every tensor cell, checked against its length prefix
    and its checksum; and the tensor column names."""
    meta = pq.read_metadata(pa.BufferReader(data))
    schema = meta.schema.to_arrow_schema()
    tensors = tensor_columns(schema)
    small = [n for n in schema.names if n not in tensors]
    missing = [checksum_column(n) for n in tensors if checksum_column(n) not in small]
    if missing:
        raise ValueError(f"no checksum column {missing[0]} (written before format 4?)")
    table = read_parquet(data, small)
    leaf = {meta.row_group(0).column(j).path_in_schema: j for j in range(meta.num_columns)}
    view = memoryview(data)
    for name in tensors:
        stored = column_dtype(name, dtype, text_dtype)
        shapes = table.column(shape_column(name)).to_pylist()
        sums = table.column(checksum_column(name)).to_pylist()
        offsets = np.empty(meta.num_rows, np.int64)
        if meta.num_row_groups != meta.num_rows:
            raise ValueError(f"{meta.num_rows} rows in {meta.num_row_groups} row groups")
        for g in range(meta.num_row_groups):
            chunk = meta.row_group(g).column(leaf[name])
            end = chunk.dictionary_page_offset or chunk.data_page_offset
            end += chunk.total_compressed_size
            n = cell_bytes(shapes[g], stored)
            offsets[g] = at = end - n
            if int.from_bytes(bytes(data[at - LENGTH_PREFIX : at]), "little") != n:
                raise ValueError(f"row {g}: the {name} cell is not the tail of its column chunk")
            if checksum(view[at : at + n]) != sums[g]:
                raise ValueError(f"row {g}, column {name}: the cell's checksum differs")
        table = table.append_column(f"{name}_at", pa.array(offsets))
    return table, tensors


def describe(version: Version, rel: str, dtype: str, text_dtype: str | None = None):
    """A data file of ``version``: its manifest entry (rows, bytes, sha256 of its content) and
    its located rows (``locate``, with ``file`` = ``rel``), from one read of the file."""
    data = storage.read_buffer(version.fs, version.path(rel))
    try:
        located, _ = locate(data, dtype, text_dtype)
    except (OSError, ValueError, pa.ArrowInvalid) as e:
        raise ValueError(f"{version.path(rel)} is not in the cache's layout: {e}") from e
    entry = {
        "path": rel,
        "rows": located.num_rows,
        "bytes": data.size,
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    return entry, located.append_column("file", pa.array([rel] * located.num_rows))
