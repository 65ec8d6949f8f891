"""The committed index of a cache version: what it holds and the commit that writes it.

The index (``index.parquet``) lists the trained rows in a fixed order, (source, path), with
everything a training worker needs to read a row without opening the data files' footers: the
bucket, the conditioning, the file, byte offset and checksum of its latent (and of its flipped
latent and its loss mask, when its source has them), whether it is a regularization image, and
the row of its caption in ``captions.parquet``, which holds the same for each distinct
caption's text tensors. The dataset id, a hash of that list (``datasets.dataset_id``), is what
a checkpoint records: resuming on other rows is refused.

A version holds one index per job's sources (``data/datasets.py``): a commit writes its own
job's and keeps every other job's, with the data files they read.
"""

from __future__ import annotations

import logging
import time

import pyarrow as pa

from raytuner import storage
from raytuner.data import cells, datasets, references, trust
from raytuner.data.cache import (
    CAPTIONS,
    DATASETS,
    FORMAT_VERSION,
    INDEX,
    LATENTS,
    TEXT,
    StaleCommit,
    Version,
    checksum_column,
)
from raytuner.data.keys import caption_key, flip_key

log = logging.getLogger(__name__)
SLICE = 16384  # index rows made Python objects at a time when a preprocess reads an index
SHAPE = pa.list_(pa.int32())
# the index: the listing and caption of each trained image, then where its latent lies
INDEX_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("source_index", pa.int32()),  # its place among the job's sources
        ("path", pa.string()),
        ("key", pa.string()),
        ("caption", pa.string()),
        ("caption_key", pa.string()),
        ("caption_from", pa.string()),
        ("repeats", pa.int64()),
        ("size", pa.int64()),
        ("mtime_ns", pa.int64()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("original_size", SHAPE),
        ("crop_top_left", SHAPE),
        ("latent_file", pa.string()),
        ("latent_at", pa.int64()),
        ("latent_shape", SHAPE),
        ("latent_xxh3", pa.uint64()),  # the cell's checksum (``cache.checksum``)
        ("latent_std_at", pa.int64()),  # -1: no std stored
        ("latent_std_xxh3", pa.uint64()),  # 0 when no std is stored
        ("caption_row", pa.int32()),  # its row in captions.parquet
        ("alpha", pa.bool_()),  # the image has transparency (an alpha mask can be made)
        ("regularization", pa.bool_()),  # of a regularization source: train.prior_loss_weight
        # its mirror image's latent (data.flip); "" / -1 / 0: none
        ("flip_file", pa.string()),
        ("flip_at", pa.int64()),
        ("flip_xxh3", pa.uint64()),
        ("flip_std_at", pa.int64()),
        ("flip_std_xxh3", pa.uint64()),
        ("flip_crop_top_left", SHAPE),  # the crop's corner in the mirror image
        # its loss mask (data.mask), [1, h, w] at the latent's h x w; "" / -1 / 0: none
        ("mask_key", pa.string()),
        ("mask_file", pa.string()),
        ("mask_at", pa.int64()),
        ("mask_xxh3", pa.uint64()),
        *references.FIELDS,  # an edit pair's references (data/references.py); [] for none
    ]
)
LISTED = (
    "source",
    "source_index",
    "path",
    "key",
    "caption",
    "caption_key",
    "caption_from",
    "repeats",
    "size",
)
LOCATION = (
    "width",
    "height",
    "original_size",
    "crop_top_left",
    "latent_shape",
    "latent_at",
    "latent_xxh3",
)


def captions_schema(tensors: list[str]) -> pa.Schema:
    fields = [
        ("caption_key", pa.string()),
        ("caption", pa.string()),
        ("truncated", pa.bool_()),
        ("text_file", pa.string()),
    ]
    for name in tensors:
        fields += [(f"{name}_at", pa.int64()), (f"{name}_shape", SHAPE)]
        fields += [(checksum_column(name), pa.uint64())]
    return pa.schema(fields)


def _by_file(rows: list[dict], file_column: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r[file_column], []).append({**r, "file": r[file_column]})
    return out


