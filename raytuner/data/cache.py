"""The encoded dataset: its format on disk, versioned by fingerprint, committed by a manifest
written last. This module owns the format; nothing else builds these paths. Where a tensor
lies in a file is found by ``data/cells.py`` alone.

Layout under ``data.cache``::

    <fingerprint>/manifest.json     what readers trust: every live file with rows and sha256
    <fingerprint>/report.json       the report of the run that committed it
    <fingerprint>/leases/*.json     heartbeats of the jobs using the version (``lease.py``)
    <fingerprint>/parts/<run>/latents/status=ok/*.parquet  rows keyed by image-content hash:
                                                the latents (an image's, key ``<hash>``; its
                                                mirror image's, ``<hash>:flip``), and in files
                                                of their own its loss masks at latent
                                                resolution (``<hash>:mask:<source>``)
    <fingerprint>/parts/<run>/text/*.parquet               one row per distinct caption
    <fingerprint>/parts/<run>/index.parquet     one row per trained image: path, caption, repeats,
                                                bucket, conditioning and where its latent lies
    <fingerprint>/parts/<run>/captions.parquet  one row per caption: where its text tensors lie

The manifest keeps one index (and captions table) per job's sources under ``datasets``
(``data/datasets.py``): jobs that share a version share its data files, and each trains the
rows of its own sources. Its top-level ``index``, ``captions``, ``dataset`` and ``report`` are
the newest commit's.

Random access: every data file holds one row per row group and is written plain (no
dictionary, compression or statistics). A tensor cell is then the tail of its column chunk,
right after its 4-byte length, so the Parquet footer gives each cell's byte offset. The commit
records those offsets in the index, and a training worker reads exactly the bytes of the rows
it trains (one ranged read per cell, neighbours coalesced), locally or on object storage.

Checksums: every tensor cell ``<tensor>`` has a ``<tensor>_xxh3`` column beside it in its data
file, the xxh3-64 of the cell's bytes, computed where the bytes are made (``to_cells`` in
``data/tensors.py``, at encode time). The commit checks each cell it locates against it and
copies it into the index next to the cell's offset; the training reader checks it on every
read (``data/reader.py``), and ``raytuner cache verify`` on every cell of every file.

Part files are immutable and keyed by content, so a commit is idempotent: two runs at once
each commit a complete manifest, and a run that died leaves complete files the next run reuses.
"""

from __future__ import annotations

import hashlib
import json
import math

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import xxhash

from raytuner import storage
from raytuner.config import ModelConfig, PreprocessConfig

# 5: flipped latents, loss masks, an image's alpha flag, the index's regularization rows;
# 4: per-cell xxh3-64 checksums (``<tensor>_xxh3``); 3: one row per row group
FORMAT_VERSION = 5
MANIFEST, REPORT = "manifest.json", "report.json"
DATASETS = "datasets"  # the manifest's datasets: one per job's sources (``data/datasets.py``)
INDEX, CAPTIONS = "index.parquet", "captions.parquet"
LATENTS, TEXT = "latents", "text"
# How every data file is written (``write_part``: the preprocess's Ray Data sink, the
# synthetic bench cache). Tensor bytes do not compress, each cell is unique, and min/max
# statistics of a binary column would store two whole tensors per page: plain pages keep every
# latent within a few bytes of its tensor size. One row per row group puts each cell at the
# tail of its chunk.
PARQUET = {
    "use_dictionary": False,
    "compression": "none",
    "write_statistics": False,
    "row_group_size": 1,
}
CHECKSUM = "_xxh3"  # a tensor column's checksum column: its name plus this
# What repairs a cache whose bytes changed after they were written (named by every error that
# finds such a change).
REPAIR = "raytuner cache verify JOB.toml --repair"
# Bytes per element of each storage dtype (``data/tensors.py`` maps them to torch dtypes; this
# module stays free of torch: the preprocess's write tasks import it). A float8 cell (text
# tensors only: ``preprocess.text_dtype``) is its e4m3 elements, then one float32 scale per
# row of its last axis (``cell_bytes``).
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8": 1}
FLOAT8, SCALE_BYTES = "float8", 4
# Preprocess keys that change the encoded bytes or which images are used; pool sizing does not.
ENCODING_KEYS = (
    "resolution",
    "bucket_step",
    "min_aspect",
    "max_aspect",
    "crop",
    "dtype",
    "seed",
    "aspect_policy",
    "min_size",
    "max_pixels",
    "background",
    "store_std",
)
# the small per-row columns a located latent row carries besides its cell offsets
LATENT_FIELDS = (
    "key",
    "width",
    "height",
    "original_size",
    "crop_top_left",
    "alpha",  # the image has transparency: an alpha mask can be made of it
    "latent_shape",
)
TEXT_FIELDS = ("caption_key", "truncated")
MASK = "mask"  # a mask row's tensor: [1, h, w] loss weights in [0, 1] at the latent's h x w


