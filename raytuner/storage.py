"""Paths and URIs through pyarrow filesystems, with atomic writes (temp + rename)."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import pyarrow.fs as pafs


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """A local path (relative to the working directory) or a pyarrow URI -> (fs, path)."""
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    fs, path = pafs.FileSystem.from_uri(uri)
    return fs, path


def absolute(uri: str) -> str:
    """The same location as an absolute path or a URI (what Ray's storage_path wants)."""
    return uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))


def join(*parts: str) -> str:
    return "/".join(p.rstrip("/") for p in parts if p)


def basename(uri: str) -> str:
    """The last part of a path or URI (a run folder's name is the run's name)."""
    return uri.rstrip("/").rsplit("/", 1)[-1]


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def listdir(fs: pafs.FileSystem, path: str) -> list[pafs.FileInfo]:
    """The entries directly under ``path``, sorted by name."""
    infos = fs.get_file_info(pafs.FileSelector(path))
    return sorted(infos, key=lambda info: info.path)


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path) as f:
        return f.read()


def read_json(fs: pafs.FileSystem, path: str) -> Any:
    return json.loads(read_bytes(fs, path))


def write_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Write to a temporary sibling, then rename: readers see the old file or the new one."""
    parent = path.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)


def write_json_atomic(fs: pafs.FileSystem, path: str, obj: Any) -> None:
    write_atomic(fs, path, json.dumps(obj, indent=2, sort_keys=True).encode())


def copy_file(src: str, dst_fs: pafs.FileSystem, dst: str) -> None:
    with open(src, "rb") as f:
        write_atomic(dst_fs, dst, f.read())
