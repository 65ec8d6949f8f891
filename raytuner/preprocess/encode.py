"""The encoder actor of the preprocess stream (a Ray Data ``map_batches`` actor pool): the VAE
over the decoded images of a batch and the text encoders over the captions of that batch that
no one has encoded yet. Each actor loads each model once, on a thread: from its start when the
run has images to encode (``preload``), else on first use, so a run with nothing new loads
nothing and a run with only new captions loads only the text encoders.

Rows in, the same rows out with the pixels replaced by their latent (and its checksum,
``latent_xxh3``, made with its bytes); the text tensors of each newly seen caption, with
theirs, are appended as rows of their own (``status == TEXT``). The sink
(``preprocess/sink.py``) splits them into the cache's latents and text files.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from raytuner.data.cache import caption_key, checksum, checksum_column
from raytuner.data.tensors import to_cells
from raytuner.families import parts
from raytuner.preprocess.decode import ENCODE, FAILED, SHAPE, TEXT


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Encoder:
    """``Encoder(family, model, dtype, store_std, known, progress, preload)(batch) -> batch``.

    ``family``: the job's Family; ``model``: its ModelConfig; ``dtype``: the cache's storage
    dtype; ``known``: the caption keys the cache holds already (never encoded again);
    ``progress``: a counting actor told how many images each batch encoded; ``preload``: start
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
        return self._loading[part]

    def __call__(self, batch: pa.Table) -> pa.Table:
        images = self.encode_images(batch)
        text = self.encode_captions(batch)
        if text is None:
            return images
        return pa.concat_tables([images, text], promote_options="default")

    def encode_images(self, batch: pa.Table) -> pa.Table:
        """The batch without its pixels, with ``latent`` / ``latent_shape`` (and ``latent_std``)
        cells on its ENCODE rows (empty on the others); one VAE forward per bucket."""
        n, status = batch.num_rows, batch.column("status").to_pylist()
        latents, stds = [b""] * n, [b""] * n
        sums, std_sums = [checksum(b"")] * n, [checksum(b"")] * n
        shapes: list[list[int]] = [[] for _ in range(n)]
        todo = [i for i in range(n) if status[i] == ENCODE]
        encode = self._start("image").result() if todo else None
        width, height = batch.column("width").to_pylist(), batch.column("height").to_pylist()
        pixels = batch.column("pixels")
        for w, h in sorted({(width[i], height[i]) for i in todo}):  # a batch may mix buckets
            rows = [i for i in todo if (width[i], height[i]) == (w, h)]
            stack = np.stack(
                [np.frombuffer(pixels[i].as_py(), np.uint8).reshape(h, w, 3) for i in rows]
            )
            x = torch.from_numpy(stack).permute(0, 3, 1, 2).float() / 127.5 - 1.0
            mean, std = encode(x)
            cells, cell_shapes, cell_sums = to_cells(mean, self.dtype)
            if self.store_std:
                std_cells, _, std_cell_sums = to_cells(std, self.dtype)
            for j, i in enumerate(rows):
                latents[i], shapes[i], sums[i] = cells[j], cell_shapes[j].tolist(), cell_sums[j]
                if self.store_std:
                    stds[i], std_sums[i] = std_cells[j], std_cell_sums[j]
        if self.progress is not None and todo:  # counted, not waited for
            self.progress.add.remote(len(todo))
        out = batch.drop_columns(["pixels"])
        out = out.append_column("latent", pa.array(latents, pa.binary()))
        out = out.append_column("latent_shape", pa.array(shapes, SHAPE))
        out = out.append_column(checksum_column("latent"), pa.array(sums, pa.uint64()))
        if self.store_std:
            out = out.append_column("latent_std", pa.array(stds, pa.binary()))
            out = out.append_column(checksum_column("latent_std"), pa.array(std_sums, pa.uint64()))
        return out

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
