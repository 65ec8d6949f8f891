"""The driver's lines while Ray Train starts the worker group: its controller, the workers'
processes, torch's process group and the imports of the training code take tens of seconds (a
minute and more on a busy machine) before a worker can say anything. Until the first line of a
training worker reaches the driver, the driver says every ``EVERY_S`` seconds that it waits."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

log = logging.getLogger("raytuner.train")

EVERY_S = 10.0
WORKER = "RayTrainWorker"  # the actor name Ray gives a training worker's log lines
HANDLER = "raytuner-workers-started"


@contextlib.contextmanager
def waiting_for_workers(run: str, workers: str, every_s: float = EVERY_S):
    """Around Ray Train's ``fit``: a line every ``every_s`` s until a training worker's first
    log line arrives (Ray forwards every worker's lines to this driver, a batch at a time, to
    the handlers of its dispatcher: the one place this driver sees them) or ``fit`` ends."""
    heard = threading.Event()
    lines = _dispatcher()

    def seen(batch: dict) -> None:
        if batch.get("actor_name") == WORKER:
            heard.set()

    def tick() -> None:
        started = time.monotonic()
        while not heard.wait(every_s):
            log.info(
                "run %s: waiting for the %s training worker(s) to start (%.0f s)",
                *(run, workers, time.monotonic() - started),
            )

    if lines is None:  # nothing would tell when they started
        yield
        return
    lines.add_handler(HANDLER, seen)
    thread = threading.Thread(target=tick, name="raytuner-workers-starting", daemon=True)
    thread.start()
    try:
        yield
    finally:
        heard.set()
        thread.join()
        lines.remove_handler(HANDLER)


def _dispatcher():
    """Ray's dispatcher of the workers' log lines in this driver (``ray.init``'s
    ``log_to_driver``, a private part of Ray 2.60); None where this Ray has none."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher
    except ImportError:
        return None
    return global_worker_stdstream_dispatcher
