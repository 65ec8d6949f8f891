"""Video clips the tests encode themselves with PyAV (tests/preprocess/test_clips.py,
tests/train/test_clip_training.py, the preprocess bench's video mode)."""

from __future__ import annotations

import io

import numpy as np


def clip(frames: int, fps: int, size=(64, 48), fmt="mp4", codec="mpeg4", seed=0) -> bytes:
    """An encoded clip of ``frames`` frames of smooth random colour."""
    import av

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    with av.open(out, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        stream.bit_rate = 4_000_000
        for _ in range(frames):
            level = rng.integers(0, 255, size=3)
            pixels = np.broadcast_to(level, (size[1], size[0], 3)).astype(np.uint8)
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()
