"""Find images and their captions under a dataset root (local path or pyarrow URI)."""

from __future__ import annotations

import posixpath

import pyarrow.fs as pafs

from raytuner import storage

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


def scan_images(root_uri: str, caption_extension: str) -> list[dict[str, str]]:
    """One row per image: its path relative to the root and its caption file's ("" if none).

    Hidden files and folders (a leading dot, as macOS and editors leave behind) are ignored.
    """
    fs, root = storage.resolve(root_uri)
    info = fs.get_file_info(root)
    if info.type != pafs.FileType.Directory:
        raise ValueError(f"data.images = {root_uri!r} is not a folder")
    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    files = {posixpath.relpath(i.path, root) for i in infos if i.type == pafs.FileType.File}
    files = {f for f in files if not any(p.startswith(".") for p in f.split("/"))}
    rows = []
    for rel in sorted(files):
        stem, ext = posixpath.splitext(rel)
        if ext.lower() in IMAGE_EXTENSIONS:
            caption = stem + caption_extension
            rows.append({"path": rel, "caption_path": caption if caption in files else ""})
    return rows
