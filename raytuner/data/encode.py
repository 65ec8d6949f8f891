"""Encoder actors for Ray Data ``map_batches``: the VAE over bucketed pixels, the text encoders
over distinct captions. Each actor loads its model once and keeps it."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from raytuner.data.tensors import to_cells
from raytuner.families import get_family, parts

SHAPE = pa.list_(pa.int32())
# Latent rows as written to Parquet: plain Arrow types, readable without Ray.
LATENT_SCHEMA = {
    "key": pa.string(),
    "path": pa.string(),
    "status": pa.string(),
    "reason": pa.string(),
    "width": pa.int32(),
    "height": pa.int32(),
    "original_size": SHAPE,
    "crop_top_left": SHAPE,
    "latent": pa.binary(),
    "latent_shape": SHAPE,
}


def _column(values, kind: pa.DataType) -> pa.Array:
    if pa.types.is_list(kind):
        return pa.array([[int(x) for x in v] for v in values], kind)
    if pa.types.is_binary(kind):
        return pa.array([bytes(v) for v in values], kind)
    return pa.array(np.asarray(values).tolist(), kind)


def to_table(columns: dict, schema: dict[str, pa.DataType]) -> pa.Table:
    return pa.table({name: _column(columns[name], kind) for name, kind in schema.items()})


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class LatentEncoder:
    """Adds ``latent`` / ``latent_shape`` to every ok row and drops the pixels."""

    def __init__(self, model, dtype: str, store_std: bool, progress=None):
        """``model``: the job's ModelConfig; ``dtype``: the cache's storage dtype."""
        source = parts.source(model.pretrained, model.revision, model.dtype, _device())
        self.encode = get_family(model.family).image_encoder(source, _device())
        self.dtype, self.store_std, self.progress = dtype, store_std, progress
        self.schema = LATENT_SCHEMA | ({"latent_std": pa.binary()} if store_std else {})

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        n = len(batch["path"])
        latents: list[bytes] = [b""] * n
        stds: list[bytes] = [b""] * n
        shapes = np.zeros((n, 3), np.int32)
        ok = [i for i in range(n) if batch["status"][i] == "ok"]
        sizes = {(int(batch["height"][i]), int(batch["width"][i])) for i in ok}
        for h, w in sorted(sizes):  # one forward per bucket: a batch may mix buckets
            rows = [i for i in ok if (batch["height"][i], batch["width"][i]) == (h, w)]
            pixels = np.stack(
                [np.frombuffer(batch["pixels"][i], np.uint8).reshape(h, w, 3) for i in rows]
            )
            x = torch.from_numpy(pixels).permute(0, 3, 1, 2).float() / 127.5 - 1.0
            mean, std = self.encode(x)
            cells, cell_shapes = to_cells(mean, self.dtype)
            std_cells = to_cells(std, self.dtype)[0] if self.store_std else [b""] * len(rows)
            for j, i in enumerate(rows):
                latents[i], shapes[i], stds[i] = cells[j], cell_shapes[j], std_cells[j]
        if self.progress is not None:  # counted, not waited for
            self.progress.add.remote(len(ok))
        columns = {**batch, "latent": latents, "latent_shape": shapes, "latent_std": stds}
        return to_table(columns, self.schema)


class CaptionEncoder:
    """One cell + shape column per text tensor the family produces (e.g. prompt_embeds), and
    whether the tokenizer truncated the caption."""

    def __init__(self, model, dtype: str, progress=None):
        source = parts.source(model.pretrained, model.revision, model.dtype, _device())
        self.encode = get_family(model.family).text_encoder(source, _device())
        self.dtype, self.progress = dtype, progress

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        captions = [str(c) for c in batch["caption"]]
        columns: dict = {**batch, "truncated": self.encode.truncated(captions)}
        schema = {"caption_key": pa.string(), "caption": pa.string(), "truncated": pa.bool_()}
        for name, tensor in self.encode(captions).items():
            columns[name], columns[f"{name}_shape"] = to_cells(tensor, self.dtype)
            schema |= {name: pa.binary(), f"{name}_shape": SHAPE}
        if self.progress is not None:
            self.progress.add.remote(len(captions))
        return to_table(columns, schema)