def _latents_by_file(rows: list[dict]) -> dict[str, list[dict]]:
    """The located rows of the latents files an index names (``_by_file``): each trained
    image's latent row, and the rows of its flipped latent and its mask (in ``Located``'s
    form, as ``Version.describe`` reads them from a file)."""
    out = _by_file(rows, "latent_file")
    for r in rows:
        shared = {"path": r["path"], "width": r["width"], "height": r["height"]}
        if r.get("flip_file"):
            out.setdefault(r["flip_file"], []).append(
                shared
                | {
                    "key": flip_key(r["key"]),
                    "original_size": r["original_size"],
                    "crop_top_left": r["flip_crop_top_left"],
                    "alpha": False,
                    "latent_shape": r["latent_shape"],
                    "latent_at": r["flip_at"],
                    "latent_xxh3": r["flip_xxh3"],
                    "latent_std_at": r["flip_std_at"],
                    "latent_std_xxh3": r["flip_std_xxh3"],
                    "file": r["flip_file"],
                }
            )
        for ref in references.latent_rows(r):
            out.setdefault(ref["file"], []).append(shared | ref)
        if r.get("mask_file"):
            out.setdefault(r["mask_file"], []).append(
                shared
                | {
                    "key": r["mask_key"],
                    "mask_shape": [1, *r["latent_shape"][1:]],
                    "mask_at": r["mask_at"],
                    "mask_xxh3": r["mask_xxh3"],
                    "file": r["mask_file"],
                }
            )
    return out


class Located:
    """Every complete part file of a version and where each cell in it lies: from the committed
    indexes for the files its manifest lists, from one read of the file otherwise. A key held
    by several files (two runs at once) keeps the first one found.

    ``roots``: the job's source folders. Once every one of them is in a committed dataset,
    only the indexes of the datasets that read one of them are read (``datasets.sharing``;
    None: every one): the files of the other jobs' datasets alone are kept as committed, never
    opened. Each index is read in slices, so that the memory it takes is what the rows it adds
    hold, not a second copy of a dataset already read."""

    def __init__(
        self, version: Version, dtype: str, manifest: dict | None, roots=None, text_dtype=None
    ):
        self.version, self.dtype, self.manifest = version, dtype, manifest
        self.text_dtype = text_dtype  # the text tensors' storage (None: ``dtype``)
        self.entries: dict[str, dict] = {}  # rel -> manifest entry
        self.latents: dict[str, dict] = {}  # image key -> its located latent row
        self.captions: dict[str, dict] = {}  # caption key -> its located text row
        self.text_tensors: list[str] = list((manifest or {}).get("text_tensors", []))
        # kind -> rel -> row key -> located row (the committed indexes)
        self._known: dict[str, dict[str, dict]] = {LATENTS: {}, TEXT: {}}
        self._old_entries: dict[str, dict] = {}
        self._foreign: set[str] = set()  # committed files of other jobs' datasets alone
        self.trusted = trust.Trusted()  # what the listing trusts unread (``data/trust.py``)
        if manifest is None:
            return
        self._old_entries = {e["path"]: e for e in manifest["latents"] + manifest["text"]}
        tables, foreign = datasets.sharing(manifest, roots)
        self._foreign = foreign & set(self._old_entries)
        held = {d["index"]["path"]: d for d in manifest.get(DATASETS, {}).values()}
        for index_entry, captions_entry in tables:
            dataset = held.get(index_entry["path"], {})
            try:
                self._read(index_entry["path"], captions_entry["path"], dataset.get("sources"))
            except (OSError, KeyError, pa.ArrowInvalid) as e:  # lost: its files are read again
                log.warning("cache index unreadable (%s): reading its part files again", e)
            self.trusted.take_rejected(version, dataset.get("rejected"))

    def _read(self, index_rel: str, captions_rel: str, record: list[dict] | None) -> None:
        captions = self.version.read(captions_rel).to_pylist()
        self._take(TEXT, _by_file(captions, "text_file"), "caption_key")
        batches = self.version.read(index_rel).to_batches(max_chunksize=SLICE)
        for rows in self.trusted.index((b.to_pylist() for b in batches), record):
            self._take(LATENTS, _latents_by_file(rows), "key")

    def _take(self, kind: str, by_file: dict[str, list[dict]], key: str) -> None:
        """Rows of committed files, each (file, key) once over every index read."""
        for rel, rows in by_file.items():
            if rel in self._old_entries:
                known = self._known[kind].setdefault(rel, {})
                for row in rows:
                    known.setdefault(row[key], row)

    def refresh(self) -> None:
        """Take in part files written since the last call (by this run or another)."""
        for kind, found in ((LATENTS, self.latents), (TEXT, self.captions)):
            known = self._known[kind]
            for rel in self.version.part_files(kind, trusted=set(known) | self._foreign):
                if rel in self.entries:
                    continue
                if rel in known:
                    self.entries[rel], rows = self._old_entries[rel], list(known[rel].values())
                elif rel in self._foreign:  # committed, and only another job's: kept as it is
                    self.entries[rel], rows = self._old_entries[rel], []
                else:
                    try:
                        dtypes = (self.dtype, self.text_dtype)
                        self.entries[rel], table = cells.describe(self.version, rel, *dtypes)
                    except ValueError as e:  # its rows are encoded again, into a new file
                        log.warning("ignoring a damaged part file: %s", e)
                        continue
                    rows = table.to_pylist()
                    if kind == TEXT and not self.text_tensors:
                        self.text_tensors = sorted(
                            c[: -len("_at")] for c in table.column_names if c.endswith("_at")
                        )
                for row in rows:
                    found.setdefault(row["key" if kind == LATENTS else "caption_key"], row)


