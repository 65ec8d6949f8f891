"""Leases: a job that uses a cache version (a preprocess writing to it, a training run reading
it) keeps a small heartbeat file under ``<version>/leases/`` for as long as it runs, renewed
every ``TTL_S / 3`` seconds by a daemon thread. ``cache gc`` never touches a version with a
live lease. A job killed without cleaning up stops renewing; its lease expires after ``TTL_S``.

Works on every pyarrow filesystem (a lease is a JSON file written atomically); clocks of the
machines sharing a cache are assumed to agree to well within ``TTL_S``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid

import pyarrow.fs as pafs

from raytuner import storage

LEASES = "leases"
TTL_S = 120.0


class Lease:
    """``with Lease(fs, version_root, holder):`` the version is in use by ``holder``."""

    def __init__(self, fs: pafs.FileSystem, root: str, holder: str, ttl_s: float = TTL_S):
        self.fs, self.ttl_s = fs, ttl_s
        name = f"{holder}-{uuid.uuid4().hex[:8]}.json".replace("/", "_")
        self.path = storage.join(root, LEASES, name)
        self.record = {"holder": holder, "host": socket.gethostname(), "pid": os.getpid()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="raytuner-lease", daemon=True)

    def _write(self) -> None:
        expires = time.time() + self.ttl_s
        storage.write_json_atomic(self.fs, self.path, self.record | {"expires": expires})

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            self._write()

    def __enter__(self) -> Lease:
        self._write()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        # already removed by someone else (it had expired): nothing left to release
        with contextlib.suppress(FileNotFoundError):
            self.fs.delete_file(self.path)


def live(fs: pafs.FileSystem, root: str, now: float | None = None) -> list[dict]:
    """The unexpired leases on the version at ``root``."""
    now = time.time() if now is None else now
    selector = pafs.FileSelector(storage.join(root, LEASES), allow_not_found=True)
    found = []
    for info in fs.get_file_info(selector):
        if not info.path.endswith(".json"):
            continue
        try:
            record = storage.read_json(fs, info.path)
        except (OSError, ValueError):
            continue  # removed between listing and reading, or being replaced
        if record.get("expires", 0) > now:
            found.append(record)
    return found
