"""What a checkpoint folder holds and how it is read: safetensors for the trained weights, a
torch tensors-only file for the optimizer state (loaded with ``weights_only=True``; a sharded
run's: ``sharded.py``), JSON for the rest, checksums of every file, and ``state.json`` last, the
marker that makes it complete."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pickle import UnpicklingError

import pyarrow.fs as pafs
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from raytuner import storage
from raytuner.checkpoint import checksums
from raytuner.checkpoint import sharded as sharded_format
from raytuner.checkpoint.layout import (
    DENOISER,
    EMA,
    EMA_DIR,
    EXPORT,
    OPTIMIZER,
    OPTIMIZER_DIR,
    STATE,
    WEIGHTS,
    WEIGHTS_DIR,
)


@dataclass
class TrainState:
    """Where training stands: the global step and the data cursor (next global batch)."""

    step: int = 0
    epoch: int = 0
    index: int = 0
    first_loss: float | None = None
    loss: float | None = None


class CheckpointError(ValueError):
    """A checkpoint folder that is incomplete or unreadable."""


def save_checkpoint(
    directory: str,
    weights,
    optimizer,
    lr_schedule,
    state: TrainState,
    records,
    export,
    *,
    rank: int = 0,
    sharded: bool = False,
    mark: bool = True,
) -> None:
    """This worker's part of a checkpoint, into ``directory``. Unsharded, rank 0 writes it all:
    the trained tensors (and their EMA), the optimizer and LR schedule; sharded, every worker
    writes its rows (``sharded``: ``sharded.py``). Rank 0 adds the JSON ``records`` (file name ->
    content: the run's identity, the resolved job), a full fine-tune's denoiser config and a
    LoRA's export (``export(folder)``, called on every worker: a sharded LoRA is gathered, and
    only rank 0 is given a folder). Every worker that wrote files lists their checksums
    (``checksums/rank-<rank>.json``). ``mark``: ``state.json`` last, so a folder without it is
    incomplete; a worker leaves it to ``mark_complete``, once every worker's files are in."""
    if sharded:
        sharded_format.save(directory, weights, optimizer, lr_schedule, rank)
    elif rank == 0:
        save_file(weights.state(), os.path.join(directory, WEIGHTS))
        if (ema := weights.ema_state()) is not None:
            save_file(ema, os.path.join(directory, EMA))
        torch.save(
            {"optimizer": optimizer.state_dict(), "lr_schedule": lr_schedule.state_dict()},
            os.path.join(directory, OPTIMIZER),
        )
    if weights.mode == "lora":
        export(os.path.join(directory, EXPORT) if rank == 0 else None)
    if rank == 0:
        if weights.mode == "full":
            records = records | {DENOISER: json.loads(weights.denoiser.to_json_string())}
        for name, record in records.items():
            with open(os.path.join(directory, name), "w") as f:
                json.dump(record, f, indent=2, sort_keys=True)
    if rank == 0 or sharded:
        write_checksums(directory, rank)
    if rank == 0 and mark:
        with open(os.path.join(directory, STATE), "w") as f:
            json.dump(asdict(state), f)


def write_checksums(directory: str, rank: int) -> None:
    """The checksums of every file a worker wrote into its folder ``directory``, in
    ``checksums/rank-<rank>.json``: the trained tensors' (read by ranges) per block of rows,
    every other file's whole (``raytuner/checksums.py``)."""
    ranged = (WEIGHTS, EMA, WEIGHTS_DIR, EMA_DIR, OPTIMIZER_DIR)
    checksums.write(directory, f"rank-{rank:05d}.json", lambda p: p.split("/")[0] in ranged)


def mark_complete(checkpoint: str, state: TrainState) -> None:
    """``state.json`` into an uploaded checkpoint (a path or URI), once every worker's files are
    in it: from then on it is complete (``layout.complete_checkpoints``)."""
    fs, folder = storage.resolve(checkpoint)
    storage.write_json_atomic(fs, storage.join(folder, STATE), asdict(state))


# what reading a damaged file raises (torch.load of a truncated or emptied file: RuntimeError,
# not a zip, or EOFError)
_READ_ERRORS = (
    OSError,
    ValueError,
    TypeError,
    KeyError,
    EOFError,
    RuntimeError,
    SafetensorError,
    UnpicklingError,
)


def _read(fs, directory: str, name: str, sums: checksums.Sums | None, read):
    """``read(path)`` of the checkpoint file ``name``, checked against its checksums first;
    raises CheckpointError naming the file."""
    path = storage.join(directory, name)
    try:
        if sums is not None:
            sums.check(fs, path)
        return read(path)
    except _READ_ERRORS as e:
        raise CheckpointError(_damage(path, e)) from e


