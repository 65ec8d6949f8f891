"""An edit pair's reference latents in the index (``preprocess/pairs.py`` makes the pairs).

A reference image is encoded as an image of its own: a latent row of the latents files keyed
by its content hash, like every image (a reference shared by several targets, or also a
target, is one row). A paired target's index row names its references in order: their keys,
the file, offset and checksum of each one's latent cell (its shape is the target's: a pair's
images share a bucket, ``pairs.matched``), and where each came from (its folder, path, size
and mtime: a rerun trusts an unchanged file's key as it does an image's). An index without
these columns (written before them, or of a dataset without pairs) reads as pairs of none.

The reader gives a batch ``reference_latent`` [B, K, C, h, w] (K: the most references a row
of the dataset has; a row with fewer has zeros after its own) and ``reference_count`` [B]."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

FIELDS = [
    ("reference_root", pa.string()),  # the folder its references lie in ("": none)
    ("reference_paths", pa.list_(pa.string())),
    ("reference_sizes", pa.list_(pa.int64())),
    ("reference_mtimes", pa.list_(pa.int64())),
    ("reference_keys", pa.list_(pa.string())),
    ("reference_files", pa.list_(pa.string())),
    ("reference_at", pa.list_(pa.int64())),
    ("reference_xxh3", pa.list_(pa.uint64())),
]
COLUMNS = [name for name, _ in FIELDS]
READ = ["reference_keys", "reference_files", "reference_at", "reference_xxh3"]


def index_columns(row: dict, cells: dict) -> dict:
    """The index's reference columns of a listed target ``row`` (its ``reference_keys`` and
    where they came from, ``reference_root`` ... ``reference_mtimes``); ``cells``: the located
    latent rows by key."""
    keys = list(row.get("reference_keys") or [])
    located = [cells[k] for k in keys]
    return {
        "reference_root": row.get("reference_root", "") if keys else "",
        "reference_paths": list(row.get("reference_paths") or []),
        "reference_sizes": list(row.get("reference_sizes") or []),
        "reference_mtimes": list(row.get("reference_mtimes") or []),
        "reference_keys": keys,
        "reference_files": [c["file"] for c in located],
        "reference_at": [c["latent_at"] for c in located],
        "reference_xxh3": [c["latent_xxh3"] for c in located],
    }


def latent_rows(r: dict) -> list[dict]:
    """The located latent rows of an index row's references (``Version.describe``'s form),
    each in its file; their bucket and shape are their target's."""
    out = []
    for i, key in enumerate(r.get("reference_keys") or []):
        out.append(
            {
                "key": key,
                "path": r["reference_paths"][i],
                "width": r["width"],
                "height": r["height"],
                "original_size": [r["height"], r["width"]],
                "crop_top_left": [0, 0],
                "alpha": False,
                "latent_shape": r["latent_shape"],
                "latent_at": r["reference_at"][i],
                "latent_xxh3": r["reference_xxh3"][i],
                "latent_std_at": -1,
                "latent_std_xxh3": 0,
                "file": r["reference_files"][i],
            }
        )
    return out


def listed(r: dict) -> list[tuple[tuple[str, str], tuple[int, int, str]]]:
    """An index row's reference files as the listing knows them: ((folder, path), (size,
    mtime_ns, key))."""
    paths = r.get("reference_paths") or []
    return [
        ((r["reference_root"], p), (r["reference_sizes"][i], r["reference_mtimes"][i],
                                     r["reference_keys"][i]))
        for i, p in enumerate(paths)
    ]  # fmt: skip


def files(index: list[dict]) -> set[str]:
    """The latents files an index's references lie in."""
    return {f for r in index for f in r.get("reference_files") or []}


class Referenced:
    """The reference cells of a dataset's rows (its index table's reference columns)."""

    def __init__(self, rows: pa.Table):
        present = all(c in rows.column_names for c in READ)
        self.keys = rows.column("reference_keys").to_pylist() if present else None
        if self.keys is None:
            self.most = 0
            return
        self.files = rows.column("reference_files").to_pylist()
        self.at = rows.column("reference_at").to_pylist()
        self.sums = rows.column("reference_xxh3").to_pylist()
        self.most = max((len(k) for k in self.keys), default=0)

    def cells(self, indices: list[int], shapes) -> list[tuple]:
        """The (file, offset, shape, checksum, column) cells of the rows' references, row by
        row in order."""
        if not self.most:
            return []
        return [
            (self.files[i][j], self.at[i][j], shapes[i], self.sums[i][j], "latent")
            for i in indices
            for j in range(len(self.keys[i]))
        ]

    def batch(self, indices: list[int], cells: list, latents: list, dtype, pin) -> dict:
        """``reference_latent`` [B, K, ...] (zeros after a row's own) and ``reference_count``;
        ``latents``: the rows' own latent cells (a reference has their shape)."""
        if not self.most:
            return {}
        import torch

        from raytuner.data.tensors import stacked

        counts = [len(self.keys[i]) for i in indices]
        it = iter(cells)
        rows = []
        for n, latent in zip(counts, latents, strict=True):
            mine = [next(it) for _ in range(n)]
            mine += [torch.zeros_like(latent)] * (self.most - n)
            rows.append(torch.stack(mine))
        return {
            "reference_latent": stacked(rows, dtype, pin),
            "reference_count": torch.from_numpy(np.asarray(counts, dtype=np.int64)),
        }
