"""The peak bytes of an encoder actor's VAE encode, traced on the meta device, for `raytuner plan`
(``trace.trace_encoders``).

A trace on meta costs the same at any size, op for op, and a clip's encode has many: Wan 2.1's
VAE encodes a clip four frames at a time (a chunk: one latent frame), and above 832x480 in
tiles, so 81 frames at 1280x720 were two traces, 26 s in all on 2 CPU cores. Its bytes are affine in
the batch (a batched encoder's activations grow with it; a sliced one holds one sample's and the
batch's inputs and outputs) and, from the second chunk on, in the chunks (the features a chunk
keeps for the next have the same size at every chunk; the latent grows by one frame). So a clip
of many chunks is traced at 2, 3 and 4 chunks, and the peak at its own count is extrapolated
from those, when they are exactly affine (the same bytes added by the third chunk as by the
fourth); else it is traced whole. Measured (2026-11-28, the shipped Wan 2.1 and Wan 2.2 TI2V-5B
VAEs, 800x512, 1280x720, 1152x800): the extrapolated peaks equal the whole traces' to the byte.
"""

from __future__ import annotations

import torch

from raytuner.families import parts
from raytuner.families.records import latent_frames
from raytuner.tools.plan.meta import traced

CHUNKS = (2, 3, 4)  # the chunk counts a long clip is traced at (the line's points and a check)

ENCODES: dict = {}  # what encode_peak traced, by what decides it


def encode_peak(family, source, encode_image, sample: tuple[int, ...], n: int):
    """The peak bytes of a VAE encode of ``n`` samples of shape ``sample`` ([3, h, w] or a
    clip's [3, F, h, w]) and one sample's latent (on meta). Kept by what decides it (the
    encoder's code, its VAE's class and architecture, the weights' dtype, the input's shape):
    the plans of one process (a plan per card) trace Wan 2.1's VAE once for Wan 2.1 14B and 1.3B
    and Wan 2.2 A14B."""
    cls_path = family.parts.classes["vae"]
    config = parts.config(family.name, source, "vae", cls_path)  # less where it came from:
    architecture = tuple(sorted((k, repr(v)) for k, v in config.items() if k[0] != "_"))
    code = getattr(encode_image, "__code__", type(encode_image))
    key = code, cls_path, architecture, str(source.dtype), sample, n
    if key not in ENCODES:
        ENCODES[key] = _clip_peak(family.geometry, encode_image, sample, n)
    return ENCODES[key]


def _clip_peak(geometry, encode_image, sample: tuple[int, ...], n: int):
    """``encode_peak``'s figures: a clip of more chunks than its traces at ``CHUNKS`` chunks
    hold together from those, where they are affine; anything else traced as it is."""
    step = geometry.frame_multiple
    chunks = (sample[1] - 1) // step if step and len(sample) == 4 else 0
    if chunks + 1 <= sum(k + 1 for k in CHUNKS):  # as many chunks as the three traces hold
        return _batch_peak(encode_image, sample, n)
    traces = [_batch_peak(encode_image, (sample[0], 1 + k * step, *sample[2:]), n) for k in CHUNKS]
    peaks = [peak for peak, _ in traces]
    added = {b - a for a, b in zip(peaks, peaks[1:], strict=False)}
    if len(added) != 1:  # not affine in the chunks: the whole clip
        return _batch_peak(encode_image, sample, n)
    latent = traces[-1][1]
    frames = latent_frames(geometry, sample[1])
    shape = (*latent.shape[:2], frames, *latent.shape[3:])
    peak = peaks[-1] + (chunks - CHUNKS[-1]) * added.pop()
    return peak, torch.empty(shape, dtype=latent.dtype, device="meta")


def _batch_peak(encode_image, sample: tuple[int, ...], n: int):
    """The peak bytes of an encode of ``n`` samples from the traces of batches of 1 and 2 (the
    bytes are affine in the batch), and one sample's latent."""
    peaks = []
    for batch in (1, 2)[: min(n, 2)]:
        pixels = torch.zeros(batch, *sample, device="meta")  # arrives before the trace
        with traced() as live:
            latent = encode_image(pixels)[0]
        peaks.append(live.peak)
    return peaks[0] + (n - 1) * (peaks[-1] - peaks[0]), latent
