"""The stream's first step (Ray Data tasks, no torch): probe each listed file (content hash,
caption, mask file) and decode and bucket the ones with something new to encode: the image's
latent, its mirror image's (``data.flip``) or its loss mask (``data.mask``). A bad file (or a
bad mask file) becomes a row with its reason. A clip becomes a row per sample it gives
(``preprocess/clips.py``), each decoded sample handed on as a table of its own."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
from PIL import Image

from raytuner import storage
from raytuner.data import clip_rows
from raytuner.data.keys import ALPHA, caption_key, flip_key, mask_key
from raytuner.preprocess import clips, video
from raytuner.preprocess.buckets import Size, fit_to_bucket, nearest_bucket
from raytuner.preprocess.images import ImagePolicy, SkipImage, load_mask, load_with_alpha
from raytuner.preprocess.progress import (
    CACHED,
    READ,
    SAMPLES,
    SKIPPED,
    TO_ENCODE,
    clock,
    timed,
)
from raytuner.preprocess.sources import probe_and_read
from raytuner.preprocess.stream_rows import ENCODE, FAILED, PROBED, STREAM_SCHEMA

# what an ENCODE row takes of its decoded image besides its pixels and mask
DECODED = ("width", "height", "original_size", "crop_top_left", "flip_crop_top_left", "alpha")


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
    # the family's Geometry.frame_multiple (0: it trains images only, its clips are not trained)
    frame_multiple: int = 0


@dataclass(frozen=True)
class Known:
    """What the cache holds before the run: its latent-file row keys (images, flipped
    latents, masks) and the images among them with transparency."""

    keys: frozenset[str]
    alpha: frozenset[str]


def _row(row: dict, status: str = "ok", reason: str = "") -> dict:
    return {
        "key": row["key"],
        "path": row["path"],
        "status": status,
        "reason": reason,
        "pixels": b"",
        "mask": b"",
        "alpha": False,
        "clip": "",
        "frames": 0,
        "settings": "",
        "width": 0,
        "height": 0,
        "original_size": [0, 0],
        "crop_top_left": [0, 0],
        "flip_crop_top_left": [0, 0],
    }


class Unreadable(SkipImage):
    """A file the decode could not read (an OSError): not a refusal of its bytes."""


def _read(row: dict, spec: DecodeSpec, path: str, what: str) -> bytes:
    fs, root = storage.resolve(spec.roots[row["source"]])
    try:
        return storage.read_bytes(fs, storage.join(root, path))
    except OSError as e:
        raise Unreadable(f"{what}unreadable: {e}") from None


def refusal_settings(spec: DecodeSpec, source, clip: bool, mask: str = "") -> str:
    """What the decode's refusal of a file depends on besides its bytes: an image's limits,
    aspect policy and its mask (``mask``: its mask key, of its mask file's content); a clip's
    frame counts, selection, fps and limit. A rerun trusts a refusal under the same
    (``data/trust.py``), and decodes the file again under others."""
    if clip:
        frames = [list(source.frames), source.frame_selection, source.fps]
        return json.dumps(["clip", spec.image.max_pixels, *frames])
    image = [spec.image.max_pixels, spec.image.min_size]
    aspect = [spec.aspect_policy, spec.min_aspect, spec.max_aspect]
    return json.dumps(["image", *image, *aspect, mask])


def _load(row: dict, spec: DecodeSpec, data: bytes | None):
    """The upright RGB image and its alpha channel (None: it has none)."""
    data = _read(row, spec, row["path"], "") if data is None else data
    image, alpha = load_with_alpha(data, spec.image)
    aspect = image.width / image.height
    if spec.aspect_policy == "skip" and not spec.min_aspect <= aspect <= spec.max_aspect:
        raise SkipImage(
            f"aspect ratio {aspect:.2f} outside [{spec.min_aspect}, {spec.max_aspect}] "
            "(preprocess.aspect_policy = skip)"
        )
    return image, alpha


def _mask_file(row: dict, spec: DecodeSpec, size: tuple[int, int]) -> Image.Image:
    """The image's mask file (mode L), at the image's ``size`` (width, height): one of another
    aspect ratio is refused, one of another size resized."""
    where = f"mask file {row['mask_path']!r}: "
    try:
        mask = load_mask(_read(row, spec, row["mask_path"], where), spec.image)
    except SkipImage as e:
        raise SkipImage(str(e) if str(e).startswith(where) else where + str(e)) from None
    if abs(mask.width * size[1] - mask.height * size[0]) > 0.01 * size[0] * size[1]:
        raise SkipImage(
            f"{where}{mask.width}x{mask.height}, the image {size[0]}x{size[1]}: a mask must "
            "have the image's aspect ratio"
        )
    return mask if mask.size == size else mask.resize(size, Image.Resampling.BILINEAR)


def _cropped(image: Image.Image, resized: tuple[int, int], box: tuple, method) -> np.ndarray:
    return np.asarray(image.resize(resized, method).crop(box))


def decode_row(row: dict, spec: DecodeSpec, data: bytes | None = None, mask: str = "") -> dict:
    """One new image -> a row with bucket-sized RGB pixels (and with ``mask`` "alpha" or
    "file", the mask's pixels cropped alike), or a skipped row with a reason. ``data``: the
    file's bytes when the caller has read them already."""
    try:
        rgb, alpha = _load(row, spec, data)
        source = _mask_file(row, spec, rgb.size) if mask == "file" else alpha
    except SkipImage as e:  # ``transient``: not a refusal of its bytes (read again)
        return _row(row, "skipped", str(e)) | {"transient": isinstance(e, Unreadable)}
    bucket = nearest_bucket(rgb.width, rgb.height, spec.buckets)
    crop_seed = int(row["key"][:8], 16) ^ spec.seed
    (rw, rh), (top, left) = fit_to_bucket(rgb.width, rgb.height, bucket, spec.crop, crop_seed)
    box = (left, top, left + bucket[0], top + bucket[1])
    pixels = _cropped(rgb, (rw, rh), box, Image.Resampling.LANCZOS)
    box_filter = Image.Resampling.BOX  # an average: a mask keeps its [0, 1] range
    alpha = None if alpha is None else _cropped(alpha, (rw, rh), box, box_filter)
    cells = None if mask == "" or source is None else _cropped(source, (rw, rh), box, box_filter)
    return {
        **_row(row),
        "pixels": pixels.tobytes(),
        "mask": b"" if cells is None else cells.tobytes(),
        "alpha": alpha is not None and bool((alpha < 255).any()),
        "width": bucket[0],
        "height": bucket[1],
        "original_size": [rgb.height, rgb.width],
        "crop_top_left": [top, left],
        "flip_crop_top_left": [top, rw - left - bucket[0]],
    }


def _wanted(probed: dict, source, known: Known) -> tuple[str, str]:
    """The keys of the flipped latent and of the mask the image's source asks for ("": none;
    an alpha mask of an image not cached yet is known once it is decoded)."""
    key = probed["key"]
    flip = flip_key(key) if source.flip == "random" else ""
    if source.mask == "file" and probed["mask_sha"]:
        return flip, mask_key(key, probed["mask_sha"])
    if source.mask == "alpha" and key in known.alpha:
        return flip, mask_key(key, ALPHA)
    return flip, ""


def _stream_row(row: dict, sources, spec: DecodeSpec, known: Known, taken: set) -> dict:
    """Probe one listed file and, when something of it is not cached (its latent, its flipped
    latent, its mask), decode it (from the same read when its content is new). A file a
    dataset holds rejected, unchanged (``job._listing``), is not hashed again, and not decoded
    again where the decode refused it under the same settings: its refusal is repeated."""
    rejected = row.get("known_rejected", False)  # its key trusted too (``job._listing``)
    trusted = bool(row["known_key"]) and (rejected or row["known_key"] in known.keys)
    probed, data = probe_and_read(row, sources, keep=not trusted)
    out = probed | _row(probed) | {"status": PROBED, "reason": probed["reason"], "failure": ""}
    out |= {"caption_key": caption_key(probed["caption"]), "flip_key": "", "mask_key": ""}
    out |= {"original_size": [], "crop_top_left": [], "flip_crop_top_left": []}
    want = {"want_latent": False, "want_flip": False, "want_mask": False}
    key, source = probed["key"], sources[row["source"]]
    if probed["reason"] or key in taken:
        return out | want
    flip, mask = _wanted(probed, source, known)
    out |= {"flip_key": flip, "mask_key": mask, "alpha": key in known.alpha}
    cached = key in known.keys
    want["want_flip"] = bool(flip) and flip not in known.keys
    want["want_mask"] = bool(mask) and mask not in known.keys
    if cached and not any(want.values()):
        return out | want
    settings = refusal_settings(spec, source, False, mask)
    failed = {"status": FAILED, "settings": settings}
    if rejected and row["known_failure"] and row["known_settings"] == settings:
        return out | want | failed | {"failure": row["known_failure"]}  # unchanged: unread
    # the mask to cut beside the pixels: its mask file's, or (known once decoded) its alpha's
    kind = {"file": "file" if mask else "", "alpha": "alpha"}.get(source.mask, "")
    decoded = decode_row(probed, spec, data, kind)
    if decoded["status"] != "ok":
        failed["settings"] = "" if decoded["transient"] else settings
        return out | want | failed | {"failure": decoded["reason"]}
    taken.add(key)
    if not cached and source.mask == "alpha" and decoded["alpha"]:
        out["mask_key"], want["want_mask"] = mask_key(key, ALPHA), True
    # a mask is made at its latent's size: the latent is encoded again beside a new mask
    want["want_latent"] = not cached or want["want_mask"]
    cells = decoded["mask"] if want["want_mask"] else b""
    encode = {"status": ENCODE, "pixels": decoded["pixels"], "mask": cells}
    return out | want | encode | {k: decoded[k] for k in DECODED}


def _trusted_samples(row: dict, source, known: Known) -> list[str]:
    """The sample keys of a listed clip the committed index holds unchanged under its source's
    frame settings (``job._known_clip``) when each of them (and its flipped latent, where its
    source flips) is cached: the clip need not be read. None otherwise ([])."""
    if not row.get("known_samples"):
        return []
    keys = clip_rows.sample_keys(row["known_key"], row["known_samples"])
    flips = [flip_key(k) for k in keys] if source.flip == "random" else []
    return keys if all(k in known.keys for k in keys + flips) else []


def _clip_rows(row: dict, sources, spec: DecodeSpec, known: Known, taken: set):
    """A listed clip's stream rows: one per sample (decoded where its key is not cached), or
    one row with its report category when it gives none. Read and probed (its sample count is
    the clip's) unless the committed index holds it unchanged with every sample cached
    (``_trusted_samples``: its rows are the index's, its caption read again), or a dataset
    holds it rejected, unchanged (its key trusted; refused by the decode under the same
    settings: that row again, unread); decoded only for a sample the cache lacks."""
    source = sources[row["source"]]
    trusted = _trusted_samples(row, source, known)
    if trusted:  # probed without reading the clip: its content hash is the samples'
        row = row | {"known_key": clips.content_of(trusted[0])}
    rejected = bool(row.get("known_rejected")) and bool(row["known_key"])  # its key trusted
    probed, data = probe_and_read(row, sources, keep=not (trusted or rejected))
    out = probed | _row(probed) | {"status": PROBED, "reason": probed["reason"], "failure": ""}
    out |= {"caption_key": caption_key(probed["caption"]), "flip_key": "", "mask_key": ""}
    out |= {"original_size": [], "crop_top_left": [], "flip_crop_top_left": []}
    out |= {"want_latent": False, "want_flip": False, "want_mask": False}
    if probed["reason"]:
        yield out | {"clip": clips.SKIPPED}
        return
    if not spec.frame_multiple:
        reason = "a video clip: the model family trains images only"
        yield out | {"clip": clips.NOT_TRAINED, "reason": reason}
        return
    if trusted:
        n = clip_rows.frames_of(trusted[0])
        yield from (_clip_sample(out | {"frames": n}, k, source, known, taken) for k in trusted)
        return
    settings = refusal_settings(spec, source, True)
    failed = {"status": FAILED, "settings": settings}
    if rejected and row["known_failure"] and row["known_settings"] == settings:
        yield out | failed | {"clip": row["known_clip"], "failure": row["known_failure"]}
        return  # refused before under the same settings, unchanged since: not read again
    content = probed["key"]
    limits = {"max_pixels": spec.image.max_pixels}
    counts = list(source.frames)
    try:
        data = _read(probed, spec, probed["path"], "") if data is None else data
        _, n, samples = clips.samples_of(data, counts, source.frame_selection, source.fps, limits)
        keys = [
            clips.sample_key(content, n, source.frame_selection, source.fps, i)
            for i in range(len(samples))
        ]
        rows = [_clip_sample(out | {"frames": n}, k, source, known, taken) for k in keys]
        todo = [i for i, r in enumerate(rows) if r["status"] == ENCODE]
        decoded = clips.decode_samples(data, [samples[i] for i in todo])
        for r in rows:
            if r["status"] == ENCODE:
                seed = int(content[:8], 16) ^ spec.seed
                r |= clips.fit_clip(next(decoded), spec.buckets, spec.crop, seed)
            yield r
    except Unreadable as e:  # its key trusted, then not read: as the probe says it
        yield out | {"clip": clips.SKIPPED, "reason": str(e)}
    except video.ClipError as e:
        yield out | failed | {"clip": e.category, "failure": f"{e.category}: {e}"}


def _clip_sample(out: dict, key: str, source, known: Known, taken: set) -> dict:
    """A sample's row before its frames are decoded: ENCODE where its latent (or its flipped
    latent) is not cached, PROBED otherwise."""
    flip = flip_key(key) if source.flip == "random" else ""
    row = out | {"key": key, "clip": clips.TRAINED, "flip_key": flip}
    want_latent = key not in known.keys and key not in taken
    want_flip = bool(flip) and flip not in known.keys and key not in taken
    taken.add(key)
    if not (want_latent or want_flip):
        return row
    return row | {"status": ENCODE, "want_latent": want_latent, "want_flip": want_flip}


def probe_decode(
    batch: pa.Table, sources, spec: DecodeSpec, known: Known, progress=None
) -> pa.Table:
    """``probe_decode_blocks`` as one table (the bench's bare loop, tests)."""
    tables = list(probe_decode_blocks(batch, sources, spec, known, progress))
    return pa.concat_tables(tables) if tables else STREAM_SCHEMA.empty_table()


def probe_decode_blocks(batch: pa.Table, sources, spec: DecodeSpec, known: Known, progress=None):
    """The stream's first step (Ray Data tasks): a batch of listed files -> stream rows (the
    images' as one table, then the clip samples' in tables of at most ``clips.BLOCK_BYTES`` of
    pixels, or one sample where it is more: a task holds that and one sample being decoded;
    a table a sample made the encoder pay a call's overhead per clip); ``progress``: the
    counting actor told what the batch's files came to, and how long the step took
    (``progress.timed``)."""
    start = clock()
    taken: set[str] = set()  # a file whose content another row of this batch already decodes
    listed = batch.to_pylist()
    rows = [_stream_row(r, sources, spec, known, taken) for r in listed if not is_clip(r)]
    counts = read_counts(rows)
    if rows:
        yield pa.Table.from_pylist(rows, schema=STREAM_SCHEMA)
    held, size = [], 0  # clip samples not handed on yet, and their pixels' bytes
    for r in (r for r in listed if is_clip(r)):
        done = []
        for sample in _clip_rows(r, sources, spec, known, taken):
            done.append({k: v for k, v in sample.items() if k != "pixels"})
            if held and size + len(sample["pixels"]) > clips.BLOCK_BYTES:
                yield pa.Table.from_pylist(held, schema=STREAM_SCHEMA)
                held, size = [], 0
            held.append(sample)
            size += len(sample["pixels"])
        more = read_counts(done, clip=True)
        counts = {k: counts[k] + more[k] for k in counts}
    if held:
        yield pa.Table.from_pylist(held, schema=STREAM_SCHEMA)
    if progress is not None:  # counted, not waited for
        progress.add.remote(counts)
    timed(progress, "decode", start)


def is_clip(row: dict) -> bool:
    return clips.is_clip(row["path"])


def read_counts(rows: list[dict], clip: bool = False) -> dict[str, int]:
    """What probed stream rows came to, as the progress line counts them: the files read,
    cached and skipped, the images and clip samples to encode. ``rows``: an image file's
    row each, or (``clip``) one clip's rows, a sample each: one file, skipped where a row
    is, cached where no sample is to encode."""
    skipped = sum(1 for r in rows if r["reason"] or r["status"] == FAILED)
    encode = sum(1 for r in rows if r["status"] == ENCODE)
    if clip:
        counts = {READ: 1, SKIPPED: min(skipped, 1), CACHED: int(not skipped and not encode)}
        return counts | {TO_ENCODE: encode, SAMPLES: encode}
    cached = len(rows) - skipped - encode
    return {READ: len(rows), CACHED: cached, SKIPPED: skipped, TO_ENCODE: encode, SAMPLES: 0}
