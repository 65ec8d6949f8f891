"""The preprocess pass as one Ray Data stream: every listed file flows through

    listing -> probe + decode (tasks) -> Encoder actor pool (VAE + text) -> PartSink

so the encoder actors start once, while the first files are still being probed, and a batch's
new captions are encoded beside its images. Each row keeps its probe fields (key, caption,
reason) to the end; the sink writes the latents and text tensors as the cache's data files and
hands the driver every other column, from which the run's plan and report are made.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc
import ray
from ray.data import Datasink
from ray.data.block import BlockAccessor

from raytuner.data import cache
from raytuner.data.decode import DecodeSpec, decode_row
from raytuner.data.encode import ENCODE, FAILED, PROBED, SHAPE, TEXT, Encoder
from raytuner.data.sources import caption_key, probe_and_read

# One row of the stream as the probe + decode tasks emit it.
STREAM_SCHEMA = pa.schema(
    [
        ("source", pa.int32()),
        ("path", pa.string()),
        ("size", pa.int64()),
        ("mtime_ns", pa.int64()),
        ("key", pa.string()),
        ("caption", pa.string()),
        ("caption_key", pa.string()),
        ("caption_from", pa.string()),
        ("reason", pa.string()),  # why the probe skipped the file ("" if it did not)
        ("status", pa.string()),  # ENCODE, FAILED or PROBED
        ("failure", pa.string()),  # why the decode refused it (FAILED rows)
        ("pixels", pa.binary()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("original_size", SHAPE),
        ("crop_top_left", SHAPE),
    ]
)
# What the driver gets back of each listed file.
PROBE_COLUMNS = STREAM_SCHEMA.names[: STREAM_SCHEMA.names.index("pixels")]
LATENT_COLUMNS = ["key", "path", "width", "height", "original_size", "crop_top_left"]
DECODED = ("width", "height", "original_size", "crop_top_left")


def _row(row: dict, sources, spec: DecodeSpec, known: frozenset, taken: set) -> dict:
    """Probe one listed file and, when its content is new, decode it from the same read."""
    trusted = bool(row["known_key"]) and row["known_key"] in known
    probed, data = probe_and_read(row, sources, keep=not trusted)
    out = probed | {"caption_key": caption_key(probed["caption"]), "failure": "", "pixels": b""}
    out |= {"status": PROBED, "width": 0, "height": 0, "original_size": [], "crop_top_left": []}
    if probed["reason"] or probed["key"] in known or probed["key"] in taken:
        return out
    decoded = decode_row(probed, spec, data)
    if decoded["status"] != "ok":
        return out | {"status": FAILED, "failure": decoded["reason"]}
    taken.add(probed["key"])
    return out | {"status": ENCODE, "pixels": decoded["pixels"]} | {k: decoded[k] for k in DECODED}


def probe_decode(batch: pa.Table, sources, spec: DecodeSpec, known: frozenset) -> pa.Table:
    """The stream's first step (Ray Data tasks): a batch of listed files -> stream rows."""
    taken: set[str] = set()  # a file whose content another row of this batch already decodes
    rows = [_row(r, sources, spec, known, taken) for r in batch.to_pylist()]
    return pa.Table.from_pylist(rows, schema=STREAM_SCHEMA)


class PartSink(Datasink):
    """Writes each block's latents and text tensors as cache data files of ``run`` and returns
    its image rows' probe columns; on the driver, ``rows`` then holds all of them."""

    def __init__(self, fs, root: str, run: str):
        self.fs, self.root, self.run = fs, root, run
        self.rows: list[dict] = []

    def _write(self, table: pa.Table, kind: str, columns: list[str]) -> None:
        if table.num_rows:
            rel = cache.part_file(self.run, kind, uuid.uuid4().hex[:16])
            cache.write_part(self.fs, f"{self.root}/{rel}", table.select(columns))

    def write(self, blocks: Iterable, ctx) -> pa.Table:
        probed = []
        for block in blocks:
            table = BlockAccessor.for_block(block).to_arrow()
            status = table.column("status")
            latents = [*LATENT_COLUMNS, "latent", "latent_shape"]
            latents += ["latent_std"] if "latent_std" in table.column_names else []
            self._write(table.filter(pc.equal(status, ENCODE)), cache.LATENTS, latents)
            text = table.filter(pc.equal(status, TEXT))
            tensors = [n for n in cache.tensor_columns(text.schema) if not n.startswith("latent")]
            names = ["caption_key", "caption", "truncated"]
            names += [c for t in tensors for c in (t, cache.shape_column(t))]
            self._write(text, cache.TEXT, names)
            probed.append(table.filter(pc.not_equal(status, TEXT)).select(PROBE_COLUMNS))
        return pa.concat_tables(probed) if probed else STREAM_SCHEMA.empty_table()

    def on_write_complete(self, write_result) -> None:
        self.rows = [r for t in write_result.write_returns for r in t.to_pylist()]

    def get_name(self) -> str:
        return "RaytunerCacheParts"


def run(
    listing: list[dict], sources, known, spec: DecodeSpec, model, pre, version, run_rel, progress
):
    """Stream every listed file of ``sources`` through probe, decode and encode into the data
    files of the run folder ``run_rel``; ``known``: (latent keys, caption keys) the version
    holds already; ``progress``: the counting actor of the encoded images.
    Returns one row per listed file: its probe columns, ``status`` and ``failure``."""
    latent_keys, caption_keys = known
    blocks = max(1, math.ceil(len(listing) / pre.batch_size))
    sink = PartSink(version.fs, version.root, run_rel)
    (
        ray.data.from_items(listing, override_num_blocks=blocks)
        # half a CPU: decode tasks run beside the encoder actors, not fused into them
        .map_batches(
            probe_decode,
            fn_kwargs={"sources": sources, "spec": spec, "known": frozenset(latent_keys)},
            batch_size=pre.batch_size,
            batch_format="pyarrow",
            num_cpus=0.5,
        )
        .map_batches(
            Encoder,
            fn_constructor_args=(model, pre.dtype, pre.store_std, set(caption_keys), progress),
            compute=ray.data.ActorPoolStrategy(min_size=pre.min_actors, max_size=pre.max_actors),
            num_gpus=pre.gpus_per_actor or None,
            batch_size=pre.batch_size,
            batch_format="pyarrow",
            # bounded: an encoder that dies each time (out of memory) fails the preprocess
            max_restarts=pre.max_restarts,
            max_task_retries=pre.max_restarts,
        )
        .write_datasink(sink, ray_remote_args={"num_cpus": 0.25})
    )
    return sink.rows
