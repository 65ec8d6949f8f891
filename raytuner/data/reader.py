"""A committed cache version as a training worker reads it.

In memory: the index, a few numbers per row (bucket, source, conditioning, where the latent
lies, and its flipped latent and its mask where it has them, whether it is a regularization
image, the caption's row), a frame rate per source, and the same per caption; for a job that
trains the text encoders (``lora.text_encoder``, ``computed``) each distinct caption's text
instead of where its text tensors lie (its UTF-8 bytes and a 4-byte offset, one Arrow string
array). Nothing else: each batch's tensors are fetched when it is assembled, with one ranged
read per cell (exactly its bytes and its 4-byte length prefix), ranges of one file that lie
close together merged into one request, and the requests issued in parallel. On object storage
a batch costs at most one request per row and per caption.

Every cell read is checked before a tensor is made of it: its length prefix, and its xxh3-64
against the checksum the index holds for it (written with the bytes at encode time). A cell
that changed since raises ``cache.ChecksumError`` naming the file, the row and the column.
"""

from __future__ import annotations

import collections
import warnings
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from raytuner import storage
from raytuner.data import datasets, references
from raytuner.data.cache import (
    Version,
    cell_bytes,
    checksum,
    checksum_column,
    column_dtype,
    damaged,
    text_dtype_of,
)
from raytuner.data.cells import LENGTH_PREFIX, row_at
from raytuner.data.clip_rows import CLIP, is_sample
from raytuner.data.index import bucket_name
from raytuner.data.keys import caption_key
from raytuner.data.ranges import RangeReader
from raytuner.data.tensors import DTYPES, from_cell, stacked

ROW_COLUMNS = [
    "path",
    "source_index",
    "repeats",
    "width",
    "height",
    "original_size",
    "crop_top_left",
    "latent_file",
    "latent_at",
    "latent_shape",
    "latent_xxh3",
    "latent_std_at",
    "latent_std_xxh3",
    "caption_row",
    "regularization",
    "flip_file",
    "flip_at",
    "flip_xxh3",
    "flip_std_at",
    "flip_std_xxh3",
    "flip_crop_top_left",
    "mask_file",
    "mask_at",
    "mask_xxh3",
]
# the cells are copied out at once; torch only notes that the bytes it viewed are read-only
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def _matrix(column: pa.ChunkedArray) -> np.ndarray:
    """A list column whose lists share one length, as a [rows, length] array."""
    flat = pc.list_flatten(column).to_numpy()
    return flat.reshape(len(column), -1) if len(column) else flat.reshape(0, 0)


