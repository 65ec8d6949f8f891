"""Dataset sources: list the images of each folder (driver side) and probe each one (a Ray Data
task: content hash and caption), so that every file ends in exactly one report category."""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from dataclasses import dataclass

import pyarrow.fs as pafs

from raytuner import storage
from raytuner.config import SourceConfig
from raytuner.preprocess import pairs
from raytuner.preprocess.clips import VIDEO_EXTENSIONS

MAX_CAPTION_BYTES = 256 * 1024  # a caption file over this is skipped with its reason
MAX_METADATA_BYTES = 1024**3  # a metadata table over this is refused
HASH_CHUNK = 8 * 1024 * 1024  # images are hashed in pieces of this, never read whole
IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
METADATA_NAMES = ("metadata.jsonl", "metadata.csv", "metadata.parquet")
JUNK_NAMES = {"__MACOSX", "Thumbs.db", "desktop.ini", "@eaDir", "$RECYCLE.BIN"}
# a loss mask beside its image (OneTrainer's naming): "<stem>-masklabel.png" is the mask of
# "<stem>.<ext>", never an image itself; white trains, black is ignored (data.mask = "file")
MASK_SUFFIX = "-masklabel.png"
# a kohya sd-scripts dataset folder: "<repeats>_<class tokens>" ("10_ohwx person"); sd-scripts
# splits the name at its first "_" and reads the rest as the class tokens
KOHYA_FOLDER = re.compile(r"([0-9]+)_(.*)", re.DOTALL)
# where a caption came from when its file is not UTF-8 (its bad bytes replaced by U+FFFD)
NOT_UTF8 = "file, not UTF-8"


@dataclass(frozen=True)
class KohyaFolder:
    """The folder an image takes its repeats (and, without a caption, its caption) from."""

    path: str  # relative to the source, e.g. "img/10_ohwx person"
    repeats: int
    name: str  # the class tokens after the prefix: "ohwx person"


def kohya_folder(rel: str) -> KohyaFolder | None:
    """The nearest folder above ``rel`` (a file's path in its source) named ``<N>_<name>``;
    the source folder itself never counts."""
    folders = rel.split("/")[:-1]
    for end in range(len(folders), 0, -1):
        if m := KOHYA_FOLDER.fullmatch(folders[end - 1]):
            return KohyaFolder("/".join(folders[:end]), int(m.group(1)), m.group(2))
    return None


def caption_file(source: SourceConfig, rel: str) -> str:
    """The caption file of the image at ``rel``: beside it, its stem and the caption extension."""
    return posixpath.splitext(rel)[0] + source.caption_extension


def image_repeats(source: SourceConfig, rel: str) -> int:
    """How often the image at ``rel`` appears per epoch: its kohya folder's N when the source
    has ``repeats_from_folder``, else (and outside such folders) the source's ``repeats``."""
    folder = kohya_folder(rel) if source.repeats_from_folder else None
    return source.repeats if folder is None else folder.repeats


def folder_report(rows: list[dict], sources: list[SourceConfig]) -> list[dict]:
    """Per kohya folder (``<N>_<name>``) of every source that has one: its trained images,
    their repeats, and how many are captioned by the folder's name (no caption file or
    metadata); a folder whose N its source does not take (no ``repeats_from_folder``: it
    trains with the source's repeats) adds ``"taken": False`` and that N (``named``).
    ``rows``: indexed rows (``source``, ``source_index``, ``path``, ``repeats``,
    ``caption_from``); ``folder`` "" gathers a source's images under no ``<N>_`` folder."""
    groups: dict[tuple[int, str], dict] = {}
    for r in rows:
        folder = kohya_folder(r["path"])
        key = (r["source_index"], folder.path if folder else "")
        group = groups.setdefault(
            key,
            {"source": r["source"], "folder": key[1], "images": 0, "repeats": r["repeats"]}
            | {"name_captions": 0},
        )
        if folder and not sources[r["source_index"]].repeats_from_folder:
            group |= {"taken": False, "named": folder.repeats}
        group["images"] += 1
        group["name_captions"] += r["caption_from"] == "folder"
    with_folders = {i for i, folder in groups if folder}
    return [groups[k] for k in sorted(groups) if k[0] in with_folders]


def _is_junk(rel: str) -> bool:
    return any(p.startswith(".") or p in JUNK_NAMES for p in rel.split("/"))


def _escapes(fs: pafs.FileSystem, root: str, path: str) -> bool:
    """A local symlink whose target lies outside the source folder."""
    if not isinstance(fs, pafs.LocalFileSystem):
        return False
    real_root = os.path.realpath(root)
    return os.path.commonpath([real_root, os.path.realpath(path)]) != real_root


