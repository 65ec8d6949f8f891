"""The committed index of a cache version and the dataset's identity.

The index (``index.parquet``) lists the trained rows in a fixed order, (source, path), with
everything a training worker needs to read a row without opening the data files' footers: the
bucket, the conditioning, the file, byte offset and checksum of its latent (and of its flipped
latent and its loss mask, when its source has them), whether it is a regularization image, and
the row of its caption in ``captions.parquet``, which holds the same for each distinct
caption's text tensors. The dataset id, a hash of that list, is what a checkpoint records:
resuming on other rows is refused.
"""

from __future__ import annotations

import hashlib
import logging

import pyarrow as pa

from raytuner.data.cache import (
    CAPTIONS,
    FORMAT_VERSION,
    INDEX,
    LATENTS,
    TEXT,
    Version,
    caption_key,
    checksum_column,
    flip_key,
)

log = logging.getLogger(__name__)
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
    """Every complete part file of a version and where each cell in it lies: from the last
    committed index for the files its manifest lists, from one read of the file otherwise.
    A key held by several files (two runs at once) keeps the first one found."""

    def __init__(self, version: Version, dtype: str, manifest: dict | None):
        self.version, self.dtype = version, dtype
        self.entries: dict[str, dict] = {}  # rel -> manifest entry
        self.latents: dict[str, dict] = {}  # image key -> its located latent row
        self.captions: dict[str, dict] = {}  # caption key -> its located text row
        self.text_tensors: list[str] = list((manifest or {}).get("text_tensors", []))
        self._known = {LATENTS: {}, TEXT: {}}  # kind -> rel -> located rows (last commit)
        self._old_entries: dict[str, dict] = {}
        self.indexed: list[dict] = []  # the rows of the last committed index
        if manifest is not None:
            try:
                rows = version.read(manifest["index"]["path"]).to_pylist()
                captions = version.read(manifest["captions"]["path"]).to_pylist()
            except (OSError, KeyError, pa.ArrowInvalid) as e:  # lost: every file is read again
                log.warning("cache index unreadable (%s): reading every part file", e)
                return
            self.indexed = rows
            self._known = {
                LATENTS: _latents_by_file(rows),
                TEXT: _by_file(captions, "text_file"),
            }
            self._old_entries = {e["path"]: e for e in manifest["latents"] + manifest["text"]}

    def refresh(self) -> None:
        """Take in part files written since the last call (by this run or another)."""
        for kind, found in ((LATENTS, self.latents), (TEXT, self.captions)):
            known = self._known[kind]
            for rel in self.version.part_files(kind, trusted=set(known)):
                if rel in self.entries:
                    continue
                if rel in known:
                    self.entries[rel], rows = self._old_entries[rel], known[rel]
                else:
                    try:
                        self.entries[rel], table = self.version.describe(rel, self.dtype)
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


def dataset_id(fingerprint: str, rows: list[dict]) -> str:
    """The identity of the trained rows (index rows) in their order: what each row is (image
    and caption content), how often it appears, whether it is a regularization image, flipped
    and masked (by what). Moving the source folders keeps it; adding, removing, renaming or
    editing an image, editing a caption or a mask, changing repeats or a source's
    regularization, flip or mask setting does not."""
    digest = hashlib.sha256(fingerprint.encode())
    for r in rows:
        fields = (r["source_index"], r["path"], r["key"], r["caption_key"], r["repeats"])
        fields += (r["regularization"], bool(r["flip_file"]), r["mask_key"])
        digest.update(("\0".join(map(str, fields)) + "\n").encode())
    return digest.hexdigest()[:16]


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


def _index_row(row: dict, latent: dict, caption_row: int, flip=None, mask=None) -> dict:
    """The index row of ``row`` (a listed image): its ``latent`` row, its caption's row in the
    captions table, and the rows of its flipped latent and its mask (None: it has none)."""
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
    )


def _caption_row(caption: dict, tensors: list[str]) -> dict:
    out = {k: caption[k] for k in ("caption_key", "caption", "truncated")}
    out["text_file"] = caption["file"]
    for name in tensors:
        for column in (f"{name}_at", f"{name}_shape", checksum_column(name)):
            out[column] = caption[column]
    return out