def _codes(column: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
    """A string column as (int codes, the distinct strings)."""
    encoded = column.combine_chunks().dictionary_encode()
    return encoded.indices.to_numpy(), encoded.dictionary.to_pylist()


class _Where(NamedTuple):
    """Where a kind of cell of every indexed row lies: its file (a code into ``files``), its
    offset (-1: the row has none) and its checksum."""

    code: np.ndarray
    files: list[str]
    at: np.ndarray
    sums: np.ndarray

    def cell(self, i: int, shape, column: str) -> tuple:
        return (self.files[self.code[i]], self.at[i], shape, self.sums[i], column)


def _where(rows: pa.Table, file: str, at: str, sums: str) -> _Where:
    code, files = _codes(rows.column(file))
    return _Where(code, files, rows.column(at).to_numpy(), rows.column(sums).to_numpy())


def rate_table(manifest: dict, sources: np.ndarray) -> np.ndarray:
    """Each source's frame rate (float32, indexed by an index row's ``source_index``): the
    sampling fps of the dataset's sources (``for_readers``' ``source_fps``; a whole manifest:
    its newest commit's dataset's), 0.0 where unknown (a source at each clip's own rate, one
    the record lacks)."""
    rates = manifest.get("source_fps")
    if rates is None:  # a whole manifest: the dataset its index is of
        rates = datasets.source_rates(datasets.newest_sources(manifest))
    out = np.zeros(max(len(rates), int(sources.max(initial=-1)) + 1), dtype=np.float32)
    out[: len(rates)] = rates
    return out


def sample_ids(paths: list[str], keys: pa.ChunkedArray) -> list[str]:
    """Each row's id in the sample log (``train.sample_log``): its path, and for each sample of
    a clip cut into several (``frame_selection = "chunks"``), its path, ``#`` and its place among
    them from its key (``run.mp4#0``, ``run.mp4#1``); an image's and a one-sample clip's: its
    path alone."""
    at = np.flatnonzero(pc.match_substring(keys, f":{CLIP}:").to_numpy(zero_copy_only=False))
    picked = zip(at.tolist(), keys.take(at).to_pylist(), strict=True)
    places = [(i, *k.rsplit(":", 1)) for i, k in picked if is_sample(k)]
    if not places:  # no clip sample: the paths are the ids
        return paths
    count = collections.Counter((paths[i], stem) for i, stem, _ in places)
    ids = list(paths)
    for i, stem, place in places:
        if count[paths[i], stem] > 1:
            ids[i] = f"{paths[i]}#{place}"
    return ids


class CachedDataset:
    """The committed rows of one cache version, in index order; ``batch`` reads rows."""

    def __init__(
        self, version: Version, manifest: dict, rows: pa.Table, captions: pa.Table, computed=()
    ):
        """``computed``: the text tensors the worker makes itself from the captions (trained
        text encoders): not read, the captions' text (``captions``) read instead."""
        self.manifest, self.store = manifest, DTYPES[manifest["dtype"]]
        # the latents' and the text tensors' storage dtypes (float8 text: dequantized to the
        # latents' dtype as it is read)
        self.dtypes = (manifest["dtype"], text_dtype_of(manifest))
        self.reader = RangeReader(version.fs, version.root)
        self.paths: list[str] = rows.column("path").to_pylist()
        self.ids = sample_ids(self.paths, rows.column("key"))  # the sample log's
        self.repeats: list[int] = rows.column("repeats").to_pylist()
        # each row's source, and each source's frame rate: the rows' "fps"
        self._source = rows.column("source_index").to_numpy()
        self._rates = rate_table(manifest, self._source)
        self._width = rows.column("width").to_numpy()
        self._height = rows.column("height").to_numpy()
        self._original = _matrix(rows.column("original_size"))
        self._crop = _matrix(rows.column("crop_top_left"))
        self._file, self._files = _codes(rows.column("latent_file"))
        self._at = rows.column("latent_at").to_numpy()
        self._sum = rows.column("latent_xxh3").to_numpy()
        self._std_at = rows.column("latent_std_at").to_numpy()
        self._std_sum = rows.column("latent_std_xxh3").to_numpy()
        self._has_std = bool(len(self._std_at)) and self._std_at[0] >= 0
        self._shape = _matrix(rows.column("latent_shape"))
        self._caption = rows.column("caption_row").to_numpy()
        self.tensors: list[str] = [t for t in manifest["text_tensors"] if t not in computed]
        self._texts = captions.column("caption").combine_chunks() if computed else None
        self._text_file, self._text_files = _codes(captions.column("text_file"))
        self._text = {
            name: (
                captions.column(f"{name}_at").to_numpy(),
                _matrix(captions[f"{name}_shape"]),
                captions.column(checksum_column(name)).to_numpy(),
            )
            for name in self.tensors
        }
        empty = pc.index(captions.column("caption_key"), caption_key("")).as_py()
        self._empty = empty if empty >= 0 else None
        # regularization images (train.prior_loss_weight), flipped latents (data.flip) and
        # masks (data.mask): their std's cells lie in the flipped latent's file
        self.regularization = rows.column("regularization").to_numpy(zero_copy_only=False)
        self._flip = _where(rows, "flip_file", "flip_at", "flip_xxh3")
        self._flip_std = _where(rows, "flip_file", "flip_std_at", "flip_std_xxh3")
        self._flip_crop = _matrix(rows.column("flip_crop_top_left"))
        self.flippable = self._flip.at >= 0  # the rows with a flipped latent
        self._mask = _where(rows, "mask_file", "mask_at", "mask_xxh3")
        self.masked = bool((self._mask.at >= 0).any())  # batches carry a "mask"
        self.references = references.Referenced(rows)  # an edit pair's (none: most = 0)
        self.bytes_used = 0

    @property
    def buckets(self) -> list[str]:
        """The bucket of every indexed row, as "WxH" (a clip sample's: "WxH/T",
        ``index.bucket_name``): the schedule's batches hold rows of one bucket."""
        sizes = zip(self._width.tolist(), self._height.tolist(), self._shape, strict=True)
        return [bucket_name(w, h, shape) for w, h, shape in sizes]

    def __len__(self) -> int:
        return len(self.paths)

    def _cells(self, wanted: list[tuple]) -> list[torch.Tensor]:
        """Each (file, offset, shape, checksum, column) cell as a tensor, checked against its
        length prefix and its checksum."""
        stored = [column_dtype(cell[4], *self.dtypes) for cell in wanted]
        sizes = [cell_bytes(cell[2], d) for cell, d in zip(wanted, stored, strict=True)]
        ranges = [
            (cell[0], cell[1] - LENGTH_PREFIX, n + LENGTH_PREFIX)
            for cell, n in zip(wanted, sizes, strict=True)
        ]
        read = self.reader.read(ranges)
        # a row twice in one batch (a padded bucket) is read once: counted once
        distinct = {(cell[0], cell[1]): n for cell, n in zip(wanted, sizes, strict=True)}
        self.bytes_used += sum(distinct.values())
        out = []
        for cell, n, data, dtype in zip(wanted, sizes, read, stored, strict=True):
            rel, at, shape, expected, column = cell
            if int.from_bytes(data[:LENGTH_PREFIX], "little") != n:
                raise ValueError(f"{rel}: no {n}-byte cell at offset {at}: the file changed")
            if checksum(data[LENGTH_PREFIX:]) != int(expected):  # xxh3 releases the GIL
                raise self._damaged(rel, int(at), column)
            out.append(from_cell(data, LENGTH_PREFIX, shape, dtype, self.store))
        return out

    def _damaged(self, rel: str, at: int, column: str) -> Exception:
        """The error for the cell of ``column`` at byte ``at`` of ``rel``: its row found from
        the file's footer (read only now, on the way to failing)."""
        path = storage.join(self.reader.root, rel)
        try:
            row = row_at(pq.read_metadata(path, filesystem=self.reader.fs), column, at)
        except (OSError, pa.ArrowInvalid):
            row = None
        images = []  # which image: the index's rows holding this cell
        main = _Where(self._file, self._files, self._at, self._sum)
        std = _Where(self._file, self._files, self._std_at, self._std_sum)
        kinds = {"latent": (main, self._flip), "latent_std": (std, self._flip_std)}
        for where in kinds.get(column, (self._mask,) if column == "mask" else ()):
            if rel in where.files:
                mine = (where.code == where.files.index(rel)) & (where.at == at)
                images += [self.paths[i] for i in np.flatnonzero(mine)[:1]]
        return damaged(path, row, column, f" (image {images[0]})" if images else "")

    def _latent_cell(self, i: int, flip: bool, std: bool) -> tuple:
        """Row ``i``'s latent cell (its std's with ``std``), of its mirror image with ``flip``."""
        if flip:
            where = self._flip_std if std else self._flip
        else:
            at, sums = (self._std_at, self._std_sum) if std else (self._at, self._sum)
            where = _Where(self._file, self._files, at, sums)
        return where.cell(i, self._shape[i], "latent_std" if std else "latent")

    def _masks(self, cells: list, indices: list[int], flips: list[bool], dtype) -> torch.Tensor:
        """The rows' masks [B, 1, h, w]: their cells (mirrored for flipped rows), ones for a
        row without a mask (its every pixel trains)."""
        out = torch.ones((len(indices), 1, *self._shape[indices[0]][1:]), dtype=dtype)
        cells = iter(cells)
        for j, i in enumerate(indices):
            if self._mask.at[i] >= 0:
                mask = next(cells).to(dtype)
                out[j] = torch.flip(mask, dims=[-1]) if flips[j] else mask
        return out

    def batch(
        self, indices: list[int], dtype=torch.float32, empty_caption=None, flipped=None, pin=False
    ):
        """The rows' tensors in ``dtype`` (None: as cached); ``empty_caption[j]``: row j takes
        the empty caption's embedding (caption dropout) instead of its own; ``flipped[j]``: row
        j takes its mirror image's latent, its mask mirrored and the crop's corner as seen in the
        mirror image; ``pin``: the latents and text tensors stacked into pinned memory."""
        drops = empty_caption or [False] * len(indices)
        flips = flipped or [False] * len(indices)
        if any(drops) and self.tensors and self._empty is None:
            raise ValueError("the cache holds no empty-caption embedding for caption dropout")
        rows = list(zip(indices, flips, strict=True))
        if unflippable := [self.paths[i] for i, f in rows if f and not self.flippable[i]]:
            raise ValueError(f"{unflippable[0]} has no flipped latent in the cache")
        own = [int(self._caption[i]) for i in indices]
        captions = [self._empty if d else c for c, d in zip(own, drops, strict=True)]
        distinct = sorted(set(captions))
        latents = [self._latent_cell(i, f, std=False) for i, f in rows]
        latents += [self._latent_cell(i, f, std=True) for i, f in rows if self._has_std]
        masks = [
            self._mask.cell(i, (1, *self._shape[i][1:]), "mask")
            for i in indices
            if self._mask.at[i] >= 0
        ]
        text = [
            (self._text_files[self._text_file[c]], at[c], shapes[c], sums[c], name)
            for name, (at, shapes, sums) in self._text.items()
            for c in distinct
        ]
        refs = self.references.cells(indices, self._shape)
        cells = self._cells(latents + masks + text + refs)
        refs, cells = cells[len(cells) - len(refs) :], cells[: len(cells) - len(refs)]
        n, k = len(indices), len(latents)
        out = {"latent": stacked(cells[:n], dtype, pin)}
        if self._has_std:
            out["latent_std"] = stacked(cells[n : 2 * n], dtype, pin)
        if self.masked:
            out["mask"] = self._masks(
                cells[k : k + len(masks)], indices, flips, dtype or torch.float32
            )
        text_cells, m = cells[k + len(masks) :], len(distinct)
        row_of = {c: j for j, c in enumerate(distinct)}
        for t, name in enumerate(self.tensors):
            mine = text_cells[t * m : (t + 1) * m]
            out[name] = stacked([mine[row_of[c]] for c in captions], dtype, pin)
        out |= self.references.batch(indices, refs, cells[:n], dtype, pin)
        return out | self._conditioning(indices, flips)

    def captions(self, indices: list[int], empty_caption=None) -> list[str]:
        """The rows' captions, ``""`` where ``empty_caption[j]`` (caption dropout): what a
        worker that trains the text encoders encodes (a dataset opened with ``computed``)."""
        if self._texts is None:
            raise ValueError("the dataset was opened without its captions (computed=())")
        drops = empty_caption or [False] * len(indices)
        pairs = zip(indices, drops, strict=True)
        return ["" if d else self._texts[int(self._caption[i])].as_py() for i, d in pairs]

    def _conditioning(self, indices: list[int], flips: list[bool]) -> dict:
        """SDXL's micro-conditioning of the rows, [B, 2] int64 each ((h, w) order), and each
        row's frame rate (its source's sampling fps; 0.0: unknown), [B] float32."""
        crops = np.where(np.asarray(flips)[:, None], self._flip_crop[indices], self._crop[indices])
        sizes = np.stack([self._height[indices], self._width[indices]], axis=1)
        return {
            "original_size": torch.from_numpy(self._original[indices].astype(np.int64)),
            "crop_top_left": torch.from_numpy(crops.astype(np.int64)),
            "target_size": torch.from_numpy(sizes.astype(np.int64)),
            "fps": torch.from_numpy(self._rates[self._source[indices]]),
        }

    def close(self) -> None:
        self.reader.close()


def for_readers(manifest: dict, dataset: dict | None = None) -> dict:
    """The part of a manifest a reader needs to read ``dataset`` (a job's entry of its
    ``datasets``; None: the newest commit's), not the file lists and the report, which grow
    with the dataset: what a job hands its workers; with each of its sources' frame rate."""
    dataset = manifest if dataset is None else dataset
    needed = ("format_version", "fingerprint", "dtype", "text_tensors")
    sources = datasets.newest_sources(manifest) if dataset is manifest else dataset["sources"]
    return (
        {k: manifest[k] for k in needed}
        | {"text_dtype": text_dtype_of(manifest)}
        | {k: dataset[k] for k in ("index", "captions", "dataset")}
        | {"source_fps": datasets.source_rates(sources)}  # each source's rate (``rate_table``)
    )


def open_dataset(
    cache_uri: str, fp: str, manifest: dict | None = None, computed=()
) -> CachedDataset:
    """The committed version ``fp`` of the cache; ``manifest``: the one a job started with
    (a later commit does not change what a running job reads), else the current one;
    ``computed``: the text tensors the worker computes from the captions (not read: the
    captions' text is)."""
    version = Version(cache_uri, fp)
    manifest = manifest or version.manifest()
    if manifest is None:
        raise FileNotFoundError(
            f"no committed cache at {version.root}: run `raytuner preprocess` first"
        )
    path = manifest["index"]["path"]
    names = pq.read_schema(version.path(path), filesystem=version.fs).names
    rows = version.read(path, [*ROW_COLUMNS, "key", *(c for c in references.READ if c in names)])
    if rows.num_rows == 0:
        raise ValueError(
            f"the cache at {version.root} holds no usable image: every input was "
            f"skipped (see {version.path('report.json')})"
        )
    text = ["caption_key", "text_file"] + ["caption"] * bool(computed)
    for n in manifest["text_tensors"]:
        if n not in computed:
            text += [f"{n}_at", f"{n}_shape", checksum_column(n)]
    captions = version.read(manifest["captions"]["path"], text)
    return CachedDataset(version, manifest, rows, captions, computed)