def _local_files(root: str) -> dict[str, tuple[int, int]]:
    """``rel -> (size, mtime_ns)`` of a local folder's files. Folder symlinks are followed
    only inside the folder, and each real folder once: a link out of the dataset (to ``/``) or
    a loop (``a/up -> ..``) is not walked. (pyarrow's recursive listing follows both.)"""
    real_root, files = os.path.realpath(root), {}
    seen = {real_root}
    for folder, dirs, names in os.walk(root, followlinks=True):
        keep = []
        for d in dirs:
            real = os.path.realpath(os.path.join(folder, d))
            if os.path.commonpath([real_root, real]) == real_root and real not in seen:
                seen.add(real)
                keep.append(d)
        dirs[:] = keep
        for name in names:
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError:
                continue  # a dangling link: nothing to read
            files[os.path.relpath(path, root).replace(os.sep, "/")] = (st.st_size, st.st_mtime_ns)
    return files


def _files(fs: pafs.FileSystem, root: str) -> dict[str, tuple[int, int]]:
    if isinstance(fs, pafs.LocalFileSystem):
        return _local_files(root)
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    return {
        posixpath.relpath(i.path, root): (i.size, i.mtime_ns or 0)
        for i in infos
        if i.type == pafs.FileType.File
    }


def read_metadata(fs: pafs.FileSystem, path: str) -> dict[str, str]:
    """``file_name -> text`` from an imagefolder-style metadata.jsonl / .csv / .parquet."""
    return _captions(metadata_rows(fs, path), path)


def _captions(rows: list[dict], path: str) -> dict[str, str]:
    missing = {"file_name", "text"} - set(rows[0] if rows else {"file_name", "text"})
    if missing:
        raise ValueError(f"{path}: metadata needs columns file_name and text; missing {missing}")
    return {posixpath.normpath(str(r["file_name"])): str(r["text"] or "") for r in rows}


