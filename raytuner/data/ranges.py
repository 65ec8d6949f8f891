"""Ranged reads of the cache's files for a training worker (``reader.CachedDataset``): each
batch's cells fetched as byte ranges, ranges of one file that lie close together merged into one
request, the requests issued in parallel, the files kept open (a bounded number per worker)."""

from __future__ import annotations

import collections
import threading
from concurrent.futures import ThreadPoolExecutor

from raytuner import storage

HOLE = 8 * 1024  # ranges of one file at most this far apart are read as one request
THREADS = 8  # parallel requests per worker (object storage answers each in tens of ms)
HANDLES = 256  # open files kept per worker


class RangeReader:
    """Byte ranges of the files under one folder of a pyarrow filesystem; counts what it read."""

    def __init__(self, fs, root: str, threads: int = THREADS):
        self.fs, self.root = fs, root
        self._files: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="raytuner-read")
        self.bytes_read = self.requests = 0

    def _file(self, rel: str):
        with self._lock:
            if rel in self._files:
                self._files.move_to_end(rel)
                return self._files[rel]
        handle = self.fs.open_input_file(storage.join(self.root, rel))
        with self._lock:
            self._files[rel] = handle
            while len(self._files) > HANDLES:  # dropped, not closed: a read may still use it
                self._files.popitem(last=False)
        return handle

    def _fetch(self, group: list) -> memoryview:
        rel, start, stop, _ = group
        data = self._file(rel).read_at(stop - start, start)
        if len(data) != stop - start:
            raise OSError(f"{rel}: {len(data)} bytes at {start}, expected {stop - start}")
        return memoryview(data)

    def read(self, ranges: list[tuple[str, int, int]]) -> list[memoryview]:
        """The bytes of each (file, offset, length)."""
        groups: list[list] = []  # [file, start, stop, indices]
        for i in sorted(range(len(ranges)), key=lambda i: ranges[i]):
            rel, at, n = ranges[i]
            if groups and groups[-1][0] == rel and at - groups[-1][2] <= HOLE:
                groups[-1][2] = max(groups[-1][2], at + n)
                groups[-1][3].append(i)
            else:
                groups.append([rel, at, at + n, [i]])
        out: list = [None] * len(ranges)
        for group, data in zip(groups, self._pool.map(self._fetch, groups), strict=True):
            for i in group[3]:
                start = ranges[i][1] - group[1]
                out[i] = data[start : start + ranges[i][2]]
        with self._lock:
            self.bytes_read += sum(g[2] - g[1] for g in groups)
            self.requests += len(groups)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._files.clear()