def fingerprint(model: ModelConfig, pre: PreprocessConfig) -> str:
    encoding = {k: getattr(pre, k) for k in ENCODING_KEYS}
    if pre.text_storage != pre.dtype:  # text stored otherwise: another version (the default
        encoding["text_dtype"] = pre.text_storage  # keeps the fingerprints made before it)
    # what the encoders are (not model.trainable_dtype, which only training reads)
    encoders = {k: getattr(model, k) for k in ("family", "pretrained", "revision", "dtype")}
    if model.dtype == "float8":  # only the denoiser is stored in float8: encoders in bfloat16
        encoders["dtype"] = "bfloat16"
    if model.pretrained.lower().endswith(".safetensors"):
        # a single file is more than its path (it may be replaced in place), and its config
        # repo may hold encoders the file lacks (Flux's VAE and text encoders)
        from raytuner.families import parts

        encoders["single_file"] = parts.single_file_identity(model.pretrained)
        encoders["single_file_config"] = model.single_file_config or parts.default_config(
            model.family
        )
    payload = {"format": FORMAT_VERSION, "model": encoders, "encoding": encoding}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def version_dir(cache_uri: str, fp: str) -> str:
    return storage.join(storage.absolute(cache_uri), fp)


def shape_column(tensor: str) -> str:
    """The column holding a tensor column's shapes (``latent_std`` shares the latent's)."""
    return "latent_shape" if tensor.startswith("latent") else f"{tensor}_shape"


def checksum_column(tensor: str) -> str:
    """The column holding a tensor column's checksums (data files, index and captions)."""
    return f"{tensor}{CHECKSUM}"


def checksum(cell) -> int:
    """A cell's checksum: the xxh3-64 of its bytes (any buffer), as an unsigned int.

    xxh3 hashes at tens of GB/s and releases the GIL while it hashes (the feed reads on
    background threads beside the training step)."""
    return xxhash.xxh3_64_intdigest(cell)


def tensor_columns(schema: pa.Schema) -> list[str]:
    """The tensor (cell) columns of a data file's schema: binary, with a shape column."""
    names = set(schema.names)
    return [
        n
        for n in schema.names
        if shape_column(n) in names
        and n != shape_column(n)
        and pa.types.is_binary(schema.field(n).type)
    ]


class ChecksumError(ValueError):
    """A tensor cell whose bytes are not the ones written: the cache is damaged."""


def damaged(path: str, row: int | None, column: str, detail: str = "") -> ChecksumError:
    """The error for a cell whose checksum differs: the file, the row, the column, and the
    command that repairs the cache."""
    where = f"row {row}" if row is not None else "a row"
    return ChecksumError(
        f"{path}: {where}, column {column}: the cell's checksum differs from the one written "
        f"with it{detail}: the cache is damaged; repair it with `{REPAIR}`"
    )


def itemsize(dtype: str) -> int:
    return ITEMSIZE[dtype]


def cell_bytes(shape, dtype: str) -> int:
    """The bytes of a cell of ``shape`` stored in ``dtype``: its elements, and for float8 a
    float32 scale per row of its last axis (a token's features keep their own range)."""
    n = math.prod(shape) * ITEMSIZE[dtype]
    if dtype == FLOAT8:
        n += math.prod(shape[:-1]) * SCALE_BYTES
    return n


IMAGE_TENSORS = ("latent", "latent_std", MASK)  # stored in preprocess.dtype; the rest is text


def column_dtype(column: str, dtype: str, text_dtype: str | None) -> str:
    """The storage dtype of a tensor column: the latents' and masks' ``dtype``, the text
    tensors' ``text_dtype`` (None: ``dtype``)."""
    return dtype if column in IMAGE_TENSORS else text_dtype or dtype


def text_dtype_of(manifest: dict) -> str:
    """The storage dtype of a committed version's text tensors (a manifest written before
    ``preprocess.text_dtype`` stored them in its ``dtype``)."""
    return manifest.get("text_dtype") or manifest["dtype"]


def part_file(run: str, kind: str, name: str) -> str:
    """Where a data file of ``kind`` (``latents`` or ``text``) written by ``run`` lies, relative
    to its version folder."""
    folder = f"{LATENTS}/status=ok" if kind == LATENTS else TEXT
    return f"{run}/{folder}/{name}.parquet"


