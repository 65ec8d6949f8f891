"""The encoded dataset: versioned by fingerprint, committed by a manifest written last.

Layout under ``data.cache``::

    <fingerprint>/manifest.json                 what readers trust; written last, atomically
    <fingerprint>/parts/<run>/latents/status=ok/*.parquet
    <fingerprint>/parts/<run>/latents/status=skipped/*.parquet
    <fingerprint>/parts/<run>/text/*.parquet    one row per distinct caption (and "")
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from raytuner import storage
from raytuner.config import ModelConfig, PreprocessConfig
from raytuner.data.tensors import from_cells

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Preprocess keys that change the encoded bytes; pool sizing and batch size do not.
_ENCODING_KEYS = ("resolution", "bucket_step", "min_aspect", "max_aspect", "crop", "dtype", "seed")


def fingerprint(model: ModelConfig, pre: PreprocessConfig) -> str:
    encoding = {k: getattr(pre, k) for k in _ENCODING_KEYS}
    payload = {"format": FORMAT_VERSION, "model": dataclasses.asdict(model), "encoding": encoding}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def version_dir(cache_uri: str, fp: str) -> str:
    return storage.join(storage.absolute(cache_uri), fp)


def read_manifest(cache_uri: str, fp: str) -> dict | None:
    fs, path = storage.resolve(version_dir(cache_uri, fp))
    manifest = storage.join(path, MANIFEST)
    return storage.read_json(fs, manifest) if storage.exists(fs, manifest) else None


def _read_tables(fs, root: str, files: list[dict]) -> pa.Table:
    tables = [pq.read_table(storage.join(root, f["path"]), filesystem=fs) for f in files]
    return pa.concat_tables(tables)


@dataclass
class CachedDataset:
    """The committed rows of one cache version, in manifest order, ready to batch."""

    manifest: dict
    latents: pa.Table
    text: dict[str, dict[str, torch.Tensor]]  # caption_key -> name -> tensor

    @property
    def buckets(self) -> list[str]:
        """The bucket of every row, as "WxH"."""
        widths = self.latents.column("width").to_pylist()
        heights = self.latents.column("height").to_pylist()
        return [f"{w}x{h}" for w, h in zip(widths, heights, strict=True)]

    def __len__(self) -> int:
        return self.latents.num_rows

    def batch(self, indices: list[int], dtype: torch.dtype = torch.float32) -> dict:
        rows = self.latents.take(pa.array(indices, pa.int64())).to_pydict()
        cell_dtype = self.manifest["dtype"]
        out = {"latent": from_cells(rows["latent"], rows["latent_shape"], cell_dtype).to(dtype)}
        for name in ("original_size", "crop_top_left"):
            out[name] = torch.tensor(np.asarray(rows[name]), dtype=torch.long)
        out["target_size"] = torch.tensor(list(zip(rows["height"], rows["width"], strict=True)))
        names = next(iter(self.text.values())).keys()
        for name in names:
            out[name] = torch.stack([self.text[k][name] for k in rows["caption_key"]]).to(dtype)
        return out


def load_cached(cache_uri: str, fp: str) -> CachedDataset:
    manifest = read_manifest(cache_uri, fp)
    if manifest is None:
        raise FileNotFoundError(
            f"no committed cache at {version_dir(cache_uri, fp)}: run `raytuner preprocess` first"
        )
    fs, root = storage.resolve(version_dir(cache_uri, fp))
    latents = _read_tables(fs, root, manifest["latents"])
    text_table = _read_tables(fs, root, manifest["text"]).to_pydict()
    dtype = manifest["dtype"]
    text = {}
    for i, key in enumerate(text_table["caption_key"]):
        text[key] = {
            name: from_cells([text_table[name][i]], [text_table[f"{name}_shape"][i]], dtype)[0]
            for name in manifest["text_tensors"]
        }
    return CachedDataset(manifest=manifest, latents=latents, text=text)
