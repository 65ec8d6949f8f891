"""Clips from a video family's renders: each an H.264 mp4 written with PyAV, and a poster (a strip
of evenly spaced frames as one PNG) for the sample folder, the run folder and TensorBoard.

The encoder: libx264 (H.264 in yuv420p, what every browser, player and chat app plays), which
PyAV's wheels ship inside their FFmpeg; a build of PyAV without it falls back to FFmpeg's own
MPEG-4 Part 2 encoder (``mpeg4``: always built in, played by VLC, mpv and ffmpeg-based tools, not
by every browser). yuv420p stores colour at half the size on each side: a clip of odd width or
height is padded by its last column or row to even sides (a video family's pixel grid keeps
them even: Wan's sides are multiples of 16). The mp4's index is at its start (``faststart``:
it plays while it downloads). Pure: no torch, no pipeline.
"""

from __future__ import annotations

import functools
import os
import tempfile
from fractions import Fraction

import numpy as np
from PIL import Image

CODECS = ("libx264", "mpeg4")  # in order of preference; the first PyAV's FFmpeg can encode
POSTER_FRAMES = 4  # frames in a clip's poster strip: its first, its last and evenly between
CRF = 18  # libx264's constant rate factor: visually near lossless at a few MB a clip


@functools.cache
def codec() -> str:
    """The encoder clips are written with (``CODECS``' first that PyAV's FFmpeg has)."""
    import av

    for name in CODECS:
        try:
            av.codec.Codec(name, "w")
        except av.codec.codec.UnknownCodecError:
            continue
        return name
    raise RuntimeError(f"PyAV {av.__version__}'s FFmpeg has none of the encoders {CODECS}")


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """A pipeline's frames in [0, 1] (``output_type="np"``: [F, H, W, 3]) as 8-bit pixels,
    rounded as diffusers rounds its PIL images."""
    return (np.clip(frames, 0.0, 1.0) * 255).round().astype(np.uint8)


def even(frames: np.ndarray) -> np.ndarray:
    """``frames`` [F, H, W, 3] with odd sides padded by their last row or column."""
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if not (pad_h or pad_w):
        return frames
    return np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")


def mp4_bytes(frames: np.ndarray, fps: float) -> bytes:
    """The clip ``frames`` (uint8 [F, H, W, 3]) as an mp4 at ``fps`` frames a second, encoded
    with ``codec()`` in yuv420p. Written to a temporary local file (faststart moves the index
    to the front once every frame is in, which needs a file it can reopen)."""
    import av

    frames, name = even(frames), codec()
    rate = Fraction(fps).limit_denominator(1001)  # 23.976 -> 24000/1001, as NTSC rates are
    with tempfile.TemporaryDirectory(prefix="raytuner-clip-") as scratch:
        path = os.path.join(scratch, "clip.mp4")
        with av.open(path, "w", format="mp4", options={"movflags": "+faststart"}) as out:
            stream = out.add_stream(name, rate=rate)
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            if name == "libx264":
                stream.options = {"crf": str(CRF)}
            else:  # mpeg4 takes a bit rate: about 0.3 bit a pixel, as x264 at CRF 18 spends
                stream.bit_rate = max(1_000_000, int(0.3 * stream.width * stream.height * fps))
            for pixels in frames:
                out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
            out.mux(stream.encode())  # flush the encoder's delayed frames
        with open(path, "rb") as f:
            return f.read()


def poster(frames: np.ndarray, count: int = POSTER_FRAMES) -> Image.Image:
    """``count`` evenly spaced frames of the clip (its first and last among them) side by side,
    left to right in time: what a grid, the run folder and TensorBoard show of a clip."""
    picked = np.unique(np.linspace(0, len(frames) - 1, min(count, len(frames))).round())
    return Image.fromarray(np.concatenate([frames[int(i)] for i in picked], axis=1))
