"""A committed cache of made-up rows in the real format (the same Parquet layout, index and
manifest as ``raytuner preprocess`` writes): for `raytuner bench feed` and for tests that need
many rows or full-size tensors without encoding images.

Row ``i``'s latent is filled with ``i % 251`` and caption ``c``'s tensors with ``c % 251`` (the
empty caption's with -1), so a reader's output can be traced back to its rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa
import torch

from raytuner.config import SourceConfig
from raytuner.data import cache, index
from raytuner.data.keys import caption_key
from raytuner.data.tensors import DTYPES, to_cells
from raytuner.preprocess.stream_rows import SHAPE
from raytuner.preprocess.worklist import Plan, report

# Latent rows as the cache stores them: plain Arrow types, readable without Ray.
LATENT_SCHEMA = {
    "key": pa.string(),
    "path": pa.string(),
    "status": pa.string(),
    "reason": pa.string(),
    "width": pa.int32(),
    "height": pa.int32(),
    "original_size": SHAPE,
    "crop_top_left": SHAPE,
    "latent": pa.binary(),
    "latent_shape": SHAPE,
    cache.checksum_column("latent"): pa.uint64(),
}


def _column(values, kind: pa.DataType) -> pa.Array:
    if pa.types.is_list(kind):
        return pa.array([[int(x) for x in v] for v in values], kind)
    if pa.types.is_binary(kind):
        return pa.array([bytes(v) for v in values], kind)
    if pa.types.is_uint64(kind):  # checksums: numpy would make floats of the large ones
        return pa.array([int(v) for v in values], kind)
    return pa.array(np.asarray(values).tolist(), kind)


def to_table(columns: dict, schema: dict[str, pa.DataType]) -> pa.Table:
    return pa.table({name: _column(columns[name], kind) for name, kind in schema.items()})


RUN = "parts/synthetic"
SOURCE = "synthetic://rows"  # the source of the rows when no job's is given
Shapes = Callable[[int, int], dict[str, tuple[int, ...]]]  # (width, height) -> name -> shape


def _chunks(n: int, size: int) -> Iterator[range]:
    for start in range(0, n, size):
        yield range(start, min(n, start + size))


def _fill(shape: tuple[int, ...], value: float, dtype: str) -> tuple[bytes, int]:
    """One cell of ``value`` and its checksum."""
    cells, _, sums = to_cells(torch.full((1, *shape), value, dtype=DTYPES[dtype]), dtype)
    return cells[0], sums[0]


def _write_latents(
    version, buckets, shapes: Shapes, dtype: str, per_file: int, std: float
) -> list[str]:
    keys = [hashlib.sha256(f"synthetic/{i}".encode()).hexdigest() for i in range(len(buckets))]
    schema = {k: t for k, t in LATENT_SCHEMA.items() if k != "status"}
    if std:
        schema |= {"latent_std": pa.binary(), cache.checksum_column("latent_std"): pa.uint64()}
    for n, rows in enumerate(_chunks(len(buckets), per_file)):
        columns: dict[str, list] = {name: [] for name in schema}
        for i in rows:
            w, h = buckets[i]
            shape = shapes(w, h)["latent"]
            columns["key"].append(keys[i])
            columns["path"].append(f"{w}x{h}/{i:07d}.png")
            columns["reason"].append("")
            columns["width"].append(w)
            columns["height"].append(h)
            columns["original_size"].append([h, w])
            columns["crop_top_left"].append([0, 0])
            columns["latent_shape"].append(list(shape))
            for name, value in [("latent", float(i % 251))] + [("latent_std", std)] * bool(std):
                cell, sum_ = _fill(shape, value, dtype)
                columns[name].append(cell)
                columns[cache.checksum_column(name)].append(sum_)
        rel = cache.part_file(RUN, cache.LATENTS, f"part-{n:07d}")
        cache.write_part(version.fs, version.path(rel), to_table(columns, schema))
    return keys


def _write_text(version, captions: list[str], text: dict, dtype: str, per_file: int) -> None:
    for n, rows in enumerate(_chunks(len(captions), per_file)):
        columns = {
            "caption_key": [caption_key(captions[c]) for c in rows],
            "caption": [captions[c] for c in rows],
            "truncated": [False] * len(rows),
        }
        schema = {"caption_key": pa.string(), "caption": pa.string(), "truncated": pa.bool_()}
        for name, shape in text.items():
            values = [float(c % 251) if captions[c] else -1.0 for c in rows]
            cells = [_fill(shape, v, dtype) for v in values]
            columns[name] = [cell for cell, _ in cells]
            columns[f"{name}_shape"] = [list(shape)] * len(rows)
            columns[cache.checksum_column(name)] = [sum_ for _, sum_ in cells]
            schema |= {name: pa.binary(), f"{name}_shape": SHAPE}
            schema[cache.checksum_column(name)] = pa.uint64()
        rel = cache.part_file(RUN, cache.TEXT, f"part-{n:07d}")
        cache.write_part(version.fs, version.path(rel), to_table(columns, schema))


def write_cache(
    version: cache.Version,
    *,
    buckets: list[tuple[int, int]],
    captions: list[int],
    repeats: list[int],
    shapes: Shapes,
    family: str,
    dtype: str = "bfloat16",
    rows_per_file: int = 8,
    std: float = 0.0,
    sources: list | None = None,
    source_of: list[int] | None = None,
) -> dict:
    """Commit one row per entry of ``buckets`` ((width, height) of row i), with caption number
    ``captions[i]`` and ``repeats[i]``; ``shapes``: the tensors' shapes at a bucket; ``std``
    > 0: every latent also stores a posterior std of that value; ``sources``: the job whose
    dataset the rows are (its ``data.all_sources()``: `raytuner train` of that job trains
    them), else a source of their own; ``source_of[i]``: row i's place among ``sources`` (its
    frame rate is that source's ``fps``), else the first. Returns the manifest."""
    keys = _write_latents(version, buckets, shapes, dtype, rows_per_file, std)
    texts = [f"synthetic caption {c}" for c in sorted(set(captions))] + [""]
    text_shapes = {k: v for k, v in shapes(*buckets[0]).items() if k != "latent"}
    _write_text(version, texts, text_shapes, dtype, rows_per_file)
    located = index.Located(version, dtype, None)
    located.refresh()
    rows = [
        {
            "source_index": source_of[i] if source_of else 0,
            "source": "synthetic",
            "path": f"{w}x{h}/{i:07d}.png",
            "key": keys[i],
            "caption": f"synthetic caption {c}",
            "caption_key": caption_key(f"synthetic caption {c}"),
            "caption_from": "file",
            "repeats": r,
            "size": 0,
            "mtime_ns": 0,
            "bucket": f"{w}x{h}",
        }
        for i, ((w, h), c, r) in enumerate(zip(buckets, captions, repeats, strict=True))
    ]
    rep = report(len(rows), Plan(new=rows), rows, 0, 0.0)
    sources = sources or [SourceConfig(path=SOURCE)]
    extra = {"family": family, "dtype": dtype, "report": rep}
    return index.commit(version, RUN, rows, located, sources=sources, **extra)
