"""Aspect-ratio buckets: pure functions of sizes, no I/O."""

from __future__ import annotations

import math
import random

Size = tuple[int, int]  # (width, height)


def make_buckets(resolution: int, step: int, min_aspect: float, max_aspect: float) -> list[Size]:
    """Bucket sizes (multiples of ``step``) of about ``resolution**2`` pixels, widest last.

    For every width, the tallest height that keeps the area within ``resolution**2``; only
    aspect ratios (width / height) inside [min_aspect, max_aspect] are kept.
    """
    if resolution < step:
        raise ValueError(f"resolution {resolution} is smaller than the bucket step {step}")
    area = resolution * resolution
    buckets: set[Size] = set()
    for width in range(step, area // step + 1, step):
        height = (area // width) // step * step
        if height >= step and min_aspect <= width / height <= max_aspect:
            buckets.add((width, height))
            if min_aspect <= height / width <= max_aspect:
                buckets.add((height, width))
    if not buckets:
        raise ValueError("no bucket fits: widen preprocess.min_aspect / preprocess.max_aspect")
    return sorted(buckets, key=lambda b: b[0] / b[1])


def nearest_bucket(width: int, height: int, buckets: list[Size]) -> Size:
    """The bucket whose aspect ratio is closest (in log space); ties go to the larger area."""
    target = math.log(width / height)
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - target), -b[0] * b[1]))


def fit_to_bucket(width: int, height: int, bucket: Size, mode: str, seed: int) -> tuple[Size, Size]:
    """How to fit an image into a bucket: (resized size, crop top-left as (top, left)).

    ``center`` and ``random`` scale the image to cover the bucket and crop the overflow
    (``random`` draws the offset from ``seed``, so it is reproducible); ``none`` resizes to the
    bucket exactly, without cropping.
    """
    bw, bh = bucket
    if mode == "none":
        return (bw, bh), (0, 0)
    scale = max(bw / width, bh / height)
    rw, rh = max(bw, round(width * scale)), max(bh, round(height * scale))
    if mode == "center":
        return (rw, rh), ((rh - bh) // 2, (rw - bw) // 2)
    if mode == "random":
        rng = random.Random(seed)
        return (rw, rh), (rng.randint(0, rh - bh), rng.randint(0, rw - bw))
    raise ValueError(f"crop mode {mode!r}: use center, random or none")
