"""Decode and bucket one new image (a Ray Data ``map`` step). A bad file becomes a skipped row."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from raytuner import storage
from raytuner.data.buckets import Size, fit_to_bucket, nearest_bucket
from raytuner.data.images import ImagePolicy, SkipImage, load_image


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