def _flip_columns(latent: dict, flip: dict | None) -> dict:
    """The index's flip columns of an image with ``latent`` and, when flipped, ``flip``."""
    if flip is None:
        none = {"flip_file": "", "flip_at": -1, "flip_xxh3": 0, "flip_std_at": -1}
        return none | {"flip_std_xxh3": 0, "flip_crop_top_left": latent["crop_top_left"]}
    return {
        "flip_file": flip["file"],
        "flip_at": flip["latent_at"],
        "flip_xxh3": flip["latent_xxh3"],
        "flip_std_at": flip.get("latent_std_at", -1),
        "flip_std_xxh3": flip.get("latent_std_xxh3", 0),
        "flip_crop_top_left": flip["crop_top_left"],
    }


def _index_row(row: dict, cells: dict[str, dict], caption_row: int) -> dict:
    """The index row of ``row`` (a listed image): from ``cells`` (located rows by key) its
    latent's, its flipped latent's and its mask's (where it has them), and its caption's row in
    the captions table."""
    latent = cells[row["key"]]
    flip = cells[row["flip_key"]] if row.get("flip_key") else None
    mask = cells[row["mask_key"]] if row.get("mask_key") else None
    return (
        {k: row[k] for k in LISTED}
        | {k: latent[k] for k in LOCATION}
        | _flip_columns(latent, flip)
        | {
            "mtime_ns": row["mtime_ns"],
            "latent_file": latent["file"],
            "latent_std_at": latent.get("latent_std_at", -1),
            "latent_std_xxh3": latent.get("latent_std_xxh3", 0),
            "caption_row": caption_row,
            "alpha": bool(latent.get("alpha", False)),
            "regularization": bool(row.get("regularization", False)),
            "mask_key": mask["key"] if mask else "",
            "mask_file": mask["file"] if mask else "",
            "mask_at": mask["mask_at"] if mask else -1,
            "mask_xxh3": mask["mask_xxh3"] if mask else 0,
        }
        | references.index_columns(row, cells)
    )


def _caption_row(caption: dict, tensors: list[str]) -> dict:
    out = {k: caption[k] for k in ("caption_key", "caption", "truncated")}
    out["text_file"] = caption["file"]
    for name in tensors:
        for column in (f"{name}_at", f"{name}_shape", checksum_column(name)):
            out[column] = caption[column]
    return out


def bucket_name(width: int, height: int, latent_shape) -> str:
    """The bucket of a trained row: its size "WxH", and for a clip sample of a video family
    (a latent [C, T, h, w] with T > 1) its latent frames: "WxH/T" (Wan's 81 frames: "/21").
    An image of a video family (T = 1) shares the images' "WxH" bucket. Rows of one bucket
    stack into one batch: the same latent shape."""
    frames = latent_shape[1] if len(latent_shape) == 4 else 1
    return f"{width}x{height}" + (f"/{frames}" if frames > 1 else "")


