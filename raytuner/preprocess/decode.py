"""The stream's first step (Ray Data tasks, no torch): probe each listed file (content hash,
caption) and decode and bucket the new ones. A bad file becomes a row with its reason."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from PIL import Image

from raytuner import storage
from raytuner.data.cache import caption_key
from raytuner.preprocess.buckets import Size, fit_to_bucket, nearest_bucket
from raytuner.preprocess.images import ImagePolicy, SkipImage, load_image
from raytuner.preprocess.sources import probe_and_read

# The row kinds of the stream (its ``status`` column).
ENCODE = "encode"  # decoded pixels: VAE-encode them
FAILED = "failed"  # the decode refused the file (``failure`` says why)
PROBED = "probed"  # nothing to encode: skipped at probe, already cached, or a duplicate above
TEXT = "text"  # a caption's text tensors, appended by the encoder
SHAPE = pa.list_(pa.int32())
# One row of the stream as ``probe_decode`` emits it.
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
DECODED = ("width", "height", "original_size", "crop_top_left")


@dataclass(frozen=True)
class DecodeSpec:
    """Everything the decode step needs, as plain values (shipped to Ray Data tasks)."""

    roots: list[str]  # source folder of each source index
    buckets: list[Size]
    crop: str
    seed: int
    min_aspect: float
    max_aspect: float
    aspect_policy: str
    image: ImagePolicy


def _row(row: dict, status: str = "ok", reason: str = "") -> dict:
    return {
        "key": row["key"],
        "path": row["path"],
        "status": status,
        "reason": reason,
        "pixels": b"",
        "width": 0,
        "height": 0,
        "original_size": [0, 0],
        "crop_top_left": [0, 0],
    }


def _load(row: dict, spec: DecodeSpec, data: bytes | None) -> Image.Image:
    if data is None:
        fs, root = storage.resolve(spec.roots[row["source"]])
        try:
            data = storage.read_bytes(fs, storage.join(root, row["path"]))
        except OSError as e:
            raise SkipImage(f"unreadable: {e}") from None
    image = load_image(data, spec.image)
    aspect = image.width / image.height
    if spec.aspect_policy == "skip" and not spec.min_aspect <= aspect <= spec.max_aspect:
        raise SkipImage(
            f"aspect ratio {aspect:.2f} outside [{spec.min_aspect}, {spec.max_aspect}] "
            "(preprocess.aspect_policy = skip)"
        )
    return image


def decode_row(row: dict, spec: DecodeSpec, data: bytes | None = None) -> dict:
    """One new image -> a row with bucket-sized RGB pixels, or a skipped row with a reason.
    ``data``: the file's bytes when the caller has read them already."""
    try:
        rgb = _load(row, spec, data)
    except SkipImage as e:
        return _row(row, "skipped", str(e))
    bucket = nearest_bucket(rgb.width, rgb.height, spec.buckets)
    crop_seed = int(row["key"][:8], 16) ^ spec.seed
    (rw, rh), (top, left) = fit_to_bucket(rgb.width, rgb.height, bucket, spec.crop, crop_seed)
    resized = rgb.resize((rw, rh), Image.Resampling.LANCZOS)
    pixels = np.asarray(resized.crop((left, top, left + bucket[0], top + bucket[1])))
    return {
        **_row(row),
        "pixels": pixels.tobytes(),
        "width": bucket[0],
        "height": bucket[1],
        "original_size": [rgb.height, rgb.width],
        "crop_top_left": [top, left],
    }


def _stream_row(row: dict, sources, spec: DecodeSpec, known: frozenset, taken: set) -> dict:
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
    rows = [_stream_row(r, sources, spec, known, taken) for r in batch.to_pylist()]
    return pa.Table.from_pylist(rows, schema=STREAM_SCHEMA)
