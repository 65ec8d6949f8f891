"""Paths and URIs through pyarrow filesystems, with atomic, durable writes and streamed copies."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
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


def read_buffer(fs: pafs.FileSystem, path: str) -> pa.Buffer:
    """A whole file in memory Arrow owns: what to hand pyarrow's readers. (A reader over Python
    ``bytes`` may drop its last reference from an Arrow thread after the call returns; at
    interpreter exit that thread cannot take the GIL and the process aborts, exit code 134.)"""
    with fs.open_input_stream(path) as f:
        return f.read_buffer()


def read_json(fs: pafs.FileSystem, path: str) -> Any:
    return json.loads(read_bytes(fs, path))


COPY_CHUNK = 8 * 1024 * 1024  # copies stream in pieces of this, never a whole file in memory
TMP_MARK = ".tmp-"  # a local temporary sibling: <path>.tmp-<uuid> (gc removes stale ones)


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(fs: pafs.FileSystem, path: str, size: int | None = None) -> Iterator[Any]:
    """A writable stream whose content appears at ``path`` whole or not at all; ``size``: the
    bytes it will hold, when known (a full local disk is then named with them: ``no_room``).

    Local disks: a temporary sibling, flushed and fsynced, renamed over ``path``, and the
    folder fsynced, so a host crash leaves the old file or the new one. Object stores, where a
    rename is a copy and a delete: the final key is written once (an upload becomes visible
    only when it completes), no temporary is left behind; a failed write deletes the key."""
    parent = path.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    if not isinstance(fs, pafs.LocalFileSystem):
        try:
            with fs.open_output_stream(path) as f:
                yield f
        except BaseException:
            with contextlib.suppress(OSError):
                fs.delete_file(path)
            raise
        return
    tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex}"
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(parent)
    except OSError as e:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise no_room(path, size, e) from e
        raise
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def no_room(path: str, size: int | None, error: OSError) -> OSError:
    """The error of a write that found its disk full (or its quota used up): the file, the
    bytes it needed and the bytes free there (the disk's own message says neither)."""
    try:
        free = f"{shutil.disk_usage(os.path.dirname(path)).free:,} bytes are free there"
    except OSError:
        free = "the free space there is unknown"
    need = f"{size:,} bytes" if size is not None else "its bytes"
    return OSError(
        error.errno,
        f"no room to write {path} ({os.strerror(error.errno)}): it needs {need}, {free}; "
        "free space on that disk or move the folder elsewhere",
    )


OLD_MARK = ".old-"  # a folder being swapped out: <path>.old-<uuid> (folder_swap's fallback)


@contextlib.contextmanager
def folder_swap(fs: pafs.FileSystem, path: str) -> Iterator[str]:
    """A folder to write into whose content replaces the folder ``path`` whole, once the block
    ends without an error; an error or an interruption (Ctrl-C, a kill) inside it leaves
    ``path`` as it was, never a mix of the two.

    Local disks: a sibling ``<path>.tmp-<uuid>``, swapped with ``path`` in one rename
    (``renameat2(RENAME_EXCHANGE)``; where the filesystem lacks it, two renames, undone on an
    error between them), then the old content deleted; what a killed process left beside
    ``path`` is removed (or put back) first. Object stores have no folder rename: the files are
    written at ``path`` directly, each whole (``atomic_output``)."""
    if not isinstance(fs, pafs.LocalFileSystem):
        yield path
        return
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    _tidy_swaps(path)
    tmp = f"{path}{TMP_MARK}{uuid.uuid4().hex}"
    os.makedirs(tmp)
    try:
        yield tmp
        _swap_in(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the new folder unused, or the old one
    _fsync_dir(parent)


def _swap_in(tmp: str, path: str) -> None:
    """``tmp`` renamed to ``path``; the old ``path`` (if any) left at ``tmp``."""
    if not os.path.lexists(path):
        os.rename(tmp, path)
        return
    if _exchange(tmp, path):
        return
    old = f"{path}{OLD_MARK}{uuid.uuid4().hex}"
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(old, path)
        raise
    os.rename(old, tmp)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the filesystem cannot."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    done = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if done == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), b)


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _tidy_swaps(path: str) -> None:
    """What an interrupted ``folder_swap`` of ``path`` left beside it: its unfinished new
    folder (removed) or, killed between its two renames, the old folder (put back)."""
    parent, name = os.path.split(path)
    for entry in sorted(os.listdir(parent)):
        sibling = os.path.join(parent, entry)
        if entry.startswith(name + OLD_MARK) and not os.path.lexists(path):
            os.rename(sibling, path)
        elif entry.startswith((name + TMP_MARK, name + OLD_MARK)) and os.path.isdir(sibling):
            shutil.rmtree(sibling, ignore_errors=True)


def write_atomic(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """``data`` at ``path``, atomically and durably (``atomic_output``)."""
    with atomic_output(fs, path, len(data)) as f:
        f.write(data)


def write_json_atomic(fs: pafs.FileSystem, path: str, obj: Any) -> None:
    write_atomic(fs, path, json.dumps(obj, indent=2, sort_keys=True).encode())


def copy_stream(src_fs: pafs.FileSystem, src: str, dst_fs: pafs.FileSystem, dst: str) -> None:
    """Copy a file between filesystems in pieces, atomically at the destination."""
    with src_fs.open_input_stream(src) as f, atomic_output(dst_fs, dst) as out:
        while chunk := f.read(COPY_CHUNK):
            out.write(chunk)


def copy_file(src: str, dst_fs: pafs.FileSystem, dst: str) -> None:
    """A local file to any filesystem (``copy_stream``)."""
    copy_stream(pafs.LocalFileSystem(), os.path.abspath(src), dst_fs, dst)


def local_copy(fs: pafs.FileSystem, path: str, scratch: str) -> str:
    """A local path for ``path`` on ``fs``: itself, or a copy of the remote file or folder."""
    if isinstance(fs, pafs.LocalFileSystem):
        return path
    target = os.path.join(scratch, os.path.basename(path.rstrip("/")))
    pafs.copy_files(path, target, source_filesystem=fs)
    return target


def copy_named(fs: pafs.FileSystem, folder: str, names: list[str], target: str) -> str:
    """Copy ``names`` (files or folders) of ``folder`` on ``fs`` into the local ``target``."""
    os.makedirs(target, exist_ok=True)
    for name in names:
        path = join(folder, name)
        if fs.get_file_info(path).type == pafs.FileType.Directory:
            # made first: pyarrow's threads copying the files race to make a missing folder
            os.makedirs(os.path.join(target, name), exist_ok=True)
            pafs.copy_files(path, os.path.join(target, name), source_filesystem=fs)
        else:
            copy_stream(fs, path, pafs.LocalFileSystem(), os.path.join(target, name))
    return target


def local_files(fs: pafs.FileSystem, folder: str, names: list[str], scratch: str) -> str:
    """A local folder holding ``names`` (files or folders) of ``folder`` on ``fs``: the folder
    itself, or a copy of just those under ``scratch``."""
    if isinstance(fs, pafs.LocalFileSystem):
        return folder
    return copy_named(fs, folder, names, os.path.join(scratch, basename(folder.rstrip("/"))))