def appearances(rows: list[dict]) -> dict[str, int]:
    """Samples per bucket in one epoch of the schedule: every row times its repeats (its
    source's, or its kohya folder's with ``repeats_from_folder``)."""
    counts: dict[str, int] = {}
    for row in rows:
        bucket = bucket_name(row["width"], row["height"], row["latent_shape"])
        counts[bucket] = counts.get(bucket, 0) + row["repeats"]
    return dict(sorted(counts.items()))


def commit(
    version: Version,
    run: str,
    rows: list[dict],
    located: Located,
    generation=None,
    *,
    sources: list,
    rejected: list[dict] = (),
    **extra,
) -> dict:
    """Write the index of ``rows`` (the trained images, each with ``source_index``, and the
    keys of its flipped latent and its mask, ``flip_key`` and ``mask_key``, where it has them)
    and the captions they use (plus the empty one, for caption dropout), then the manifest:
    last. The index is the dataset of ``sources`` (the job's ``SourceConfig`` list): the
    manifest replaces that dataset and keeps every other job's (``data/datasets.py``).
    ``rejected``: its rejected files (``trust.write_rejected``'s rows), in a table beside its
    index where it has any; ``extra``: more manifest keys (family, dtype, report)."""
    rows = sorted(rows, key=lambda r: (r["source_index"], r["path"]))
    needed = sorted({r["caption_key"] for r in rows} | {caption_key("")})
    position = {k: i for i, k in enumerate(needed)}
    tensors, cells = located.text_tensors, located.latents
    index = [_index_row(r, cells, position[r["caption_key"]]) for r in rows]
    captions = [_caption_row(located.captions[k], tensors) for k in needed]
    key = datasets.dataset_key(sources)
    mine = {
        "sources": datasets.sources_record(sources),
        "index": version.write_table(
            f"{run}/{INDEX}", pa.Table.from_pylist(index, schema=INDEX_SCHEMA)
        ),
        "captions": version.write_table(
            f"{run}/{CAPTIONS}", pa.Table.from_pylist(captions, schema=captions_schema(tensors))
        ),
        "appearances": appearances(index),
        "dataset": {"id": datasets.dataset_id(version.fp, index), "rows": len(rows)},
        "files": _live_files(index, captions),
        "committed_unix": round(time.time(), 3),
    }
    mine |= trust.write_rejected(version, run, list(rejected))  # before the manifest
    held = (located.manifest or {}).get(DATASETS, {})
    kept, dropped = datasets.merged(held, key, mine, lambda rel: _exists(located, rel))
    for what in dropped:
        log.warning(
            "cache: a file of the dataset of %s is gone: dropped (preprocess it again)", what
        )
    files = {
        kind: sorted({f for d in kept.values() for f in d["files"][kind]}) for kind in mine["files"]
    }
    manifest = (
        {
            "format_version": FORMAT_VERSION,
            "fingerprint": version.fp,
            "latents": [located.entries[rel] for rel in files[LATENTS]],
            "text": [located.entries[rel] for rel in files[TEXT]],
            "text_tensors": tensors,
            DATASETS: kept,
            # the newest commit's dataset (report.json's): what a reader naming no job reads
            "dataset_key": key,
        }
        | {k: mine[k] for k in ("index", "captions", "appearances", "dataset")}
        | extra
    )
    committed = version.commit(manifest, generation)
    now = (version.manifest() or {}).get(DATASETS, {}).get(key, {})
    if now.get("index") != mine["index"]:  # a commit at the same moment replaced this one
        raise StaleCommit(f"{version.root}: another run's commit replaced this one's")
    return committed


def _live_files(index: list[dict], captions: list[dict]) -> dict[str, list[str]]:
    """The data files a dataset's index and captions rows read: its latents files (of its
    images, their flips, masks and the pairs' references) and its text files."""
    latents = {r["latent_file"] for r in index} | {r["flip_file"] for r in index}
    latents |= references.files(index)  # the latents files of the pairs' references
    latents = sorted((latents | {r["mask_file"] for r in index}) - {""})
    return {"latents": latents, "text": sorted({c["text_file"] for c in captions})}


def _exists(located: Located, rel: str) -> bool:
    """Whether a file another dataset references is still there: a data file as the last
    listing found it (a damaged one set aside is not), an index table on the filesystem."""
    if rel.endswith((f"/{INDEX}", f"/{CAPTIONS}")):
        return storage.exists(located.version.fs, located.version.path(rel))
    return rel in located.entries
