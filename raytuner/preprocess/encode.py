"""The encoder actor of the preprocess stream (a Ray Data ``map_batches`` actor pool): the VAE
over the decoded images of a block and the text encoders over the captions of that block that
no one has encoded yet. Each actor loads each model once, on a thread: from its start when the
run has images to encode (``preload``), else on first use, so a run with nothing new loads
nothing and a run with only new captions loads only the text encoders.

The actor takes a whole stream block per call and runs its encoders on batches of
``preprocess.batch_size`` (the images of one bucket together). Rows in, their probe columns out,
then what was encoded as rows of its own, each cell with its checksum (``<tensor>_xxh3``, made
with its bytes): a ``LATENT`` row per latent (an image's, keyed by its content hash, and its
mirror image's, ``keys.flip_key``), a ``MASK`` row per loss mask (the mask's pixels averaged
over each latent pixel: [1, h, w] at the latent's h x w, ``keys.mask_key``), and a ``TEXT``
row for each newly seen caption. The block goes back as one table of one piece per column:
Ray ships a table piece by piece, and a table of many small pieces cost more to send to the
sink (``preprocess/sink.py``, which writes each kind into the cache's files) than to encode.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from raytuner import quantizers
from raytuner.data.cache import checksum_column
from raytuner.data.keys import caption_key
from raytuner.data.tensors import cell_column, ragged_cell_column
from raytuner.families import parts, text
from raytuner.preprocess.progress import ENCODED, READY, clock, since
from raytuner.preprocess.stream_rows import (
    ENCODE,
    FAILED,
    LATENT,
    MASK,
    PROBE_COLUMNS,
    SHAPE,
    TEXT,
)

# the rows the encoder appends: the columns they share with the stream's rows, then their cells
ROW_FIELDS = [
    ("key", pa.string()),
    ("status", pa.string()),
    ("path", pa.string()),
    ("width", pa.int32()),
    ("height", pa.int32()),
    ("original_size", SHAPE),
    ("crop_top_left", SHAPE),
]


log = logging.getLogger("raytuner")
GPU_SHARE = 0.85  # of each GPU's memory a split text encoder's weights may take (activations)

def _built(make, source, device: str):
    """``make(source, device)``; an encoder that asks for a quantization backend this process
    does without (``quantizers.go_without``) fails saying so, not that it is missing."""
    try:
        return make(source, device)
    except (ImportError, ValueError, RuntimeError) as e:
        if backend := quantizers.gone_without(e):
            raise RuntimeError(quantizers.refusal(source.pretrained, "encoders", backend)) from e
        raise


def _built_text(make, source, spread: tuple[bool, int]):
    """The text encoder as ``_built`` makes it; on GPUs with ``spread`` = (offload, GPUs of
    the actor) asking for it, built on the host and placed over the actor's GPUs: whole where
    it fits one, its layers split over them, or streamed from host memory
    (``text.place``)."""
    offload, gpus = spread
    if _device() != "cuda" or not (offload or gpus > 1):
        return _built(make, source, _device())
    encoder = _built(make, source, "cpu")
    count = torch.cuda.device_count()
    devices = [f"cuda:{i}" for i in range(count)]
    memory = min(torch.cuda.get_device_properties(i).total_memory for i in range(count))
    layouts = text.place(encoder, offload, devices, int(memory * GPU_SHARE))
    log.info("text encoder: %s", "; ".join(how.describe() for how in layouts))
    return encoder


def _cell_fields(name: str, shape: bool = True) -> list[tuple[str, pa.DataType]]:
    fields = [(name, pa.binary())] + [(f"{name}_shape", SHAPE)] * shape
    return fields + [(checksum_column(name), pa.uint64())]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _flags(table: pa.Table, column: str) -> np.ndarray:
    return table.column(column).to_numpy(zero_copy_only=False)


def _pixels(column: pa.ChunkedArray, shape: tuple[int, ...]) -> np.ndarray:
    """The rows of a binary column of same-sized cells as one uint8 array [rows, *shape],
    read in place (no per-row copy)."""
    cells = column.combine_chunks()
    offsets = np.frombuffer(cells.buffers()[1], np.int32)[cells.offset :][: len(cells) + 1]
    size = int(np.prod(shape))
    if not (np.diff(offsets) == size).all():
        raise ValueError(f"pixel cells of another size than {shape} in one bucket")
    data = np.frombuffer(cells.buffers()[2], np.uint8)[offsets[0] : offsets[-1]]
    return data.reshape(len(cells), *shape)


def _scaled(pixels: np.ndarray) -> torch.Tensor:
    """uint8 images [B, H, W, 3] -> [B, 3, H, W] in [-1, 1]; clip samples [B, F, H, W, 3] ->
    [B, 3, F, H, W] (the VAE's layout of a clip: the mirror of a clip mirrors every frame)."""
    x = torch.from_numpy(pixels.astype(np.float32)) / 127.5 - 1.0
    return x.permute(0, 3, 1, 2) if x.ndim == 4 else x.permute(0, 4, 1, 2, 3)


def _rows_of(kind: str, rows: pa.Table, keys: str, corner: str) -> dict[str, pa.Array]:
    """The ``ROW_FIELDS`` of the rows a ``kind`` row is made of (its key from ``keys``, its
    crop's corner from ``corner``)."""
    n = rows.num_rows
    columns = {name: rows.column(name) for name, _ in ROW_FIELDS}
    columns |= {"key": rows.column(keys), "crop_top_left": rows.column(corner)}
    return columns | {"status": pa.array([kind] * n, pa.string())}


class Encoder:
    """``Encoder(family, model, dtype, store_std, known, progress, preload, batch_size)(block)
    -> block``.

    ``family``: the job's Family; ``model``: its ModelConfig; ``dtype``: the cache's storage
    dtype; ``known``: the caption keys the cache holds already (never encoded again);
    ``progress``: a counting actor told how many images each encoder batch encoded, when the
    image encoder is loaded and how long each block took (``preprocess/progress.py``);
    ``preload``: start loading both encoders now, on a thread, while the
    first blocks are still being decoded; ``batch_size``: images (captions) per encoder call;
    ``own_process``: the actor has its process to itself (a Ray actor's), which then does
    without diffusers' quantization backends (``quantizers.go_without``); ``text_dtype``: the
    text tensors' storage dtype (None: ``dtype``); ``spread``: (offload, GPUs) the text
    encoder is placed with (``preprocess.text_encoder_offload``, ``gpus_per_actor``);
    ``text_sources``: the sources whose captions it leaves alone (a paired source's, for a
    family whose text encoder sees the references: ``preprocess/pair_text.py``)."""

    def __init__(
        self,
        family,
        model,
        dtype: str,
        store_std: bool,
        known=(),
        progress=None,
        preload=False,
        batch_size: int = 8,
        own_process: bool = False,
        text_dtype: str | None = None,
        spread: tuple[bool, int] = (False, 1),
        text_sources: frozenset[int] = frozenset(),
    ):
        self.model, self.dtype, self.store_std, self.progress = model, dtype, store_std, progress
        self.text_dtype, self.spread = text_dtype or dtype, spread
        self.family, self.batch_size, self.text_sources = family, batch_size, text_sources
        self.seen = set(known)  # caption keys encoded by the cache or by this actor
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="raytuner-encoder-load")
        self._loading: dict[str, Future] = {}
        self._waited = 0.0  # seconds this call waited for a model to load
        fields = [*ROW_FIELDS, ("alpha", pa.bool_()), *_cell_fields("latent")]
        fields += _cell_fields("latent_std", shape=False) * store_std
        self.latent_schema = pa.schema(fields)
        self.mask_schema = pa.schema([*ROW_FIELDS, *_cell_fields(MASK)])
        if own_process:
            quantizers.go_without()
        if preload:
            self._start("image"), self._start("text")

    def _start(self, part: str) -> Future:
        """The encoder ``part`` ("image" or "text"), loading or loaded."""
        if part not in self._loading:
            make = self.family.image_encoder if part == "image" else self.family.text_encoder
            source = parts.model_source(self.model, _device())
            if part == "text":
                future = self._loader.submit(_built_text, make, source, self.spread)
            else:
                future = self._loader.submit(_built, make, source, _device())
            self._loading[part] = future
            if part == "image" and self.progress is not None:  # the progress line's "loading"
                self._loading[part].add_done_callback(
                    lambda _: self.progress.add.remote({READY: 1})
                )
        return self._loading[part]

    def _ready(self, part: str):
        """The encoder ``part``, waited for while it still loads (the wait is the block's
        ``load`` stage, not its ``encode``)."""
        future = self._start(part)
        if not future.done():
            start = time.perf_counter()
            future.result()
            self._waited += time.perf_counter() - start
        return future.result()

    def __call__(self, block: pa.Table) -> pa.Table:
        start, self._waited = clock(), 0.0
        made = [*self.encode_images(block), *self.encode_captions(block)]
        tables = [block.select(PROBE_COLUMNS), *made]
        out = pa.concat_tables(tables, promote_options="default").combine_chunks()
        if self.progress is not None:  # the stages' times, not waited for
            took = since(start)
            took["seconds"] -= self._waited
            self.progress.timed.remote("encode", took)
            if self._waited:
                self.progress.timed.remote("load", {"seconds": self._waited, "cpu_seconds": 0.0})
        return out

    def _batches(self, block: pa.Table):
        """The ENCODE rows of ``block`` as (bucket, rows) in batches of ``batch_size``, the
        images (clip samples) of one bucket (width, height, frames; 0: an image) together."""
        todo = np.flatnonzero(_flags(block, "status") == ENCODE)
        width, height = _flags(block, "width")[todo], _flags(block, "height")[todo]
        frames = _flags(block, "frames")[todo]
        sizes = zip(width.tolist(), height.tolist(), frames.tolist(), strict=True)
        for w, h, f in sorted(set(sizes)):
            rows = todo[(width == w) & (height == h) & (frames == f)]
            for i in range(0, len(rows), self.batch_size):
                yield (w, h, f), block.take(rows[i : i + self.batch_size])

    def encode_images(self, block: pa.Table) -> list[pa.Table]:
        """The LATENT and MASK rows of the block's ENCODE rows (none without any): per batch,
        one VAE forward for its latents, one for its mirror images' (``want_flip``)."""
        out = []
        for (w, h, f), rows in self._batches(block):
            encode = self._ready("image")
            x = _scaled(_pixels(rows.column("pixels"), (f, h, w, 3) if f else (h, w, 3)))
            mine = np.flatnonzero(_flags(rows, "want_latent"))
            flips = np.flatnonzero(_flags(rows, "want_flip"))
            if len(mine):
                mean, std = encode(x[torch.from_numpy(mine)])
                out.append(self._latents(rows.take(mine), mean, std, flip=False))
                masked = mine[_flags(rows, "want_mask")[mine]]
                if len(masked):
                    out.append(self._masks(rows.take(masked), mean.shape[-2:]))
            if len(flips):  # the mirror image: the crop's corner as seen in it
                mean, std = encode(torch.flip(x[torch.from_numpy(flips)], dims=[-1]))
                out.append(self._latents(rows.take(flips), mean, std, flip=True))
            if self.progress is not None:  # counted, not waited for
                self.progress.add.remote({ENCODED: rows.num_rows})
        return out

    def _latents(self, rows: pa.Table, mean, std, flip: bool) -> pa.Table:
        """A LATENT row per stream row: its latent (``mean``) and, with ``store_std``, its std."""
        keys, corner = ("flip_key", "flip_crop_top_left") if flip else ("key", "crop_top_left")
        columns = _rows_of(LATENT, rows, keys, corner)
        columns["alpha"] = pa.array([False] * rows.num_rows) if flip else rows.column("alpha")
        for name, tensor in [("latent", mean)] + [("latent_std", std)] * self.store_std:
            cells, shape, sums = cell_column(tensor, self.dtype)
            columns[name], columns[checksum_column(name)] = cells, sums
            if name == "latent":
                columns["latent_shape"] = pa.array([shape] * len(cells), SHAPE)
        return pa.table(columns, schema=self.latent_schema)

    def _masks(self, rows: pa.Table, size) -> pa.Table:
        """A MASK row per stream row: its mask's pixels (bucket-sized, 0-255) averaged over
        each latent pixel (``size``: the latent's h x w), as loss weights."""
        h, w = rows.column("height")[0].as_py(), rows.column("width")[0].as_py()
        pixels = _pixels(rows.column("mask"), (1, h, w)).astype(np.float32)
        weights = torch.nn.functional.interpolate(
            torch.from_numpy(pixels) / 255.0, size=tuple(size), mode="area"
        )
        columns = _rows_of(MASK, rows, "mask_key", "crop_top_left")
        cells, shape, sums = cell_column(weights, self.dtype)
        columns |= {MASK: cells, f"{MASK}_shape": pa.array([shape] * len(cells), SHAPE)}
        columns[checksum_column(MASK)] = sums
        return pa.table(columns, schema=self.mask_schema)

    def encode_captions(self, block: pa.Table) -> list[pa.Table]:
        """TEXT rows for the captions of this block's usable rows (and the empty caption, for
        caption dropout) that neither the cache nor this actor has encoded, in batches of
        ``batch_size`` captions."""
        usable = pc.and_(
            pc.equal(block.column("reason"), ""), pc.not_equal(block.column("status"), FAILED)
        )
        if self.text_sources:  # their captions are encoded with their references
            paired = pc.is_in(block.column("source"), pa.array(sorted(self.text_sources)))
            usable = pc.and_(usable, pc.invert(paired))
        rows = block.filter(usable).select(["caption_key", "caption"]).to_pydict()
        new = {}
        for key, caption in zip(rows["caption_key"], rows["caption"], strict=True):
            if key not in self.seen:
                new[key] = caption
        if caption_key("") not in self.seen:
            new[caption_key("")] = ""
        if not new:
            return []
        encode = self._ready("text")
        keys = list(new)
        out = []
        for i in range(0, len(keys), self.batch_size):
            out.append(self._text(encode, keys[i : i + self.batch_size], new))
        self.seen.update(keys)
        return out

    def _text(self, encode, keys: list[str], captions: dict[str, str], references=None):
        """The TEXT rows of the captions of ``keys`` (a table); ``references``: each one's
        reference images, for a text encoder that sees them (``References.text``)."""
        texts = [captions[k] for k in keys]
        columns = {
            "caption_key": pa.array(keys, pa.string()),
            "caption": pa.array(texts, pa.string()),
            "truncated": pa.array(encode.truncated(texts), pa.bool_()),
            "status": pa.array([TEXT] * len(keys), pa.string()),
        }
        ragged = getattr(encode, "ragged", ())
        made = encode(texts) if references is None else encode(texts, references=references)
        for name, tensor in made.items():
            if name in ragged:  # each caption's tokens alone, without the zero rows after them
                cells, shapes, sums = ragged_cell_column(tensor, self.text_dtype)
            else:
                cells, shape, sums = cell_column(tensor, self.text_dtype)
                shapes = [shape] * len(cells)
            columns[name] = cells
            columns[f"{name}_shape"] = pa.array(shapes, SHAPE)
            columns[checksum_column(name)] = sums
        return pa.table(columns)