def _damage(path: str, e: BaseException) -> str:
    """What is wrong with a file: a DamagedFileError names it already."""
    if isinstance(e, checksums.DamagedFileError):
        return str(e)
    return f"{path}: {type(e).__name__}: {e}"


def read_checkpoint(directory: str, weights) -> tuple[dict, dict | None, dict, TrainState]:
    """(tensors, EMA tensors, optimizer and LR state, train state) of an unsharded checkpoint,
    every file checked against its checksums and all checked against ``weights`` before any is
    applied; raises CheckpointError naming the damaged file."""
    fs = pafs.LocalFileSystem()
    try:
        sums = checksums.Sums.read(fs, directory)
    except checksums.DamagedFileError as e:
        raise CheckpointError(str(e)) from e
    state = _read(fs, directory, STATE, None, lambda p: TrainState(**storage.read_json(fs, p)))
    tensors = _read(fs, directory, WEIGHTS, sums, load_file)
    ema = _read(fs, directory, EMA, sums, load_file) if weights.ema is not None else None
    extra = _read(fs, directory, OPTIMIZER, sums, lambda p: torch.load(p, weights_only=True))
    for key in ("optimizer", "lr_schedule"):
        if key not in extra:
            raise CheckpointError(f"{storage.join(directory, OPTIMIZER)}: no {key} in it")
    try:
        _trained_files_complete(fs, directory, weights, sums)
    except _READ_ERRORS as e:
        raise CheckpointError(_damage(directory, e)) from e
    if set(tensors) != weights.keys():
        missing = sorted(weights.keys() - set(tensors))[:3]
        raise CheckpointError(f"{directory}: weights do not match the model (missing {missing})")
    if ema is not None and set(ema) != set(weights.names):
        raise CheckpointError(f"{directory}: the EMA does not match the trained weights")
    return tensors, ema, extra, state


def _trained_files_complete(fs: pafs.FileSystem, directory: str, weights, sums) -> None:
    """What renders and exports read: a LoRA's export, a full fine-tune's denoiser config;
    checked against their checksums."""
    if weights.mode == "lora":
        _export_complete(fs, storage.join(directory, EXPORT), sums)
    elif not storage.exists(fs, storage.join(directory, DENOISER)):
        raise FileNotFoundError(f"{DENOISER} is missing")
    elif sums is not None:
        sums.check(fs, storage.join(directory, DENOISER))


def _export_complete(fs: pafs.FileSystem, folder: str, sums) -> None:
    """The export inside a checkpoint: present, no empty file in it, every file its checksums
    list there and each as written."""
    found = storage.exists(fs, folder)
    files = fs.get_file_info(pafs.FileSelector(folder, recursive=True)) if found else []
    files = [f for f in files if f.type == pafs.FileType.File]
    if not files:
        raise FileNotFoundError(f"{EXPORT}/ is missing or empty")
    if empty := [f.path for f in files if f.size == 0]:
        raise checksums.DamagedFileError(f"{empty[0]}: an empty file")
    for path in sums.under(folder) if sums is not None else []:
        sums.check(fs, path)


def load_checkpoint(
    directory: str,
    weights,
    optimizer,
    lr_schedule,
    fs: pafs.FileSystem | None = None,
    *,
    sharded: bool = False,
) -> TrainState:
    """A checkpoint's state applied to the weights, optimizer and LR schedule; raises
    CheckpointError naming the damaged file. Unsharded: ``directory`` is local (a downloaded
    copy). ``sharded``: read where it is on ``fs`` (default: the local disk), a collective, each
    worker fetching the rows it owns and checking their checksums."""
    fs = fs or pafs.LocalFileSystem()
    if sharded_format.is_sharded(fs, directory) != sharded:
        written = "sharded" if sharded else "unsharded"
        raise CheckpointError(f"{directory}: not written by an {written} run")
    if not sharded:
        tensors, ema, extra, state = read_checkpoint(directory, weights)
        weights.load(tensors)
        if ema is not None:
            weights.load_ema(ema, state.step)
        optimizer.load_state_dict(extra["optimizer"])
        lr_schedule.load_state_dict(extra["lr_schedule"])
        return state
    try:
        state = TrainState(**storage.read_json(fs, storage.join(directory, STATE)))
        sums = checksums.Sums.read(fs, directory)
        _trained_files_complete(fs, directory, weights, sums)
        sharded_format.load(fs, directory, weights, optimizer, lr_schedule, state.step, sums)
    except sharded_format.ERRORS as e:
        raise CheckpointError(sharded_format.reason(directory, e)) from e
    return state
