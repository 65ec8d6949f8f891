"""A compact progress line for the preprocess stream (Ray Data's own per-operator bars are off in
jobs): the probe tasks add what they read (files cached, skipped, to encode) and the encoder
actors what they encoded (and when their VAE is loaded) to a small counting actor, and the
driver logs one line every few seconds with those counts, the encode rate and an ETA. The
stream's steps also tell it how long each block took them (``clock``, ``timed``): the report's
``stages``, so that a slower preprocess names the step that got slower."""

from __future__ import annotations

import datetime
import logging
import threading
import time

import ray

from raytuner.observe import metrics

log = logging.getLogger("raytuner.preprocess")

# what the stream's steps count (``Counting.add``)
READ = "read"  # files probed (every listed file is, once)
CACHED = "cached"  # files probed: nothing new to encode (already cached, or a duplicate)
SKIPPED = "skipped"  # files probed or decoded: refused, with its reason
TO_ENCODE = "to_encode"  # images and clip samples probed: decoded, for the encoders
SAMPLES = "samples"  # of those to encode, the clip samples (a clip in chunks has several)
ENCODED = "encoded"  # images and clip samples encoded (their latent, flipped latent or mask)
READY = "ready"  # encoder actors whose image encoder is loaded


def clock() -> tuple[float, float]:
    """Now, as (wall seconds, this thread's CPU seconds): the start of a timed step."""
    return time.perf_counter(), time.thread_time()


def since(start: tuple[float, float]) -> dict[str, float]:
    """The wall seconds and this thread's CPU seconds since ``start`` (a ``clock()``)."""
    wall, cpu = clock()
    return {"seconds": wall - start[0], "cpu_seconds": cpu - start[1]}


def timed(counter, stage: str, start: tuple[float, float]) -> None:
    """Tell ``counter`` (the counting actor; None: no one asked) the time of one block's
    ``stage`` since ``start`` (a ``clock()``); not waited for."""
    if counter is not None:
        counter.timed.remote(stage, since(start))


class Counting:
    """The counting actor; also feeds the dashboard's counter ``metric`` (if any) with the
    images encoded, and sums the time of each stage of the stream (``timed``)."""

    def __init__(self, run: str, metric: str | None) -> None:
        self.counts: dict[str, int] = {}
        self.run, self.metric = run, metric
        self.first: float | None = None  # wall time of the first image encoded
        self.stages: dict[str, dict] = {}  # stage -> seconds, cpu_seconds, blocks

    def add(self, counts: dict[str, int]) -> None:
        for kind, n in counts.items():
            self.counts[kind] = self.counts.get(kind, 0) + n
        if counts.get(ENCODED):
            self.first = self.first or time.time()
            if self.metric:
                metrics.count(self.metric, counts[ENCODED], self.run)

    def value(self) -> dict[str, int]:
        return dict(self.counts)

    def first_at(self) -> float | None:
        return self.first

    def timed(self, stage: str, times: dict[str, float]) -> None:
        """One block's ``stage``: its wall seconds and its thread's CPU seconds (``since``)."""
        total = self.stages.setdefault(stage, {"seconds": 0.0, "cpu_seconds": 0.0, "blocks": 0})
        total["seconds"] += times["seconds"]
        total["cpu_seconds"] += times["cpu_seconds"]
        total["blocks"] += 1

    def stage_times(self) -> dict[str, dict]:
        return self.stages


class ProgressLine:
    """``with ProgressLine(files, todo, run) as counter:`` hand ``counter`` to the probe tasks
    and the encoder actors (they call ``counter.add.remote({kind: n})``); a line is logged every
    ``every_s`` seconds and at the end. ``files``: the files listed; ``todo``: about how many
    of them have something to encode (the listing's guess, until every file is read)."""

    def __init__(self, files: int, todo: int, run: str, metric: str | None = None, every_s=10.0):
        self.files, self.todo, self.run, self.metric = files, todo, run, metric
        self.every_s, self.stop = every_s, threading.Event()
        self.first_at: float | None = None
        self.stages: dict[str, dict] = {}  # the stream's stages, once the pass is over
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
            self.first_at, self.stages = ray.get(
                [self.counter.first_at.remote(), self.counter.stage_times.remote()]
            )
        except ray.exceptions.RayError:
            self.first_at, self.stages = None, {}
        ray.kill(self.counter)

    def _loop(self) -> None:
        while not self.stop.wait(self.every_s):
            self._report(final=False)

    def _report(self, final: bool, failed: bool = False) -> None:
        """A progress line; a lost counting actor costs the line, never the pass. A pass that
        failed before anything was counted (no resources for its actors) has no last line:
        its error says what happened."""
        try:
            counts = ray.get(self.counter.value.remote())
        except ray.exceptions.RayError as e:
            log.warning("preprocess: no progress count (%s)", e)
            return
        if not (failed and not counts):
            log.info("preprocess: %s", line(counts, self.files, self.todo, self._seconds(), final))
        rate = counts.get(ENCODED, 0) / max(self._seconds(), 1e-9)
        if self.metric and not final:
            metrics.gauge(f"{self.metric}_per_s", rate, self.run)

    def _seconds(self) -> float:
        return time.monotonic() - self.started


def line(counts: dict[str, int], files: int, todo: int, seconds: float, final: bool) -> str:
    """What the progress line says (after ``preprocess: ``): the images (and clip samples: a
    clip may give several) encoded of those to encode, their rate and ETA (or that the encoders
    are still loading), and the files read, cached and skipped, from the first second on.
    ``files``: the files listed; ``todo``: the listing's guess of those with something to
    encode, one image each until it is read."""
    read, encoded = counts.get(READ, 0), counts.get(ENCODED, 0)
    cached, skipped = counts.get(CACHED, 0), counts.get(SKIPPED, 0)
    to_encode, samples = counts.get(TO_ENCODE, 0), counts.get(SAMPLES, 0)
    # every file read: how many there are to encode is known; else those of the files read
    # and the listing's guess for the files not read yet
    unread = max(todo - (read - cached - skipped), 0)
    total = to_encode if read >= files else to_encode + unread
    rate = encoded / seconds if seconds > 0 else 0.0
    what = "images"
    if samples:
        what = "clip samples" if samples == to_encode else "images and clip samples"
    files_part = f"files read {read}/{files} ({cached} cached, {skipped} skipped)"
    if final:
        if not total and not encoded:
            return f"nothing to encode; {files_part} in {seconds:.1f} s"
        return f"{what} encoded {encoded}/{total} in {seconds:.1f} s ({rate:.1f}/s); {files_part}"
    if encoded:
        left = max(total - encoded, 0)
        eta = datetime.timedelta(seconds=round(left / rate)) if rate else "?"
        return f"{what} encoded {encoded}/{total} ({rate:.1f}/s) ETA {eta}; {files_part}"
    if total and not counts.get(READY):
        return f"{what} encoded 0/{total} (the encoders are loading); {files_part}"
    if total:
        return f"{what} encoded 0/{total} (encoding the first batch); {files_part}"
    return f"{what} encoded 0/0; {files_part}"
