"""The encoded dataset: versioned by fingerprint, committed by a manifest written last.

Layout under ``data.cache``::

    <fingerprint>/manifest.json     what readers trust: every live file with rows and sha256
    <fingerprint>/report.json       the report of the run that committed it
    <fingerprint>/parts/<run>/latents/status=ok/*.parquet       rows keyed by image-content hash
    <fingerprint>/parts/<run>/latents/status=skipped/*.parquet  why a file could not be used
    <fingerprint>/parts/<run>/text/*.parquet                   one row per distinct caption
    <fingerprint>/parts/<run>/index.parquet                     path -> key, caption, repeats

Part files are immutable and keyed by content, so a commit is idempotent: two runs at once
each commit a complete manifest, and a run that died leaves complete files the next run reuses.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from raytuner import storage
from raytuner.config import ModelConfig, PreprocessConfig
from raytuner.data.sources import caption_key
from raytuner.data.tensors import from_cells

FORMAT_VERSION = 2
MANIFEST, REPORT = "manifest.json", "report.json"
# Preprocess keys that change the encoded bytes or which images are used; pool sizing does not.
ENCODING_KEYS = (
    "resolution",
    "bucket_step",
    "min_aspect",
    "max_aspect",
    "crop",
    "dtype",
    "seed",
    "aspect_policy",
    "min_size",
    "max_pixels",
    "background",
    "store_std",
)


def fingerprint(model: ModelConfig, pre: PreprocessConfig) -> str:
    encoding = {k: getattr(pre, k) for k in ENCODING_KEYS}
    payload = {"format": FORMAT_VERSION, "model": dataclasses.asdict(model), "encoding": encoding}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def version_dir(cache_uri: str, fp: str) -> str:
    return storage.join(storage.absolute(cache_uri), fp)


class Version:
    """One dataset version (one fingerprint) on any pyarrow filesystem."""

    def __init__(self, cache_uri: str, fp: str):
        self.fp = fp
        self.fs, self.root = storage.resolve(version_dir(cache_uri, fp))

    def path(self, rel: str) -> str:
        return storage.join(self.root, rel)

    def manifest(self) -> dict | None:
        path = self.path(MANIFEST)
        return storage.read_json(self.fs, path) if storage.exists(self.fs, path) else None

    def describe(self, rel: str) -> dict:
        """A manifest entry for a data file: rows, bytes and sha256 of its content."""
        data = storage.read_bytes(self.fs, self.path(rel))
        rows = pq.ParquetFile(pa.BufferReader(data)).metadata.num_rows
        return {
            "path": rel,
            "rows": rows,
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }

    def part_files(self, kind: str) -> list[str]:
        """Every complete Parquet file of ``kind`` (``latents`` or ``text``) under parts/.

        Files of runs that died or are still running are included once their footer is
        written (Parquet writes it last), so no half-written file is ever returned.
        """
        selector = pafs.FileSelector(self.path("parts"), recursive=True, allow_not_found=True)
        found = []
        for info in self.fs.get_file_info(selector):
            rel = info.path[len(self.root) + 1 :]
            parts = rel.split("/")
            wanted = (
                parts[2:4] == ["latents", "status=ok"]
                if kind == "latents"
                else parts[2:3] == ["text"]
            )
            if info.path.endswith(".parquet") and len(parts) > 3 and wanted:
                try:
                    pq.read_metadata(info.path, filesystem=self.fs)
                except (OSError, pa.ArrowInvalid):
                    continue  # still being written, or cut short by a kill
                found.append(rel)
        return sorted(found)

    def read(self, rel: str, columns: list[str] | None = None) -> pa.Table:
        return pq.read_table(self.path(rel), columns=columns, filesystem=self.fs)

    def commit(self, manifest: dict) -> None:
        """The report beside the manifest, then the manifest itself: last and atomic."""
        storage.write_json_atomic(self.fs, self.path(REPORT), manifest["report"])
        storage.write_json_atomic(self.fs, self.path(MANIFEST), manifest)


def read_manifest(cache_uri: str, fp: str) -> dict | None:
    return Version(cache_uri, fp).manifest()


@dataclass
class CachedDataset:
    """The committed rows of one cache version, in index order, ready to batch."""

    manifest: dict
    index: pa.Table  # source, path, key, caption, caption_key, repeats
    latents: pa.Table  # one row per key in the index
    text: dict[str, dict[str, torch.Tensor]]  # caption_key -> name -> tensor

    def __post_init__(self) -> None:
        keys = self.latents.column("key").to_pylist()
        row_of = {k: i for i, k in enumerate(keys)}
        self._rows = [row_of[k] for k in self.index.column("key").to_pylist()]
        self._captions = self.index.column("caption_key").to_pylist()

    @property
    def buckets(self) -> list[str]:
        """The bucket of every indexed row, as "WxH"."""
        w, h = self.latents.column("width").to_pylist(), self.latents.column("height").to_pylist()
        return [f"{w[r]}x{h[r]}" for r in self._rows]

    @property
    def repeats(self) -> list[int]:
        return self.index.column("repeats").to_pylist()

    def __len__(self) -> int:
        return self.index.num_rows

    def batch(self, indices: list[int], dtype=torch.float32, empty_caption=None) -> dict:
        """The rows' tensors; ``empty_caption[j]``: row j takes the empty caption's embedding
        (caption dropout) instead of its own."""
        empty = caption_key("")
        captions = [
            empty if drop else self._captions[i]
            for i, drop in zip(indices, empty_caption or [False] * len(indices), strict=True)
        ]
        take = pa.array([self._rows[i] for i in indices], pa.int64())
        rows = self.latents.take(take).to_pydict()
        cell_dtype = self.manifest["dtype"]
        out = {"latent": from_cells(rows["latent"], rows["latent_shape"], cell_dtype).to(dtype)}
        if "latent_std" in rows:
            std = from_cells(rows["latent_std"], rows["latent_shape"], cell_dtype)
            out["latent_std"] = std.to(dtype)
        for name in ("original_size", "crop_top_left"):
            out[name] = torch.tensor(rows[name], dtype=torch.long)
        out["target_size"] = torch.tensor(list(zip(rows["height"], rows["width"], strict=True)))
        for name in self.manifest["text_tensors"]:
            texts = [self.text[key][name] for key in captions]
            out[name] = torch.stack(texts).to(dtype)
        return out


def _concat(version: Version, files: list[dict]) -> pa.Table:
    return pa.concat_tables([version.read(f["path"]) for f in files], promote_options="default")


def load_cached(cache_uri: str, fp: str) -> CachedDataset:
    version = Version(cache_uri, fp)
    manifest = version.manifest()
    if manifest is None:
        raise FileNotFoundError(
            f"no committed cache at {version.root}: run `raytuner preprocess` first"
        )
    index = version.read(manifest["index"]["path"])
    if index.num_rows == 0:
        raise ValueError(
            f"the cache at {version.root} holds no usable image: every input was "
            f"skipped (see {version.path('report.json')})"
        )
    latents = _concat(version, manifest["latents"])
    latents = latents.drop_columns([c for c in ("reason", "path") if c in latents.column_names])
    keys = pa.array(sorted(set(index.column("key").to_pylist())))
    latents = latents.filter(pc.is_in(latents.column("key"), keys))
    seen: dict[str, int] = {}  # a key may be in several files (runs at once): keep the first
    for i, k in enumerate(latents.column("key").to_pylist()):
        seen.setdefault(k, i)
    latents = latents.take(pa.array(sorted(seen.values()), pa.int64()))
    text_table = _concat(version, manifest["text"]).to_pydict()
    names, dtype = manifest["text_tensors"], manifest["dtype"]
    text = {
        key: {
            n: from_cells([text_table[n][i]], [text_table[f"{n}_shape"][i]], dtype)[0]
            for n in names
        }
        for i, key in enumerate(text_table["caption_key"])
    }
    return CachedDataset(manifest=manifest, index=index, latents=latents, text=text)
