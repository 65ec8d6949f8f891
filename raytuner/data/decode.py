"""Read, decode and bucket one image (a Ray Data ``map`` step). A bad file becomes a skipped row."""

from __future__ import annotations

import hashlib
import io
import posixpath
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from raytuner import storage
from raytuner.data.buckets import Size, fit_to_bucket, nearest_bucket


def caption_key(caption: str) -> str:
    return hashlib.sha256(caption.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class DecodeSpec:
    """Everything the decode step needs, as plain values (shipped to Ray Data tasks)."""

    root: str
    buckets: list[Size]
    crop: str
    seed: int
    caption_fallback: str


def _caption(fs, root: str, row: dict, fallback: str) -> str | None:
    text = ""
    if row["caption_path"]:
        raw = storage.read_bytes(fs, storage.join(root, row["caption_path"]))
        text = raw.decode("utf-8", errors="replace").strip()
    if text:
        return text
    if fallback == "stem":
        return posixpath.splitext(posixpath.basename(row["path"]))[0].replace("_", " ")
    return "" if fallback == "empty" else None


def _to_rgb(image: Image.Image) -> Image.Image:
    image = ImageOps.exif_transpose(image)
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _skipped(row: dict, key: str, reason: str) -> dict:
    return {**_empty(row, key), "status": "skipped", "reason": reason}


def _empty(row: dict, key: str) -> dict:
    return {
        "key": key,
        "path": row["path"],
        "caption": "",
        "caption_key": "",
        "status": "ok",
        "reason": "",
        "pixels": b"",
        "width": 0,
        "height": 0,
        "original_size": np.zeros(2, np.int32),
        "crop_top_left": np.zeros(2, np.int32),
    }


def decode_row(row: dict, spec: DecodeSpec) -> dict:
    """One listed image -> a row with bucket-sized RGB pixels, or a skipped row with a reason."""
    fs, root = storage.resolve(spec.root)
    try:
        data = storage.read_bytes(fs, storage.join(root, row["path"]))
    except OSError as e:
        return _skipped(row, "", f"unreadable: {e}")
    key = hashlib.sha256(data).hexdigest()
    caption = _caption(fs, root, row, spec.caption_fallback)
    if caption is None:
        return _skipped(row, key, "no caption")
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            rgb = _to_rgb(image)
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        return _skipped(row, key, f"not a readable image: {type(e).__name__}: {e}")
    bucket = nearest_bucket(rgb.width, rgb.height, spec.buckets)
    int_seed = int.from_bytes(bytes.fromhex(key[:8]), "big") ^ spec.seed
    (rw, rh), (top, left) = fit_to_bucket(rgb.width, rgb.height, bucket, spec.crop, int_seed)
    resized = rgb.resize((rw, rh), Image.Resampling.LANCZOS)
    pixels = np.asarray(resized.crop((left, top, left + bucket[0], top + bucket[1])))
    return {
        **_empty(row, key),
        "caption": caption,
        "caption_key": caption_key(caption),
        "pixels": pixels.tobytes(),
        "width": bucket[0],
        "height": bucket[1],
        "original_size": np.asarray([rgb.height, rgb.width], np.int32),
        "crop_top_left": np.asarray([top, left], np.int32),
    }
