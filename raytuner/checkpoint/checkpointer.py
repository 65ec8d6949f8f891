"""A training worker's checkpoints: when one is due, this worker's part written and reported
through ``ray.train.report``, the completion marker and the pruning (rank 0), and the newest
readable checkpoint restored. The file format is the strategy's, picked once: replicated
(``scaling.strategy = "ddp"``: rank 0 writes the whole tensors, ``files.py``) or sharded
(``"fsdp"``: every worker writes its rows, ``sharded.py``)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray.train
import torch.distributed as dist
from safetensors import SafetensorError

from raytuner import storage
from raytuner.checkpoint import files, layout
from raytuner.checkpoint.files import TrainState

log = logging.getLogger("raytuner.train")


@dataclass(frozen=True, kw_only=True)
class Contents:
    """What a checkpoint holds besides the train state: the trained weights (``Weights``), the
    optimizer and LR schedule, the JSON records (file name -> content) and the LoRA export
    (``export(folder)``, called on every worker; only rank 0 is given a folder)."""

    weights: object
    optimizer: object
    lr_schedule: object
    records: Callable[[], dict]
    export: Callable[[str | None], None]


class Checkpointer:
    """One worker's view of the run's checkpoints (``checkpoint`` settings, the run folder)."""

    def __init__(self, run_dir: str, settings, *, rank: int, sharded: bool, max_steps: int,
                 validation_every: int = 0) -> None:  # fmt: skip
        self.run_dir, self.settings, self.rank, self.sharded = run_dir, settings, rank, sharded
        self.max_steps, self.validation_every = max_steps, validation_every
        self._announced = False  # a preemption was announced and checkpointed for

    @property
    def writes(self) -> bool:
        """Whether this worker writes files: rank 0 alone, or every worker its rows."""
        return self.rank == 0 or self.sharded

    def due(self, step: int) -> bool:
        """A checkpoint every ``checkpoint.every_steps``, every validation's steps and at the
        last step."""
        every = [self.settings.every_steps] + [self.validation_every] * bool(self.validation_every)
        return step == self.max_steps or any(step % n == 0 for n in every)

    def preemption_announced(self, step: int) -> bool:
        """Whether Ray announced a preemption of a node of this group (one actor round trip,
        every ``checkpoint.preemption_check_every`` steps); true once, for one checkpoint."""
        if self._announced:
            return False
        every = self.settings.preemption_check_every
        self._announced = (
            bool(every) and step % every == 0 and ray.train.get_preemption_info() is not None
        )
        return self._announced

    def restore(self, weights, optimizer, lr_schedule) -> TrainState:
        """The newest readable checkpoint's state, applied to the weights, optimizer and LR
        schedule; a broken one is skipped with a warning naming the damaged file. A fresh state
        without a checkpoint.

        The run folder's complete checkpoints are the candidates, newest first (the one
        ``raytuner sample --checkpoint latest`` takes), not Ray Train's latest: Ray registers a
        checkpoint only once its controller has taken the report, so after an interrupted
        driver its list lacks the newest ones (``layout.prune_checkpoints`` removes them)."""
        fs, folders = layout.complete_checkpoints(self.run_dir)
        if not folders:
            self._say("no checkpoint in %s: training from step 1", self.run_dir)
            return TrainState()
        self._say("restoring the newest complete checkpoint: %s", folders[0])
        for path in folders:
            try:
                state = self._load(fs, path, weights, optimizer, lr_schedule)
            except files.CheckpointError as e:
                log.warning("rank %d: skipping unreadable checkpoint: %s", self.rank, e)
                continue
            log.info(
                "rank %d resumed at step %d (epoch %d, batch %d) from %s",
                *(self.rank, state.step, state.epoch, state.index, path),
            )
            return state
        raise RuntimeError(f"no readable checkpoint in {self.run_dir}: start a new run instead")

    def _load(self, fs, path: str, weights, optimizer, lr_schedule) -> TrainState:
        if self.sharded:  # read in place: each rank fetches its rows
            return files.load_checkpoint(path, weights, optimizer, lr_schedule, fs, sharded=True)
        candidate = ray.train.Checkpoint(path, filesystem=fs)
        with candidate.as_directory() as directory:
            return files.load_checkpoint(directory, weights, optimizer, lr_schedule)

    def save(self, state: TrainState, contents: Contents, metrics: dict, preempted: bool) -> float:
        """A checkpoint of ``state`` through ``ray.train.report`` (a barrier: every rank calls
        it): the workers that write put their part in a local folder, which Ray uploads into the
        same checkpoint folder, then deletes here. Once every rank is past its upload, rank 0
        writes ``state.json``: the checkpoint is complete; what Ray never registered and what
        ``checkpoint.keep`` passed goes. ``preempted``: taken because a preemption was
        announced (rank 0 warns). Returns the seconds it took.

        Only checkpoints are reported: Ray Train 2.60 takes one report per worker each health
        check (2 s), and a report blocks until the previous one is taken, so reporting every
        log window would throttle fast steps."""
        started, step = time.perf_counter(), state.step
        name, checkpoint, local = layout.checkpoint_name(step), None, None
        if self.rank == 0 and preempted:
            log.warning("preemption announced: checkpoint at step %d before the node goes", step)
        if self.writes:
            local = self._write(state, contents)
            checkpoint = ray.train.Checkpoint.from_directory(local)
        try:
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)
        finally:  # uploaded by now (Ray 2.60's synchronous report deletes no local copy)
            if local is not None:
                shutil.rmtree(local, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()  # every rank's files are uploaded
        if self.rank == 0:
            files.mark_complete(storage.join(self.run_dir, name), state)
            layout.prune_checkpoints(self.run_dir, self.settings.keep, running=True)
        return time.perf_counter() - started

    def _write(self, state: TrainState, contents: Contents) -> str:
        """This rank's part of the checkpoint of ``state``, in a new local folder under TMPDIR
        (``save`` deletes it once the report has uploaded it); a full disk leaves no
        half-written folder behind."""
        directory = tempfile.mkdtemp(prefix="raytuner-ckpt-")
        c = contents
        try:
            self.write(directory, state, contents)
        # a full disk: OSError from open/write, RuntimeError from torch.save, SafetensorError
        # from safetensors; no half-written folder is left behind
        except (OSError, RuntimeError, SafetensorError) as e:
            shutil.rmtree(directory, ignore_errors=True)
            free = shutil.disk_usage(os.path.dirname(directory)).free
            need = c.weights.local_bytes()
            raise RuntimeError(
                f"checkpoint of step {state.step} could not be written to {directory} ({e}): "
                f"it needs room for the trained weights ({need:,} bytes) about three times over "
                f"(weights, optimizer state, export), {free:,} bytes are free there; free "
                "space there or set TMPDIR"
            ) from e
        return directory

    def write(self, directory: str, state: TrainState, contents: Contents) -> None:
        """This rank's files of a checkpoint of ``state`` into ``directory``, all but the marker
        (``state.json`` comes once every rank's files are uploaded)."""
        c = contents
        files.save_checkpoint(
            directory, c.weights, c.optimizer, c.lr_schedule, state, c.records(), c.export,
            rank=self.rank, sharded=self.sharded, mark=False,
        )  # fmt: skip

    def _say(self, message: str, *args) -> None:
        if self.rank == 0:
            log.info(message, *args)
