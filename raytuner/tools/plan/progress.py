"""What `raytuner plan` says while it traces: a line as each trace starts (the seconds since
plan started), and, while one trace runs on, a line every ``EVERY_S`` seconds, so that plan is
never silent longer than that. The lines go to the ``raytuner.plan`` logger (stderr in the
CLI: ``--json``'s stdout stays one JSON object)."""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("raytuner.plan")
EVERY_S = 10.0  # the longest plan stays silent


class Progress:
    """``with Progress() as progress:`` … ``progress.now("loading …")``, and before each
    trace ``progress.tracing("the training worker at …")``; ``progress.reused()`` where a trace
    is used again. ``quiet``: no lines (a single ``trace_step`` call outside plan)."""

    def __init__(self, quiet: bool = False, every_s: float = EVERY_S) -> None:
        self.quiet, self.every_s = quiet, every_s
        self.start = self.last = time.monotonic()
        self.what = ""
        self.traced = self.reused_count = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        self.start = self.last = time.monotonic()
        if not self.quiet:
            self._thread = threading.Thread(target=self._beat, name="plan-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc[0] is None and self.traced:
            traces = f"{self.traced} trace{'s' * (self.traced != 1)}"
            self._say(
                f"planned in {time.monotonic() - self.start:.1f} s "
                f"({traces}, {self.reused_count} reused)"
            )

    def now(self, what: str) -> None:
        """``what`` (``loading …``) starts."""
        with self._lock:
            self.what = what
        self._say(f"{what} ({time.monotonic() - self.start:.1f} s in)")

    def tracing(self, what: str) -> None:
        """A trace of ``what`` starts."""
        self.traced += 1
        self.now(f"tracing {what}")

    def reused(self) -> None:
        """A trace already made is used again (not traced twice)."""
        self.reused_count += 1

    def _say(self, line: str) -> None:
        with self._lock:
            self.last = time.monotonic()
        if not self.quiet:
            log.info(line)

    def _beat(self) -> None:
        while not self._stop.wait(1.0):
            with self._lock:
                now, what = time.monotonic(), self.what
                due = now - self.last >= self.every_s
            if due and what:
                self._say(f"still {what} ({now - self.start:.0f} s in)")