def metadata_rows(fs: pafs.FileSystem, path: str) -> list[dict]:
    """The rows of a metadata.jsonl / .csv / .parquet, every column."""
    import pyarrow.csv
    import pyarrow.parquet as pq

    size = fs.get_file_info(path).size or 0
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"{path}: {size:,} bytes, over the {MAX_METADATA_BYTES:,} allowed")

    if path.endswith(".jsonl"):
        lines = storage.read_bytes(fs, path).decode("utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
    elif path.endswith(".csv"):
        with fs.open_input_stream(path) as f:
            rows = pyarrow.csv.read_csv(f).to_pylist()
    else:
        rows = pq.read_table(path, filesystem=fs).to_pylist()
    return rows


def _metadata_file(fs, root: str, source: SourceConfig, names: set[str]) -> str | None:
    if source.metadata:
        return storage.join(root, source.metadata)
    return next((storage.join(root, n) for n in METADATA_NAMES if n in names), None)


def _is_image(ext: str) -> bool:
    return ext.lower() in IMAGE_EXTENSIONS


def list_source(index: int, source: SourceConfig, reference_index: int | None = None) -> list[dict]:
    """One row per image or video clip file of a source (hidden and OS junk files are not
    inputs), each with its reference images (``references``: a paired source's,
    ``preprocess/pairs.py``); with ``reference_index``, then one row per reference file, of that
    source index (None: the source is listed unpaired, every image trained alone)."""
    fs, root = storage.resolve(source.path)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        raise ValueError(f"data source {source.path!r} is not a folder")
    files = _files(fs, root)
    metadata_path = _metadata_file(fs, root, source, set(files))
    if metadata_path and _escapes(fs, root, metadata_path):
        raise ValueError(f"{metadata_path}: a symlink outside the dataset folder; not read")
    table = metadata_rows(fs, metadata_path) if metadata_path else None
    captions = _captions(table, metadata_path) if metadata_path else {}
    pairing = None
    if reference_index is not None:
        pairing = pairs.make_pairing(source, files, table, _files, _escapes)
    masks = _mask_files(files)
    rows = []
    for rel in sorted(files):
        stem, ext = posixpath.splitext(rel)
        media = _is_image(ext) or ext.lower() in VIDEO_EXTENSIONS  # clips too
        if not media or _is_junk(rel) or rel in masks:
            continue
        if pairs.is_reference_file(pairing, rel):
            continue
        txt, mask = caption_file(source, rel), stem + MASK_SUFFIX
        mask = mask if mask in masks and source.mask == "file" else ""
        size, mtime_ns = files[rel]
        refused = ""
        if mask and _escapes(fs, root, storage.join(root, mask)):
            refused = "mask file is a symlink outside the dataset folder"
        elif source.repeats_from_folder and image_repeats(source, rel) == 0:
            refused = f"folder {kohya_folder(rel).path!r} says 0 repeats (sd-scripts leaves it out)"
        elif _escapes(fs, root, storage.join(root, rel)):
            refused = "symlink outside the dataset folder"
        elif txt in files and _escapes(fs, root, storage.join(root, txt)):
            refused = "caption file is a symlink outside the dataset folder"
        elif txt in files and files[txt][0] > MAX_CAPTION_BYTES:
            refused = f"caption file over {MAX_CAPTION_BYTES:,} bytes"
        refs, why = pairs.references_of(pairing, rel, _is_image) if pairing else ([], "")
        refused = refused or why
        rows.append(
            {
                "source": index,
                "path": rel,
                "size": size,
                "mtime_ns": mtime_ns,
                "caption_path": txt if txt in files else "",
                "metadata_caption": captions.get(rel),
                "mask_path": mask,
                "refused": refused,
                "references": [] if refused else refs,
                "role": pairs.ROLE_TARGET,
            }
        )
    if pairing is not None:
        rows += pairs.reference_rows(rows, reference_index, pairing)
    return rows


def _mask_files(files) -> set[str]:
    """The mask files among a folder's files: ``<stem>-masklabel.png`` beside an image of that
    stem (whatever the source's ``mask``: they are no training images)."""
    stems = {
        posixpath.splitext(rel)[0]
        for rel in files
        if posixpath.splitext(rel)[1].lower() in IMAGE_EXTENSIONS
    }
    return {r for r in files if r.endswith(MASK_SUFFIX) and r[: -len(MASK_SUFFIX)] in stems}


def _caption(fs, root: str, row: dict, source: SourceConfig) -> tuple[str | None, str, str]:
    """(caption or None to skip, where it came from, reason when skipped)."""
    if row["metadata_caption"]:
        return row["metadata_caption"].strip(), "metadata", ""
    if row["caption_path"]:
        raw = storage.read_bytes(fs, storage.join(root, row["caption_path"]))
        where = "file"
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            if source.caption_errors == "skip":
                return None, "", "caption file is not valid UTF-8"
            # replaced (or refused after the stream: caption_errors = "strict"), and counted
            text, where = raw.decode("utf-8", errors="replace"), NOT_UTF8
        if text.strip():
            return " ".join(text.split()), where, ""
    folder = kohya_folder(row["path"]) if source.repeats_from_folder else None
    if folder is not None and folder.name.strip():  # sd-scripts' class tokens
        return " ".join(folder.name.split()), "folder", ""
    if source.caption_fallback == "stem":
        stem = posixpath.splitext(posixpath.basename(row["path"]))[0]
        return stem.replace("_", " ").strip(), "fallback", ""
    if source.caption_fallback == "empty":
        return "", "fallback", ""
    return None, "", "no caption (data caption_fallback = skip)"


def _hash(fs: pafs.FileSystem, path: str, keep: bool) -> tuple[str, int, bytes | None]:
    """sha256 of a file's content and its size, read in pieces; and the content when ``keep``
    (the image is decoded next: one read serves both)."""
    digest, size, pieces = hashlib.sha256(), 0, []
    with fs.open_input_stream(path) as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
            if keep:
                pieces.append(chunk)
    return digest.hexdigest(), size, b"".join(pieces) if keep else None


def probe_row(row: dict, sources: list[SourceConfig]) -> dict:
    """Content key and caption of one listed file; ``reason`` is set when it must be skipped.

    When the file's size and mtime equal those of the last committed index, its known key is
    kept without reading the image again.
    """
    return probe_and_read(row, sources, keep=False)[0]


def probe_and_read(row: dict, sources: list[SourceConfig], keep: bool) -> tuple[dict, bytes | None]:
    """``probe_row``, and with ``keep`` the file's bytes as read for the hash (the known key
    is then not trusted: the file is read and hashed again)."""
    source = sources[row["source"]]
    fs, root = storage.resolve(source.path)
    out = {
        "source": row["source"],
        "path": row["path"],
        "size": row["size"],
        "mtime_ns": row["mtime_ns"],
        "key": "",
        "caption": "",
        "caption_from": "",
        "reason": row["refused"],
        "mask_path": row.get("mask_path", ""),
        "mask_sha": "",  # the sha256 of its mask file (data.mask = "file"), read every run
    }
    if out["reason"]:
        return out, None
    data = None
    try:
        if row.get("known_key") and not keep:
            out["key"] = row["known_key"]
        else:
            digest, size, data = _hash(fs, storage.join(root, row["path"]), keep)
            out["key"] = digest if size else ""
            out["reason"] = "" if size else "empty file"
        if out["mask_path"]:
            out["mask_sha"] = _hash(fs, storage.join(root, out["mask_path"]), False)[0]
        caption, where, why = _caption(fs, root, row, source)
    except OSError as e:
        return {**out, "reason": f"unreadable: {e}"}, None
    out["reason"] = out["reason"] or why
    return {**out, "caption": caption or "", "caption_from": where}, data
