"""The encoder actor of the preprocess stream (a Ray Data ``map_batches`` actor pool): the VAE
over the decoded images of a batch and the text encoders over the captions of that batch that
no one has encoded yet. Each actor loads each model once, on a thread: from its start when the
run has images to encode (``preload``), else on first use, so a run with nothing new loads
nothing and a run with only new captions loads only the text encoders.

Rows in, the same rows out without their pixels; what was encoded is appended as rows of its
own, each cell with its checksum (``<tensor>_xxh3``, made with its bytes): a ``LATENT`` row per
latent (an image's, keyed by its content hash, and its mirror image's, ``cache.flip_key``), a
``MASK`` row per loss mask (the mask's pixels averaged over each latent pixel: [1, h, w] at the
latent's h x w, ``cache.mask_key``), and a ``TEXT`` row for each newly seen caption. The sink
(``preprocess/sink.py``) writes each kind into the cache's files.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from raytuner.data.cache import caption_key, checksum_column
from raytuner.data.tensors import to_cells
from raytuner.families import parts
from raytuner.preprocess.decode import ENCODE, FAILED, LATENT, MASK, SHAPE, TEXT
from raytuner.preprocess.progress import ENCODED, READY

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


def _cell_fields(name: str, shape: bool = True) -> list[tuple[str, pa.DataType]]:
    fields = [(name, pa.binary())] + [(f"{name}_shape", SHAPE)] * shape
    return fields + [(checksum_column(name), pa.uint64())]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Encoder:
    """``Encoder(family, model, dtype, store_std, known, progress, preload)(batch) -> batch``.

    ``family``: the job's Family; ``model``: its ModelConfig; ``dtype``: the cache's storage
    dtype; ``known``: the caption keys the cache holds already (never encoded again);
    ``progress``: a counting actor told how many images each batch encoded and when the image
    encoder is loaded (``preprocess/progress.py``); ``preload``: start
    loading both encoders now, on a thread, while the first blocks are still being decoded."""

    def __init__(
        self, family, model, dtype: str, store_std: bool, known=(), progress=None, preload=False
    ):
        self.model, self.dtype, self.store_std, self.progress = model, dtype, store_std, progress
        self.family = family
        self.seen = set(known)  # caption keys encoded by the cache or by this actor
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="raytuner-encoder-load")
        self._loading: dict[str, Future] = {}
        if preload:
            self._start("image"), self._start("text")

    def _start(self, part: str) -> Future:
        """The encoder ``part`` ("image" or "text"), loading or loaded."""
        if part not in self._loading:
            make = self.family.image_encoder if part == "image" else self.family.text_encoder
            source = parts.model_source(self.model, _device())
            self._loading[part] = self._loader.submit(make, source, _device())
            if part == "image" and self.progress is not None:  # the progress line's "loading"
                self._loading[part].add_done_callback(
                    lambda _: self.progress.add.remote({READY: 1})
                )
        return self._loading[part]

    def __call__(self, batch: pa.Table) -> pa.Table:
        made = self.encode_images(batch)
        text = self.encode_captions(batch)
        tables = [batch.drop_columns(["pixels", "mask"]), *made, *([text] if text else [])]
        return pa.concat_tables(tables, promote_options="default")

    def encode_images(self, batch: pa.Table) -> list[pa.Table]:
        """The LATENT and MASK rows of the batch's ENCODE rows (none without any): one VAE
        forward per bucket for its latents, one for its mirror images' (``want_flip``)."""
        rows = batch.filter(pc.equal(batch.column("status"), ENCODE)).to_pylist()
        if not rows:
            return []
        encode = self._start("image").result()
        latents, masks = [], []
        for w, h in sorted({(r["width"], r["height"]) for r in rows}):  # a batch mixes buckets
            group = [r for r in rows if (r["width"], r["height"]) == (w, h)]
            x = torch.from_numpy(
                np.stack([np.frombuffer(r["pixels"], np.uint8).reshape(h, w, 3) for r in group])
            )
            x = x.permute(0, 3, 1, 2).float() / 127.5 - 1.0
            mine = [i for i, r in enumerate(group) if r["want_latent"]]
            flips = [i for i, r in enumerate(group) if r["want_flip"]]
            if mine:
                mean, std = encode(x[mine])
                latents += self._latent_rows([group[i] for i in mine], mean, std, flip=False)
                masks += self._mask_rows([group[i] for i in mine], mean.shape[-2:])
            if flips:  # the mirror image: the crop's corner as seen in it
                mean, std = encode(torch.flip(x[flips], dims=[3]))
                latents += self._latent_rows([group[i] for i in flips], mean, std, flip=True)
        if self.progress is not None:  # counted, not waited for
            self.progress.add.remote({ENCODED: len(rows)})
        fields = [*ROW_FIELDS, ("alpha", pa.bool_()), *_cell_fields("latent")]
        fields += _cell_fields("latent_std", shape=False) * self.store_std
        out = [pa.Table.from_pylist(latents, schema=pa.schema(fields))]
        masked = pa.schema([*ROW_FIELDS, *_cell_fields(MASK)])
        return out + ([pa.Table.from_pylist(masks, schema=masked)] if masks else [])

    def _latent_rows(self, rows: list[dict], mean, std, flip: bool) -> list[dict]:
        """A LATENT row per stream row: its latent (``mean``) and, with ``store_std``, its std."""
        cells = {"latent": to_cells(mean, self.dtype)}
        if self.store_std:
            cells["latent_std"] = to_cells(std, self.dtype)
        out = []
        for j, r in enumerate(rows):
            row = {name: r[name] for name, _ in ROW_FIELDS} | {"status": LATENT}
            row["key"] = r["flip_key"] if flip else r["key"]
            row["crop_top_left"] = r["flip_crop_top_left" if flip else "crop_top_left"]
            row["alpha"] = r["alpha"] and not flip
            row["latent_shape"] = cells["latent"][1][j].tolist()
            for name, (data, _, sums) in cells.items():
                row |= {name: data[j], checksum_column(name): sums[j]}
            out.append(row)
        return out

    def _mask_rows(self, rows: list[dict], size) -> list[dict]:
        """A MASK row per stream row that wants one: its mask's pixels (bucket-sized, 0-255)
        averaged over each latent pixel (``size``: the latent's h x w), as loss weights."""
        mine = [r for r in rows if r["want_mask"]]
        if not mine:
            return []
        h, w = mine[0]["height"], mine[0]["width"]
        pixels = np.stack([np.frombuffer(r["mask"], np.uint8).reshape(1, h, w) for r in mine])
        weights = torch.nn.functional.interpolate(
            torch.from_numpy(pixels).float() / 255.0, size=tuple(size), mode="area"
        )
        data, shapes, sums = to_cells(weights, self.dtype)
        return [
            {name: r[name] for name, _ in ROW_FIELDS}
            | {"status": MASK, "key": r["mask_key"]}
            | {MASK: data[j], f"{MASK}_shape": shapes[j].tolist(), checksum_column(MASK): sums[j]}
            for j, r in enumerate(mine)
        ]

    def encode_captions(self, batch: pa.Table) -> pa.Table | None:
        """TEXT rows for the captions of this batch's usable rows (and the empty caption, for
        caption dropout) that neither the cache nor this actor has encoded; None if none."""
        usable = pc.and_(
            pc.equal(batch.column("reason"), ""), pc.not_equal(batch["status"], FAILED)
        )
        rows = batch.filter(usable).select(["caption_key", "caption"]).to_pylist()
        new = {r["caption_key"]: r["caption"] for r in rows if r["caption_key"] not in self.seen}
        if caption_key("") not in self.seen:
            new[caption_key("")] = ""
        if not new:
            return None
        encode = self._start("text").result()
        keys, captions = list(new), list(new.values())
        columns = {
            "caption_key": pa.array(keys, pa.string()),
            "caption": pa.array(captions, pa.string()),
            "truncated": pa.array(encode.truncated(captions), pa.bool_()),
            "status": pa.array([TEXT] * len(keys), pa.string()),
        }
        for name, tensor in encode(captions).items():
            cells, cell_shapes, cell_sums = to_cells(tensor, self.dtype)
            columns[name] = pa.array(cells, pa.binary())
            columns[f"{name}_shape"] = pa.array(cell_shapes.tolist(), SHAPE)
            columns[checksum_column(name)] = pa.array(cell_sums, pa.uint64())
        self.seen.update(keys)
        return pa.table(columns)
