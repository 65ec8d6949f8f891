"""A worker's peak memory, sampled by a background thread: what the training metrics and
`raytuner bench feed` report.

``rss`` is what the process has in RAM; ``anon`` is its anonymous part (heap, tensors: what an
OOM killer counts first), without the file pages it maps. Reads of the cache go through
``pread`` (never a memory map), so the kernel's page cache shows in neither.
"""

from __future__ import annotations

import threading

import psutil


def _anon_bytes() -> int | None:
    """RssAnon of this process (Linux), or None where /proc does not say."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak RSS and anonymous memory since ``start``, sampled every ``interval_s``, and at every
    ``peaks()`` call. Each sample takes the GIL from the training thread: every 20 ms cost the
    tiny job's bare CPU step loop about 10 % of its rate (alternated rounds), every 100 ms
    nothing measurable; a memory that grows with the dataset grows for longer than that."""

    def __init__(self, interval_s: float = 0.1) -> None:
        self.interval_s = interval_s
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rss = self.anon = 0

    def sample(self) -> None:
        rss = self._process.memory_info().rss
        self.rss = max(self.rss, rss)
        self.anon = max(self.anon, _anon_bytes() or rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> PeakMemory:
        self.sample()
        self._thread = threading.Thread(target=self._run, name="raytuner-memory", daemon=True)
        self._thread.start()
        return self

    def peaks(self) -> dict[str, int]:
        self.sample()
        return {"peak_rss_bytes": self.rss, "peak_anon_bytes": self.anon}

    def stop(self) -> dict[str, int]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        return self.peaks()