def write_part(fs: pafs.FileSystem, path: str, table: pa.Table) -> None:
    """A data file in the cache's layout, atomically and durably (the preprocess's sink and the
    synthetic bench cache)."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **PARQUET)
    storage.write_atomic(fs, path, sink.getvalue().to_pybytes())


def indexes(manifest: dict) -> list[tuple[dict, dict]]:
    """The (index, captions) entries of every dataset a manifest holds, each once: every job's
    (``datasets``), and the top-level one of a manifest written before datasets were kept
    apart."""
    pairs = [(d["index"], d["captions"]) for d in manifest.get(DATASETS, {}).values()]
    if "index" in manifest:
        pairs.append((manifest["index"], manifest["captions"]))
    return list({index["path"]: (index, captions) for index, captions in pairs}.values())


def rejected_tables(manifest: dict) -> list[dict]:
    """The entry of every dataset's table of rejected files (``data/trust.py``), each once."""
    found = [d["rejected"] for d in manifest.get(DATASETS, {}).values() if d.get("rejected")]
    return list({entry["path"]: entry for entry in found}.values())


def committed_files(manifest: dict) -> list[dict]:
    """The entry of every file a manifest references: data files, then every dataset's index
    and captions tables."""
    tables = [entry for pair in indexes(manifest) for entry in pair]
    return manifest["latents"] + manifest["text"] + tables


class StaleCommit(RuntimeError):
    """Another run committed the version after this run read it."""


class Version:
    """One dataset version (one fingerprint) on any pyarrow filesystem."""

    def __init__(self, cache_uri: str, fp: str):
        self.fp = fp
        self.fs, self.root = storage.resolve(version_dir(cache_uri, fp))

    def path(self, rel: str) -> str:
        return storage.join(self.root, rel)

    def manifest(self) -> dict | None:
        path = self.path(MANIFEST)
        return storage.read_json(self.fs, path) if storage.exists(self.fs, path) else None

    def part_files(self, kind: str, trusted: set[str] = frozenset()) -> list[str]:
        """Every complete Parquet file of ``kind`` (``latents`` or ``text``) under parts/.

        Files of runs that died or are still running are included once their footer is
        written (Parquet writes it last), so no half-written file is ever returned; files in
        ``trusted`` (a committed manifest lists them) are not opened to check.
        """
        selector = pafs.FileSelector(self.path("parts"), recursive=True, allow_not_found=True)
        found = []
        for info in self.fs.get_file_info(selector):
            rel = info.path[len(self.root) + 1 :]
            parts = rel.split("/")
            wanted = (
                parts[2:4] == [LATENTS, "status=ok"] if kind == LATENTS else parts[2:3] == [TEXT]
            )
            if not (info.path.endswith(".parquet") and len(parts) > 3 and wanted):
                continue
            if rel not in trusted:
                try:
                    pq.read_metadata(info.path, filesystem=self.fs)
                except (OSError, pa.ArrowInvalid):
                    continue  # still being written, or cut short by a kill
            found.append(rel)
        return sorted(found)

    def read(self, rel: str, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(self.path(rel), columns=columns, filesystem=self.fs)

    def write_table(self, rel: str, table: pa.Table) -> dict:
        """An index table, written atomically; its manifest entry."""
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        data = sink.getvalue().to_pybytes()
        storage.write_atomic(self.fs, self.path(rel), data)
        sha = hashlib.sha256(data).hexdigest()
        return {"path": rel, "rows": table.num_rows, "bytes": len(data), "sha256": sha}

    def lease(self, holder: str):
        """A context in which ``cache gc`` leaves this version alone (``data/lease.py``)."""
        from raytuner.data.lease import Lease

        return Lease(self.fs, self.root, holder)

    def leases(self) -> list[dict]:
        from raytuner.data.lease import live

        return live(self.fs, self.root)

    def generation(self) -> int:
        """How many commits the version has had (0: none)."""
        return (self.manifest() or {}).get("generation", 0)

    def commit(self, manifest: dict, expected: int | None = None) -> dict:
        """The report beside the manifest, then the manifest itself: last and atomic. Every
        file the manifest names must still exist (a gc may have run since they were listed).
        ``expected``: the generation the run started from; another commit since then raises
        StaleCommit (the run lists again, reusing every encoded file, and commits on top)."""
        current = self.generation()
        if expected is not None and current != expected:
            raise StaleCommit(f"{self.root}: committed by another run since this one started")
        manifest = manifest | {"generation": current + 1}
        listed = committed_files(manifest)
        gone = [e["path"] for e in listed if not storage.exists(self.fs, self.path(e["path"]))]
        if gone:
            raise RuntimeError(
                f"{self.root}: {len(gone)} cache files this commit needs are gone (e.g. "
                f"{gone[0]}): deleted while the preprocess ran; run it again"
            )
        storage.write_json_atomic(self.fs, self.path(REPORT), manifest["report"])
        storage.write_json_atomic(self.fs, self.path(MANIFEST), manifest)
        return manifest


def read_manifest(cache_uri: str, fp: str) -> dict | None:
    return Version(cache_uri, fp).manifest()
