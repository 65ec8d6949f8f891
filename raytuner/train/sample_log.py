"""The sample log (``train.sample_log``): which cache rows every step trained, on which rank.

Each rank writes the records since its last report as one JSON-lines file, atomically, under
``<run>/samples/<attempt>/`` where an attempt is one start of the worker group (a restart after a
failure or a resubmission is a new attempt). Steps redone after a restart appear in two
attempts; the reader keeps the latest attempt that trained a step.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

import torch.distributed as dist

from raytuner import storage
from raytuner.checkpoint.layout import SAMPLES


def attempt_id() -> str:
    """Rank 0's start time, shared by every rank of the group: sortable, new on every start."""
    stamp = [time.time_ns()]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(stamp, src=0)
    return f"{stamp[0]:020d}"


class SampleLog:
    """Buffers this rank's records and writes them at every report (no-op without a run dir)."""

    def __init__(self, run_dir: str | None, attempt: str, rank: int, world: int) -> None:
        self.run_dir, self.attempt, self.rank, self.world = run_dir, attempt, rank, world
        self.records: list[dict] = []

    def add(self, step: int, epoch: int, index: int, ids: list[str], more=None) -> None:
        """A step's record; ``more``: what else it says (a run of experts in turn: the
        step's ``expert`` and its samples' noise levels, ``sigma``)."""
        if self.run_dir is not None:
            record = {"step": step, "epoch": epoch, "index": index, "ids": ids} | (more or {})
            self.records.append(record | {"rank": self.rank, "world": self.world})

    def flush(self) -> None:
        if not self.records:
            return
        first, last = self.records[0]["step"], self.records[-1]["step"]
        name = f"rank{self.rank:03d}-{first:09d}-{last:09d}.jsonl"
        fs, path = storage.resolve(storage.join(self.run_dir, SAMPLES, self.attempt, name))
        lines = "".join(json.dumps(r) + "\n" for r in self.records)
        storage.write_atomic(fs, path, lines.encode())
        self.records = []


def read_attempts(run_dir: str) -> list[dict[int, dict[int, dict]]]:
    """Every attempt, oldest first, as step -> rank -> record."""
    fs, root = storage.resolve(storage.join(run_dir, SAMPLES))
    if not storage.exists(fs, root):
        return []
    out = []
    for attempt in storage.listdir(fs, root):
        steps: dict[int, dict[int, dict]] = defaultdict(dict)
        for info in storage.listdir(fs, attempt.path):
            if not info.base_name.endswith(".jsonl"):
                continue  # a temporary file of a write in flight
            for line in storage.read_bytes(fs, info.path).decode().splitlines():
                record = json.loads(line)
                steps[record["step"]][record["rank"]] = record
        out.append(dict(steps))
    return out


def trained(run_dir: str) -> dict[int, list[str]]:
    """step -> the rows of its global batch (rank slices in rank order), from the latest
    attempt in which every rank of the group logged that step."""
    out: dict[int, list[str]] = {}
    for steps in read_attempts(run_dir):
        for step, ranks in steps.items():
            world = next(iter(ranks.values()))["world"]
            if sorted(ranks) == list(range(world)):
                out[step] = [i for r in range(world) for i in ranks[r]["ids"]]
    return dict(sorted(out.items()))
