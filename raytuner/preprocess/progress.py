"""A compact progress line for a Ray Data pass (Ray Data's own per-operator bars are off in
jobs): encoder actors add what they finished to a small counting actor, and the driver logs
one line every few seconds with the count, the rate and an ETA."""

from __future__ import annotations

import datetime
import logging
import threading
import time

import ray

from raytuner.observe import metrics

log = logging.getLogger("raytuner.preprocess")


class Counting:
    """The counting actor; also feeds the dashboard's counter ``metric`` (if any)."""

    def __init__(self, run: str, metric: str | None) -> None:
        self.n, self.run, self.metric = 0, run, metric
        self.first: float | None = None  # wall time of the first count

    def add(self, n: int) -> None:
        self.n += n
        self.first = self.first or time.time()
        if self.metric:
            metrics.count(self.metric, n, self.run)

    def value(self) -> int:
        return self.n

    def first_at(self) -> float | None:
        return self.first


class ProgressLine:
    """``with ProgressLine("encoded", total, run) as counter:`` hand ``counter`` to the actors
    (they call ``counter.add.remote(n)``); a line is logged every ``every_s`` seconds."""

    def __init__(self, what: str, total: int, run: str, metric: str | None = None, every_s=10.0):
        self.what, self.total, self.run, self.metric = what, total, run, metric
        self.every_s, self.stop = every_s, threading.Event()
        self.first_at: float | None = None
        self.counter = ray.remote(Counting).options(num_cpus=0).remote(run, metric)

    def __enter__(self):
        self.started = time.monotonic()
        self.thread = threading.Thread(target=self._loop, name="raytuner-progress", daemon=True)
        self.thread.start()
        return self.counter

    def __exit__(self, kind, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self._report(final=True, failed=kind is not None)
        try:  # ``first_at``: when the first item was counted (wall time; None: none was)
            self.first_at = ray.get(self.counter.first_at.remote())
        except ray.exceptions.RayError:
            self.first_at = None
        ray.kill(self.counter)

    def _loop(self) -> None:
        while not self.stop.wait(self.every_s):
            self._report(final=False)

    def _report(self, final: bool, failed: bool = False) -> None:
        """A progress line; a lost counting actor costs the line, never the pass. A pass that
        failed before anything was counted (no resources for its actors) has no last line:
        its error says what happened."""
        try:
            n = ray.get(self.counter.value.remote())
            if not (failed and n == 0):
                self._line(n, final)
        except ray.exceptions.RayError as e:
            log.warning("preprocess: no progress count (%s)", e)

    def _line(self, n: int, final: bool) -> None:
        seconds = time.monotonic() - self.started
        rate = n / seconds if seconds > 0 else 0.0
        if final:
            log.info(
                "preprocess: %s %d/%d in %.1f s (%.1f/s)", self.what, n, self.total, seconds, rate
            )
            return
        eta = datetime.timedelta(seconds=round((self.total - n) / rate)) if rate else "?"
        log.info("preprocess: %s %d/%d (%.1f/s) ETA %s", self.what, n, self.total, rate, eta)
        if self.metric:
            metrics.gauge(f"{self.metric}_per_s", rate, self.run)
