"""`raytuner cache verify` and `raytuner cache gc`: check a committed version against its
manifest (every file's sha256, every tensor cell's checksum), and delete what no manifest
references."""

from __future__ import annotations

import hashlib
import re
import time

import pyarrow as pa
import pyarrow.fs as pafs
import torch

from raytuner import storage
from raytuner.data.cache import (
    MANIFEST,
    MASK,
    Version,
    cell_bytes,
    checksum,
    checksum_column,
    column_dtype,
    committed_files,
    indexes,
    rejected_tables,
    shape_column,
    text_dtype_of,
)
from raytuner.data.cells import read_parquet
from raytuner.data.tensors import from_cell

FLOAT = torch.float32


def _tensor_problems(table: pa.Table, names: list[str], dtypes: tuple[str, str]) -> str:
    """Cells whose bytes differ from their checksum, have the wrong size or hold NaN / Inf, in
    any of these columns ("" if none): the first such cell's row and column, and how many.
    ``dtypes``: the latents' and the text tensors' storage dtypes."""
    found = []
    for name in names:
        stored = column_dtype(name, *dtypes)
        cells, shapes = table.column(name).to_pylist(), table.column(shape_column(name)).to_pylist()
        sums = (
            table.column(checksum_column(name)).to_pylist()
            if checksum_column(name) in table.column_names
            else [None] * len(cells)
        )
        for i, (cell, shape, sum_) in enumerate(zip(cells, shapes, sums, strict=True)):
            if sum_ is None:
                problem = "no checksum"
            elif checksum(cell) != sum_:
                problem = "its checksum differs from the one written with it"
            elif len(cell) != (size := cell_bytes(shape, stored)):
                problem = f"{len(cell)} bytes, shape {shape} needs {size}"
            elif not torch.isfinite(from_cell(bytearray(cell), 0, shape, stored, FLOAT)).all():
                problem = "holds NaN or Inf"
            else:
                continue
            found.append(f"row {i}, column {name}: {problem}")
    if not found:
        return ""
    more = f" (and {len(found) - 1} more cell(s))" if len(found) > 1 else ""
    return found[0] + more


def _file_problem(version: Version, entry: dict, tensors: list[str], dtypes) -> str:
    """What is wrong with a data or index file ("" if nothing): missing, unreadable, another
    row count; for a data file, its damaged cells (their checksums, sizes, values) after the
    sha256 of the whole file."""
    path = version.path(entry["path"])
    if not storage.exists(version.fs, path):
        return "missing"
    data = storage.read_buffer(version.fs, path)
    problems = []
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        problems.append("sha256 differs from the manifest")
    try:
        table = read_parquet(data)
    except (OSError, pa.ArrowInvalid) as e:
        return "; ".join([*problems, f"unreadable: {e}"])
    if table.num_rows != entry["rows"]:
        problems.append(f"{table.num_rows} rows, the manifest says {entry['rows']}")
    cells = _tensor_problems(table, [n for n in tensors if n in table.column_names], dtypes)
    return "; ".join(problems + [cells] * bool(cells))


def verify(version: Version) -> list[dict]:
    """Every file of the committed version that is missing, altered or holds bad tensors (its
    data files, and every dataset's index, captions and rejected-files tables); a damaged cell
    is named by its row and column in the file."""
    manifest = version.manifest()
    if manifest is None:
        raise FileNotFoundError(f"no committed cache at {version.root}")
    dtypes, bad = (manifest["dtype"], text_dtype_of(manifest)), []
    groups = [
        (manifest["latents"], ["latent", "latent_std", MASK]),
        (manifest["text"], manifest["text_tensors"]),
        ([entry for pair in indexes(manifest) for entry in pair], []),  # every job's
        (rejected_tables(manifest), []),
    ]
    for entries, tensors in groups:
        for entry in entries:
            if problem := _file_problem(version, entry, tensors, dtypes):
                bad.append({"path": entry["path"], "problem": problem})
    return bad


def quarantine(version: Version, bad: list[dict]) -> list[str]:
    """Rename bad data files to ``*.corrupt`` so no later run lists or reuses them."""
    moved = []
    for b in bad:
        path = version.path(b["path"])
        if storage.exists(version.fs, path):
            version.fs.move(path, path + ".corrupt")
            moved.append(b["path"])
    return moved


def _newest_ns(fs: pafs.FileSystem, folder: pafs.FileInfo) -> int:
    """The latest modification anywhere inside a folder: a run still writing looks young."""
    inside = fs.get_file_info(pafs.FileSelector(folder.path, recursive=True))
    return max([folder.mtime_ns or 0] + [i.mtime_ns or 0 for i in inside])


def _version_folder(fs: pafs.FileSystem, info: pafs.FileInfo) -> bool:
    """A raytuner cache version: named by a fingerprint, with a manifest that names it."""
    if info.type != pafs.FileType.Directory or not re.fullmatch(r"[0-9a-f]{16}", info.base_name):
        return False
    path = storage.join(info.path, MANIFEST)
    try:
        return storage.exists(fs, path) and storage.read_json(fs, path).get("fingerprint") == (
            info.base_name
        )
    except (OSError, ValueError, AttributeError):
        return False  # not a manifest raytuner wrote


def garbage(cache_root: str, keep: Version, min_age_s: float) -> list[str]:
    """Other cache versions under the cache root, and this version's part folders its manifest
    does not reference (it references the files of every job's dataset); never a version in
    use (a live lease: a preprocess or training run), nothing younger than ``min_age_s``, and
    nothing at all unless ``keep`` is committed."""
    manifest = keep.manifest()
    if manifest is None:
        raise ValueError(
            f"{keep.root}: this job's cache version is not committed, so gc cannot tell what is "
            "in use: it deletes nothing. Run `raytuner preprocess` for this job first"
        )
    fs, root = storage.resolve(cache_root)
    cutoff = time.time_ns() - min_age_s * 1e9
    infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    found = [
        i.path
        for i in infos
        if i.base_name != keep.fp
        and _version_folder(fs, i)
        and _newest_ns(fs, i) < cutoff
        and not Version(cache_root, i.base_name).leases()
    ]
    if keep.leases():  # a run writing parts or training on them now: its files stay
        return sorted(found)
    everything = keep.fs.get_file_info(pafs.FileSelector(keep.root, recursive=True))
    found += [  # temporaries of writes that died (a live write's is younger than min-age)
        i.path for i in everything if storage.TMP_MARK in i.base_name and (i.mtime_ns or 0) < cutoff
    ]
    live = {f["path"].split("/")[1] for f in committed_files(manifest) if f["path"]}
    runs = keep.fs.get_file_info(pafs.FileSelector(keep.path("parts"), allow_not_found=True))
    found += [r.path for r in runs if r.base_name not in live and _newest_ns(keep.fs, r) < cutoff]
    return sorted(found)


def collect(cache_root: str, keep: Version, min_age_s: float, dry_run: bool = False) -> list:
    """Delete what ``garbage`` finds (nothing with ``dry_run``); return it."""
    fs, _ = storage.resolve(cache_root)
    doomed = garbage(cache_root, keep, min_age_s)
    for path in [] if dry_run else doomed:
        if fs.get_file_info(path).type == pafs.FileType.Directory:
            fs.delete_dir(path)
        else:
            fs.delete_file(path)
    return doomed
