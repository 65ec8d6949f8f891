"""Video clips decoded for the encoder pool (raytuner/preprocess/video.py), on clips the test
encodes itself with PyAV: each frame a flat grey of its own level, so the frames a sample took
can be read back from their pixels through a lossy codec."""

from __future__ import annotations

import io

import numpy as np
import pytest

from raytuner.preprocess.video import ClipError, FrameSpec, decode, frame_indices, probe

LEVEL = 12  # frame i is a flat grey of i x LEVEL (21 frames: up to 240)


def clip(frames: int, fps: int, size=(64, 48), fmt="mp4", codec="mpeg4") -> bytes:
    """An encoded clip of ``frames`` flat grey frames."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = *size, "yuv420p"
        stream.bit_rate = 4_000_000  # flat frames kept flat
        for i in range(frames):
            pixels = np.full((size[1], size[0], 3), i * LEVEL, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def levels(sample: np.ndarray) -> list[int]:
    """Which source frame each decoded frame was (its grey level / LEVEL, rounded)."""
    return [round(float(f.mean()) / LEVEL) for f in sample]


def test_which_source_frames_a_sample_takes():
    spec = FrameSpec(frames=5)
    assert frame_indices(12, 24.0, spec) == [[0, 1, 2, 3, 4]]
    assert frame_indices(12, 24.0, FrameSpec(frames=5, selection="uniform")) == [[0, 3, 6, 8, 11]]
    chunks = frame_indices(12, 24.0, FrameSpec(frames=5, selection="chunks"))
    assert chunks == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]  # the 2 left over make no sample
    # taken at 16 fps from 24: every 1.5 source frames, the frame showing at that time
    assert frame_indices(12, 24.0, FrameSpec(frames=5, fps=16)) == [[0, 1, 3, 4, 6]]
    with pytest.raises(ClipError, match="12 frames give 8 at 16 fps, fewer than the 9") as e:
        frame_indices(12, 24.0, FrameSpec(frames=9, fps=16))
    assert e.value.category == "too_short"


def test_a_sample_takes_4n_plus_1_frames_and_says_the_nearest():
    with pytest.raises(ValueError, match=r"frames = 80: a sample takes 4n \+ 1 .* e.g. 81"):
        FrameSpec(frames=80)
    with pytest.raises(ValueError, match="selection = 'random'"):
        FrameSpec(selection="random")


@pytest.mark.parametrize(("fmt", "codec"), [("mp4", "mpeg4"), ("webm", "libvpx-vp9")])
def test_decoded_samples_hold_the_frames_they_were_given(fmt, codec):
    data = clip(21, 24, fmt=fmt, codec=codec)
    info = probe(data, FrameSpec(frames=9))
    assert (info.width, info.height, info.frames, round(info.fps)) == (64, 48, 21, 24)
    (head,) = decode(data, FrameSpec(frames=9))
    assert head.shape == (9, 48, 64, 3) and head.dtype == np.uint8
    assert levels(head) == list(range(9))
    (uniform,) = decode(data, FrameSpec(frames=5, selection="uniform"))
    assert levels(uniform) == [0, 5, 10, 15, 20]
    chunks = decode(data, FrameSpec(frames=5, selection="chunks", fps=12))  # every other frame
    assert [levels(c) for c in chunks] == [[0, 2, 4, 6, 8], [10, 12, 14, 16, 18]]


def test_a_clip_that_gives_no_sample_ends_in_its_category():
    data = clip(9, 24)
    cases = {
        "too_short": (data, FrameSpec(frames=13)),
        "corrupt": (data[: len(data) // 3], FrameSpec(frames=9)),
        "bomb": (data, FrameSpec(frames=9, max_pixels=64 * 48 - 1)),
        "huge": (data, FrameSpec(frames=9, max_bytes=len(data) - 1)),
    }
    for category, (clip_bytes, spec) in cases.items():
        with pytest.raises(ClipError) as e:
            decode(clip_bytes, spec)
        assert e.value.category == category, (category, str(e.value))
    with pytest.raises(ClipError) as e:
        decode(b"not a video at all" * 100, FrameSpec(frames=9))
    assert e.value.category == "corrupt"
