"""Video clips as the encoder pool will take them (issue 40): decoded on CPU with PyAV, whose
wheels ship FFmpeg (no system FFmpeg to install on every node, and the same decoders
everywhere), into the frames a sample takes.

A sample is ``frames`` frames, 4n + 1 of them (Wan's causal VAE: 1 + 4 per latent frame), taken
from the clip at ``fps`` (0: its own rate) by a selection: ``head`` (the first ones), ``uniform``
(spread over the whole clip) or ``chunks`` (consecutive runs, each its own sample). Which source
frames a sample takes is a pure function (``frame_indices``); decoding keeps only those, so a
long clip costs its frames a sample, not its length. A clip that cannot give a sample raises
``ClipError`` with the report category it ends in (never a crash of the preprocess):
``corrupt``, ``too_short``, ``codec``, ``bomb`` (a frame over ``max_pixels``) or ``huge``
(a file over ``max_bytes``).

Bytes, at Wan's sizes: 81 frames at 832x480 decoded are 81 x 832 x 480 x 3 = 97 MB of uint8
a sample (kept until the VAE has it); a decode task holds one sample's frames at a time.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

SELECTIONS = ("head", "uniform", "chunks")
CATEGORIES = ("corrupt", "too_short", "codec", "bomb", "huge")


class ClipError(ValueError):
    """A clip that gives no sample, with its report category (``CATEGORIES``)."""

    def __init__(self, category: str, message: str) -> None:
        super().__init__(message)
        self.category = category


@dataclass(frozen=True, kw_only=True)
class FrameSpec:
    """What a sample takes of a clip."""

    frames: int = 81  # frames a sample takes: 4n + 1
    selection: str = "head"
    fps: float = 0.0  # the rate frames are taken at; 0: the clip's own
    max_pixels: int = 178_956_970  # a frame's width x height at most (decompression bombs)
    max_bytes: int = 4 * 2**30  # a clip file's size at most

    def __post_init__(self) -> None:
        if self.frames < 1 or self.frames % 4 != 1:
            near = max(1, 4 * round((self.frames - 1) / 4) + 1)
            raise ValueError(
                f"frames = {self.frames}: a sample takes 4n + 1 frames (the VAE's 1 + 4 a "
                f"latent frame), e.g. {near}"
            )
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection = {self.selection!r}: one of {', '.join(SELECTIONS)}")
        if self.fps < 0:
            raise ValueError(f"fps = {self.fps}: 0 (the clip's own rate) or a rate > 0")


@dataclass(frozen=True)
class ClipInfo:
    """A clip's video stream as its container describes it."""

    width: int
    height: int
    fps: float
    frames: int  # frames in the stream (counted where the container does not say)
    codec: str


def frame_indices(total: int, clip_fps: float, spec: FrameSpec) -> list[list[int]]:
    """The source frames (0-based) of each sample of a clip of ``total`` frames at
    ``clip_fps``: frames taken at ``spec.fps`` (each the source frame showing at that time),
    then selected. Raises ClipError (``too_short``) when fewer than ``spec.frames`` are
    there to take."""
    step = clip_fps / spec.fps if spec.fps else 1.0  # source frames per taken frame
    taken = [min(total - 1, math.floor(k * step + 1e-9)) for k in range(int(total / step))]
    n = spec.frames
    if len(taken) < n:
        at = f" at {spec.fps:g} fps" if spec.fps else ""
        raise ClipError(
            "too_short", f"{total} frames give {len(taken)}{at}, fewer than the {n} a sample takes"
        )
    if spec.selection == "head":
        return [taken[:n]]
    if spec.selection == "uniform":
        spread = np.linspace(0, len(taken) - 1, n).round().astype(int)
        return [[taken[i] for i in spread]]
    return [taken[i : i + n] for i in range(0, len(taken) - n + 1, n)]  # chunks


def probe(data: bytes, spec: FrameSpec) -> ClipInfo:
    """The clip's video stream, refused (ClipError) before any frame is decoded when the file
    or a frame is too large, its codec is not one FFmpeg decodes, or it is no video."""
    import av

    if len(data) > spec.max_bytes:
        raise ClipError("huge", f"{len(data):,} bytes, over the {spec.max_bytes:,} allowed")
    try:
        with av.open(io.BytesIO(data)) as container:
            return _info(container, spec)
    except av.error.FFmpegError as e:
        raise ClipError("corrupt", f"not a video FFmpeg reads ({e})") from None


def _info(container, spec: FrameSpec) -> ClipInfo:
    if not container.streams.video:
        raise ClipError("corrupt", "no video stream")
    stream = container.streams.video[0]
    if stream.codec_context is None or not stream.codec_context.name:
        raise ClipError("codec", "a video stream of a codec FFmpeg cannot decode")
    w, h = stream.codec_context.width, stream.codec_context.height
    if w * h > spec.max_pixels:
        raise ClipError("bomb", f"{w}x{h} frames, over max_pixels = {spec.max_pixels:,}")
    rate = float(stream.average_rate or stream.guessed_rate or 0)
    if rate <= 0:
        raise ClipError("corrupt", "no frame rate")
    frames = stream.frames or _counted(container, stream)
    return ClipInfo(w, h, rate, frames, stream.codec_context.name)


def _counted(container, stream) -> int:
    """Frames of a stream whose container does not count them (WebM): its packets' frames."""
    n = sum(1 for packet in container.demux(stream) if packet.size)
    container.seek(0)
    return n


def decode(data: bytes, spec: FrameSpec) -> list[np.ndarray]:
    """Each sample of the clip ``data`` (file bytes) as [frames, height, width, 3] uint8 RGB;
    ClipError with its category when it gives none."""
    info = probe(data, spec)
    return list(decode_samples(data, frame_indices(info.frames, info.fps, spec)))


def decode_samples(data: bytes, samples: list[list[int]]) -> Iterator[np.ndarray]:
    """Each sample's frames [F, H, W, 3] uint8 RGB, in order, each handed on once its last
    frame is decoded (the frames no later sample takes are dropped); ClipError (``corrupt``)
    where the stream breaks or ends before a sample's frames."""
    import av

    wanted: dict[int, int] = {}  # source frame -> samples still taking it
    for s in samples:
        for i in s:
            wanted[i] = wanted.get(i, 0) + 1
    kept: dict[int, np.ndarray] = {}
    pending, last = list(samples), max(wanted)
    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    kept[i] = frame.to_ndarray(format="rgb24")
                while pending and max(pending[0]) <= i:
                    yield _taken(pending.pop(0), kept, wanted)
                if i >= last:
                    break
    except av.error.FFmpegError as e:
        raise ClipError("corrupt", f"decoding failed at a sample's frames ({e})") from None
    if pending:
        raise ClipError("corrupt", f"the stream ends before frame {max(pending[0])}")


def _taken(sample: list[int], kept: dict, wanted: dict) -> np.ndarray:
    out = np.stack([kept[i] for i in sample])
    for i in sample:
        wanted[i] -= 1
        if not wanted[i]:
            kept.pop(i, None)
    return out
