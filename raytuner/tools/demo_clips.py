"""A small captioned set of video clips drawn in code (``raytuner bench preprocess --clips``):
a disc moving across a coloured ground at three aspect ratios, encoded with PyAV (mpeg4 in
mp4), a caption file beside each."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

SIZES = ((96, 96), (128, 80), (80, 128))  # (width, height): square, landscape, portrait


def clip_bytes(frames: int, fps: int, size: tuple[int, int], seed: int) -> bytes:
    """An mp4 of ``frames`` frames at ``fps``: a disc of a colour moving over a ground."""
    import av

    rng = np.random.default_rng(seed)
    w, h = size
    ground, disc = rng.integers(0, 255, size=3), rng.integers(0, 255, size=3)
    yy, xx = np.mgrid[0:h, 0:w]
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.bit_rate = 2_000_000
        for i in range(frames):
            cx, cy = (i * 3) % w, h // 2
            inside = (xx - cx) ** 2 + (yy - cy) ** 2 < (min(w, h) // 5) ** 2
            pixels = np.where(inside[..., None], disc, ground).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def make_demo_clips(folder: str | Path, count: int, frames: int, fps: int = 24) -> Path:
    """``count`` clips of ``frames`` frames, each with a caption file, in ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        size = SIZES[i % len(SIZES)]
        (folder / f"clip{i:04d}.mp4").write_bytes(clip_bytes(frames, fps, size, seed=i))
        (folder / f"clip{i:04d}.txt").write_text(f"a moving disc, clip {i}")
    return folder