def appearances(rows: list[dict]) -> dict[str, int]:
    """Samples per bucket in one epoch of the schedule: every row times its repeats (its
    source's, or its kohya folder's with ``repeats_from_folder``)."""
    counts: dict[str, int] = {}
    for row in rows:
        bucket = f"{row['width']}x{row['height']}"
        counts[bucket] = counts.get(bucket, 0) + row["repeats"]
    return dict(sorted(counts.items()))


def commit(
    version: Version, run: str, rows: list[dict], located: Located, generation=None, **extra
) -> dict:
    """Write the index of ``rows`` (the trained images, each with ``source_index``, and the
    keys of its flipped latent and its mask, ``flip_key`` and ``mask_key``, where it has them)
    and the captions they use (plus the empty one, for caption dropout), then the manifest:
    last. ``extra``: more manifest keys (family, dtype, report)."""
    rows = sorted(rows, key=lambda r: (r["source_index"], r["path"]))
    needed = sorted({r["caption_key"] for r in rows} | {caption_key("")})
    position = {k: i for i, k in enumerate(needed)}
    tensors, cells = located.text_tensors, located.latents
    index = [
        _index_row(
            r,
            cells[r["key"]],
            position[r["caption_key"]],
            cells[r["flip_key"]] if r.get("flip_key") else None,
            cells[r["mask_key"]] if r.get("mask_key") else None,
        )
        for r in rows
    ]
    captions = [_caption_row(located.captions[k], tensors) for k in needed]
    live_latents = {r["latent_file"] for r in index} | {r["flip_file"] for r in index}
    live_latents = sorted((live_latents | {r["mask_file"] for r in index}) - {""})
    live_text = sorted({c["text_file"] for c in captions})
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": version.fp,
        "latents": [located.entries[rel] for rel in live_latents],
        "text": [located.entries[rel] for rel in live_text],
        "index": version.write_table(
            f"{run}/{INDEX}", pa.Table.from_pylist(index, schema=INDEX_SCHEMA)
        ),
        "captions": version.write_table(
            f"{run}/{CAPTIONS}", pa.Table.from_pylist(captions, schema=captions_schema(tensors))
        ),
        "appearances": appearances(index),
        "text_tensors": tensors,
        "dataset": {"id": dataset_id(version.fp, index), "rows": len(rows)},
    } | extra
    return version.commit(manifest, generation)


def _setting(row: dict, what: str):
    """An index row's repeats, regularization, flip (whether it has a flipped latent) or mask
    (its key); an index written before a setting existed has its default."""
    if what == "flip":
        return bool(row.get("flip_file"))
    return row.get({"mask": "mask_key"}.get(what, what), "" if what == "mask" else False)


def describe_change(old: list[dict], new: list[dict], limit: int = 5) -> str:
    """What differs between two indexes' rows (by source and path; a source is its place in
    the job, so a moved folder is the same source), for a user: images added, removed or
    edited, captions and repeats changed."""

    def keyed(rows):
        return {(r["source_index"], r["path"]): r for r in rows}

    a, b = keyed(old), keyed(new)
    groups = {
        "added": [p for p in b if p not in a],
        "removed": [p for p in a if p not in b],
        "edited": [p for p in a.keys() & b.keys() if a[p]["key"] != b[p]["key"]],
        "caption changed": [
            p for p in a.keys() & b.keys() if a[p]["caption_key"] != b[p]["caption_key"]
        ],
    }
    for what in ("repeats", "regularization", "flip", "mask"):
        groups[f"{what} changed"] = [
            p for p in a.keys() & b.keys() if _setting(a[p], what) != _setting(b[p], what)
        ]
    parts = []
    for what, paths in groups.items():
        if paths:
            shown = ", ".join(p for _, p in sorted(paths)[:limit])
            more = f", … {len(paths) - limit} more" if len(paths) > limit else ""
            parts.append(f"{len(paths)} {what} ({shown}{more})")
    return "; ".join(parts) or "the same images in another order"
