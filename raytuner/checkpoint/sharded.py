"""A sharded run's checkpoint (``scaling.strategy = "fsdp"``), in torch's Distributed Checkpoint
(DCP) safetensors format: every worker writes its own rows of the trained weights, of their EMA
and of the optimizer state, each into a file of its own (``weights/``, ``ema/``,
``optimizer/``: ``shard-<rank>-model-00001-of-00001.safetensors``, the rows' offsets in the
file's header), and a run resumed on any number of workers reads the rows it now owns from
whichever files hold them (DCP reshards on load). No worker ever holds a whole tensor of
another's, nor the whole optimizer state. No pickle: safetensors for the tensors, JSON for the
optimizer's param groups and the LR schedule (rank 0's ``optimizer.json``).

A resume reads the files where they are (local disk, a shared filesystem or object storage)
through ``shards.RangeReader``: each worker fetches the headers, then only the bytes of the
rows it owns, never a whole checkpoint (a Flux full fine-tune's is 143 GB; 8 workers of a node
each downloading it would be a terabyte).

What goes into the checkpoint folder beside these, and the marker that makes it complete, is
``checkpoints.py``'s.
"""

from __future__ import annotations

import json
import os

import pyarrow.fs as pafs
import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from raytuner import storage
from raytuner.checkpoint import checksums
from raytuner.checkpoint.layout import EMA_DIR, OPTIMIZER_DIR, OPTIMIZER_JSON, WEIGHTS_DIR
from raytuner.checkpoint.ranges import RangeReader

# what reading a damaged or partial sharded checkpoint raises
ERRORS = (CheckpointException, OSError, ValueError, KeyError, TypeError, SafetensorError)


def reason(checkpoint: str, e: BaseException) -> str:
    """What is wrong with a sharded checkpoint, on one line: a damaged file names itself; DCP's
    ``CheckpointException`` (every worker's traceback) gives way to the first worker's error."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    if isinstance(e, checksums.DamagedFileError):
        return str(e)
    return f"{checkpoint}: {type(e).__name__}: {e}"


def is_sharded(fs: pafs.FileSystem, checkpoint: str) -> bool:
    """Whether a checkpoint folder holds a sharded run's files."""
    return storage.exists(fs, storage.join(checkpoint, WEIGHTS_DIR))


def _save(tensors: dict[str, torch.Tensor], folder: str) -> None:
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(folder, save_distributed=True))


def _load(tensors: dict[str, torch.Tensor], reader: RangeReader) -> None:
    """Read a DCP folder into ``tensors`` in place; every one must be there."""
    missing = sorted(set(tensors) - set(reader.read_metadata().state_dict_metadata))
    if missing:
        raise KeyError(f"{storage.basename(reader.folder)}/ lacks {len(missing)}: {missing[:3]}")
    dcp.load(tensors, storage_reader=reader)


def save(directory: str, weights, optimizer, lr_schedule, rank: int) -> None:
    """This worker's rows into ``directory`` (a collective: every worker calls it, each with a
    folder of its own that the upload merges); rank 0 also writes the JSON."""
    _save(weights.tensors(), os.path.join(directory, WEIGHTS_DIR))
    if (ema := weights.ema_tensors()) is not None:
        _save(ema, os.path.join(directory, EMA_DIR))
    state = get_optimizer_state_dict(weights.denoiser, optimizer)
    tensors, values = {}, {}
    for name, entries in state["state"].items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                tensors[f"{name}.{key}"] = value
            else:
                values[f"{name}.{key}"] = value
    _save(tensors, os.path.join(directory, OPTIMIZER_DIR))
    if rank == 0:
        record = {"param_groups": state["param_groups"], "values": values}
        record["lr_schedule"] = lr_schedule.state_dict()
        with open(os.path.join(directory, OPTIMIZER_JSON), "w") as f:
            json.dump(record, f, indent=2, sort_keys=True)


def load(
    fs: pafs.FileSystem,
    checkpoint: str,
    weights,
    optimizer,
    lr_schedule,
    step: int,
    sums: checksums.Sums | None = None,
) -> None:
    """Every worker's rows of a sharded checkpoint (on ``fs``, read in place), at this run's
    number of workers, into the weights, their EMA, the optimizer and the LR schedule (a
    collective), each piece checked against the checkpoint's checksums ``sums`` (None: a
    checkpoint written before them); raises one of ``ERRORS`` on every worker alike (every
    worker reads every header; DCP shares a worker's failure to read its rows with all)."""
    path = storage.join(checkpoint, OPTIMIZER_JSON)
    if sums is not None:
        sums.check(fs, path)
    record = storage.read_json(fs, path)
    _load(weights.tensors(), RangeReader(fs, storage.join(checkpoint, WEIGHTS_DIR), sums))
    if (ema := weights.ema_tensors()) is not None:
        _load(ema, RangeReader(fs, storage.join(checkpoint, EMA_DIR), sums))
        weights.ema.optimization_step = step
    reader = RangeReader(fs, storage.join(checkpoint, OPTIMIZER_DIR), sums)
    params = dict(zip(weights.names, weights.params, strict=True))
    targets = {}
    for key, saved in reader.read_metadata().state_dict_metadata.items():
        param, size = params[key.rsplit(".", 1)[0]], tuple(saved.size)
        dtype = saved.properties.dtype
        # a tensor like its parameter (AdamW's moments) is sharded like it; others (its step
        # count) whole
        whole = size != tuple(param.shape)
        like = torch.empty(size, dtype=dtype) if whole else torch.empty_like(param, dtype=dtype)
        targets[key] = like
    _load(targets, reader)
    state: dict[str, dict] = {}
    for key, value in (targets | record["values"]).items():
        name, entry = key.rsplit(".", 1)
        state.setdefault(name, {})[entry] = value
    set_optimizer_state_dict(
        weights.denoiser, optimizer, {"state": state, "param_groups": record["param_groups"]}
    )
    lr_schedule.load_state_dict(record["lr_schedule"])
