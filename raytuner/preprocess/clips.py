"""Video clips in the preprocess stream (issue 40): a clip file listed beside the images becomes
one stream row per sample it gives (``head`` / ``uniform``: one; ``chunks``: one per run of
frames), each with its own key, decoded with ``preprocess/video.py`` (PyAV) in the stream's
CPU tasks and cut to its bucket like an image (every frame resized and cropped alike).

A sample's key is the clip's content hash, what was taken of it (frame count, selection, fps)
and its place among the clip's samples (``data/clip_rows.py``): an edited clip, or other frame
settings, make new keys (only that clip is encoded again). A clip's sample takes the largest of
its source's frame counts (``data.frames``) its length gives: the frame bucket it trains in. A
rerun trusts a clip whose size and mtime are the committed index's, under the same frame
settings, and whose samples are all cached: its rows are made again from the index's, the clip
is not read (its caption file is).

Every listed clip ends in one report category (``CLIP_CATEGORIES``): ``trained``, one of
``video.CATEGORIES`` (``corrupt``, ``too_short``, ``codec``, ``bomb``, ``huge``),
``not_trained`` (the family trains images only: ``Geometry.frame_multiple`` 0) or
``skipped`` (the probe left it out: no caption, unreadable, a symlink out of the folder...).
Loss masks are not made for clips (a mask file is an image's); flips mirror every frame.

Memory: a decode task holds at most ``BLOCK_BYTES`` of decoded samples, or one sample where it
is more (81 x 832 x 480 x 3 = 97 MB of uint8), and the one it decodes (``decode_samples``
hands each sample on once its last frame is decoded)."""

from __future__ import annotations

import posixpath

import numpy as np
from PIL import Image

# the sample keys' format, owned by the cache's layer (a rerun reads the committed clips)
from raytuner.data.clip_rows import content_of as content_of
from raytuner.data.clip_rows import sample_key as sample_key
from raytuner.preprocess import video
from raytuner.preprocess.buckets import fit_to_bucket, nearest_bucket

VIDEO_EXTENSIONS = {".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v", ".mpg", ".mpeg", ".wmv"}
TRAINED, NOT_TRAINED, SKIPPED = "trained", "not_trained", "skipped"
# decoded clip samples a stream table holds at most (one sample where it is more: 81 frames at
# 832x480 are 97 MB), as ``pipeline.BLOCK_PIXEL_BYTES`` bounds a block of images
BLOCK_BYTES = 64 * 1024**2
CLIP_CATEGORIES = (TRAINED, *video.CATEGORIES, NOT_TRAINED, SKIPPED)


def is_clip(path: str) -> bool:
    """Whether a listed file is a video clip (by its extension)."""
    return posixpath.splitext(path)[1].lower() in VIDEO_EXTENSIONS


def samples_of(data: bytes, counts: list[int], selection: str, fps: float, limits: dict):
    """(the clip's ``ClipInfo``, the frame count taken, each sample's source frames): the
    largest of ``counts`` the clip's length gives. ClipError with its category otherwise;
    ``limits``: FrameSpec's ``max_pixels`` and ``max_bytes``."""
    spec = video.FrameSpec(frames=min(counts), selection=selection, fps=fps, **limits)
    info = video.probe(data, spec)
    for n in sorted(counts, reverse=True):
        try:
            chosen = video.FrameSpec(frames=n, selection=selection, fps=fps, **limits)
            return info, n, video.frame_indices(info.frames, info.fps, chosen)
        except video.ClipError as e:
            error = e
    raise error


decode_samples = video.decode_samples  # the stream's decode: video.py


def fit_clip(frames: np.ndarray, buckets, crop: str, seed: int) -> dict:
    """A sample's frames [F, H, W, 3] cut to its bucket as an image is (every frame the same
    resize and crop): its pixels' bytes and the row's bucket and conditioning columns."""
    _, h, w, _ = frames.shape
    bucket = nearest_bucket(w, h, buckets)
    (rw, rh), (top, left) = fit_to_bucket(w, h, bucket, crop, seed)
    box = (left, top, left + bucket[0], top + bucket[1])
    cut = np.stack(
        [
            np.asarray(Image.fromarray(f).resize((rw, rh), Image.Resampling.LANCZOS).crop(box))
            for f in frames
        ]
    )
    return {
        "pixels": cut.tobytes(),
        "width": bucket[0],
        "height": bucket[1],
        "frames": int(frames.shape[0]),
        "original_size": [h, w],
        "crop_top_left": [top, left],
        "flip_crop_top_left": [top, rw - left - bucket[0]],
    }


def clip_report(rows: list[dict], indexed: list[dict]) -> dict:
    """The report's ``clips``: each listed clip's category counted once (a clip whose samples
    are all duplicates of another file's counts as ``skipped``), the samples trained, per frame
    count."""
    category: dict[tuple, str] = {}
    for r in rows:
        if r.get("clip"):
            category.setdefault((r["source"], r["path"]), r["clip"])
    trained = {(r["source_index"], r["path"]) for r in indexed if r.get("frames")}
    counts = dict.fromkeys(CLIP_CATEGORIES, 0)
    for where, c in category.items():
        counts[TRAINED if where in trained else (SKIPPED if c == TRAINED else c)] += 1
    frames: dict[int, int] = {}
    for r in indexed:
        if r.get("frames"):
            frames[r["frames"]] = frames.get(r["frames"], 0) + 1
    # keyed by the frame count as a string: the report is JSON
    by_count = {str(n): k for n, k in sorted(frames.items())}
    samples = {"samples": sum(frames.values()), "frames": by_count}
    return {"files": len(category), **counts, **samples}


def report_line(clips: dict) -> str:
    """The report's line on clips (``clip_report``)."""
    counts = ", ".join(f"{c} {clips[c]}" for c in CLIP_CATEGORIES[1:] if clips[c])
    frames = ", ".join(f"{n} frames: {k}" for n, k in clips["frames"].items())
    return (
        f"  clips: {clips['files']} files, {clips[TRAINED]} trained ({clips['samples']} "
        f"samples{'; ' + frames if frames else ''}){'; ' + counts if counts else ''}"
    )
