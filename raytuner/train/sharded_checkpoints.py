"""A sharded run's checkpoint (``scaling.strategy = "fsdp"``), in torch's Distributed Checkpoint
(DCP) safetensors format: every worker writes its own rows of the trained weights, of their EMA
and of the optimizer state, each into a file of its own (``weights/``, ``ema/``,
``optimizer/``: ``shard-<rank>-model-00001-of-00001.safetensors``, the rows' offsets in the
file's header), and a run resumed on any number of workers reads the rows it now owns from
whichever files hold them (DCP reshards on load). No worker ever holds a whole tensor of
another's, nor the whole optimizer state. No pickle: safetensors for the tensors, JSON for the
optimizer's param groups and the LR schedule (rank 0's ``optimizer.json``).

What goes into the checkpoint folder beside these, and the marker that makes it complete, is
``checkpoints.py``'s.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from raytuner.runs import EMA_DIR, OPTIMIZER_DIR, OPTIMIZER_JSON, WEIGHTS_DIR

# what reading a damaged or partial sharded checkpoint raises
ERRORS = (CheckpointException, OSError, ValueError, KeyError, TypeError, SafetensorError)


def is_sharded(directory: str) -> bool:
    """Whether a checkpoint folder holds a sharded run's files."""
    return os.path.isdir(os.path.join(directory, WEIGHTS_DIR))


def _save(tensors: dict[str, torch.Tensor], folder: str) -> None:
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(folder, save_distributed=True))


def _keys(folder: str) -> dict:
    """The tensors a DCP folder holds (name -> its size and dtype), from the files' headers."""
    return HuggingFaceStorageReader(folder).read_metadata().state_dict_metadata


def _load(tensors: dict[str, torch.Tensor], folder: str) -> None:
    """Read a DCP folder into ``tensors`` in place; every one must be there."""
    missing = sorted(set(tensors) - set(_keys(folder)))
    if missing:
        raise KeyError(f"{os.path.basename(folder)}/ lacks {len(missing)} tensors: {missing[:3]}")
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(folder))


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


def load(directory: str, weights, optimizer, lr_schedule, step: int) -> None:
    """Every worker's rows of a sharded checkpoint, at this run's number of workers, into the
    weights, their EMA, the optimizer and the LR schedule (a collective); raises one of
    ``ERRORS`` on every worker alike (DCP shares a worker's failure with all)."""
    with open(os.path.join(directory, OPTIMIZER_JSON)) as f:
        record = json.load(f)
    _load(weights.tensors(), os.path.join(directory, WEIGHTS_DIR))
    if (ema := weights.ema_tensors()) is not None:
        _load(ema, os.path.join(directory, EMA_DIR))
        weights.ema.optimization_step = step
    folder = os.path.join(directory, OPTIMIZER_DIR)
    params = dict(zip(weights.names, weights.params, strict=True))
    targets = {}
    for key, saved in _keys(folder).items():
        param, size = params[key.rsplit(".", 1)[0]], tuple(saved.size)
        dtype = saved.properties.dtype
        # a tensor like its parameter (moments) is sharded like it; others (a step count) whole
        like = size == tuple(param.shape)
        targets[key] = (
            torch.empty_like(param, dtype=dtype) if like else torch.empty(size, dtype=dtype)
        )
    _load(targets, folder)
    state: dict[str, dict] = {}
    for key, value in (targets | record["values"]).items():
        name, entry = key.rsplit(".", 1)
        state.setdefault(name, {})[entry] = value
    set_optimizer_state_dict(
        weights.denoiser, optimizer, {"state": state, "param_groups": record["param_groups"]}
    )
    lr_schedule.load_state_dict(record["lr_schedule"])
