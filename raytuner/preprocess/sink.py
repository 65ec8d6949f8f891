"""The preprocess stream's sink: Ray Data write tasks that store each block's latents, masks
and text tensors as the cache's data files (``cache.write_part``: atomic, in the cache's
layout) and hand the driver the probe columns of every listed file. No torch here: write tasks
start fast."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc
from ray.data import Datasink
from ray.data.block import BlockAccessor

from raytuner.data import cache
from raytuner.preprocess.progress import clock, timed
from raytuner.preprocess.stream_rows import LATENT, MASK, PROBE_COLUMNS, STREAM_SCHEMA, TEXT

ROW_COLUMNS = ["key", "path", "width", "height", "original_size", "crop_top_left"]


def _cell_columns(tensors: list[str]) -> list[str]:
    """The columns of these tensors: each cell, its shape and its checksum (made by the
    encoder with the cell's bytes)."""
    columns = (c for t in tensors for c in (t, cache.shape_column(t), cache.checksum_column(t)))
    return list(dict.fromkeys(columns))  # latent_std shares the latent's shape


class PartSink(Datasink):
    """Writes each block's latents and text tensors as cache data files of ``run`` and returns
    its image rows' probe columns; on the driver, ``rows`` then holds all of them. ``timer``:
    the counting actor told each write's time (``progress.timed``), or None."""

    def __init__(self, fs, root: str, run: str, timer=None):
        self.fs, self.root, self.run, self.timer = fs, root, run, timer
        self.rows: list[dict] = []

    def _write(self, table: pa.Table, kind: str, columns: list[str]) -> None:
        if table.num_rows:
            rel = cache.part_file(self.run, kind, uuid.uuid4().hex[:16])
            cache.write_part(self.fs, f"{self.root}/{rel}", table.select(columns))

    def write(self, blocks: Iterable, ctx) -> pa.Table:
        start, probed = clock(), []
        for block in blocks:
            table = BlockAccessor.for_block(block).to_arrow()
            status = table.column("status")
            tensors = cache.tensor_columns(table.schema)
            image = [t for t in tensors if t.startswith("latent")]
            # masks in files of their own (they have no latent): rows of the same folder
            masks = [*ROW_COLUMNS, *_cell_columns([cache.MASK])]
            self._write(table.filter(pc.equal(status, MASK)), cache.LATENTS, masks)
            latents = [*ROW_COLUMNS, "alpha", *_cell_columns(image)]
            self._write(table.filter(pc.equal(status, LATENT)), cache.LATENTS, latents)
            text = table.filter(pc.equal(status, TEXT))
            names = ["caption_key", "caption", "truncated"]
            names += _cell_columns([t for t in tensors if t not in image and t != cache.MASK])
            self._write(text, cache.TEXT, names)
            appended = pc.is_in(status, pa.array([TEXT, LATENT, MASK]))
            rest = table.filter(pc.invert(appended))  # none from the pairs' text pass
            if rest.num_rows:
                probed.append(rest.select(PROBE_COLUMNS))
        timed(self.timer, "write", start)
        return pa.concat_tables(probed) if probed else STREAM_SCHEMA.empty_table()

    def on_write_complete(self, write_result) -> None:
        self.rows = [r for t in write_result.write_returns for r in t.to_pylist()]

    def get_name(self) -> str:
        return "RaytunerCacheParts"
