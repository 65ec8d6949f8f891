"""A damaged file anywhere in a checkpoint is a CheckpointError, which resume answers by
falling back to the previous checkpoint: a worker's ``restore`` (``train/loop.py``) on a run
folder whose newest checkpoint is damaged takes the one before, with a warning naming the
damaged file. Before, a truncated optimizer state or a missing export crashed the restore
instead, and every restart of the worker group crashed the same way; 8 flipped bytes in any
file loaded silently (the checksums each checkpoint lists now catch them). (End to end, in a
resubmitted elastic run: tests/train/test_elastic.py; sharded checkpoints:
tests/checkpoint/test_sharded_checkpoints.py, tests/train/test_fsdp.py.)"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from raytuner.checkpoint import files, layout
from raytuner.config import LoraConfig
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.train.model import adapt


def _truncate(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _empty(path: Path) -> Path:
    path.write_bytes(b"")
    return path


def _flip(path: Path) -> Path:
    """8 bytes in the middle of the file flipped: its size and every header intact."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2 + 8
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))
    return path


def _exported(d: Path) -> Path:
    return next(p for p in sorted((d / layout.EXPORT).rglob("*.safetensors")))


# each damage returns the damaged file (None: no one file)
DAMAGE = {
    "truncated optimizer state": lambda d: _truncate(d / layout.OPTIMIZER),
    "empty optimizer state": lambda d: _empty(d / layout.OPTIMIZER),
    "empty weights file": lambda d: _empty(d / layout.WEIGHTS),
    "missing export": lambda d: (
        [p.unlink() for p in (d / layout.EXPORT).rglob("*") if p.is_file()] and None
    ),
    "empty exported file": lambda d: _empty(_exported(d)),
    "missing state (incomplete)": lambda d: (d / layout.STATE).unlink(),
    # loaded without an error before checksums, each a silently different run
    "8 flipped bytes in the weights": lambda d: _flip(d / layout.WEIGHTS),
    "8 flipped bytes in the optimizer state": lambda d: _flip(d / layout.OPTIMIZER),
    "8 flipped bytes in an exported file": lambda d: _flip(_exported(d)),
    "truncated weights": lambda d: _truncate(d / layout.WEIGHTS),
}


def trained(steps: int = 1):
    """A LoRA on the tiny SD1.5 UNet (the same initial weights every call), its AdamW and LR
    schedule after ``steps`` optimizer steps, and the export of its weights into a folder."""
    family = FAMILIES["sd15"]
    torch.manual_seed(0)
    weights = adapt(
        family.denoiser(Source("tiny")),
        mode="lora",
        lora=LoraConfig(rank=2, alpha=2.0),
        targets=family.adapters.targets,
        ema_decay=0.0,
    )
    opt = torch.optim.AdamW(weights.params, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for _ in range(steps):
        for p in weights.params:
            p.grad = torch.ones_like(p)
        opt.step()
        sched.step()
    export = lambda folder: weights.export_lora(folder, family, {})  # noqa: E731
    return weights, opt, sched, export


def _checkpoint(directory: Path, steps: int = 1):
    weights, opt, sched, export = trained(steps)
    state = files.TrainState(step=steps)
    files.save_checkpoint(str(directory), weights, opt, sched, state, {}, export)
    return weights, opt, sched


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_file_is_a_checkpoint_error(damage, tmp_path):
    weights, opt, sched = _checkpoint(tmp_path)
    assert (
        files.load_checkpoint(str(tmp_path), weights, opt, sched).step == 1
    )  # intact: loads
    damaged = DAMAGE[damage](tmp_path)
    with pytest.raises(files.CheckpointError) as error:
        files.load_checkpoint(str(tmp_path), weights, opt, sched)
    assert os.path.isdir(tmp_path)
    if damaged is not None:  # the message names the damaged file
        assert str(error.value).startswith(f"{damaged}: "), str(error.value)


class _Restoring:
    """A training worker as far as restoring goes: its checkpoints (the run folder, rank 0,
    replicated) and the fresh (untrained) weights, optimizer and schedule it restores into."""

    def __init__(self, run_dir: Path) -> None:
        from raytuner.checkpoint.checkpointer import Checkpointer
        from raytuner.config import CheckpointConfig

        settings = CheckpointConfig()
        self.checkpoints = Checkpointer(
            str(run_dir), settings, rank=0, sharded=False, max_steps=10
        )
        self.weights, self.opt, self.sched, _ = trained(steps=0)

    def restore(self):
        return self.checkpoints.restore(self.weights, self.opt, self.sched)


def _restoring_worker(run_dir: Path):
    return _Restoring(run_dir)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_worker_restores_the_previous_checkpoint_when_the_newest_is_damaged(
    damage, tmp_path, caplog
):
    """Two checkpoints in a run folder as Ray Train names them (steps 1 and 2): the newest is
    damaged, the worker restores step 1's weights, optimizer and schedule, and says which
    checkpoint it skipped (an incomplete one, without state.json, is not even tried)."""
    older, newest = (tmp_path / f"checkpoint_2026-01-01_00-00-0{s}.000000" for s in (1, 2))
    for step, folder in ((1, older), (2, newest)):
        folder.mkdir()
        _checkpoint(folder, steps=step)
    expected = trained(steps=1)[0].state()
    assert any(not torch.equal(expected[k], v) for k, v in trained(steps=2)[0].state().items())
    damaged = DAMAGE[damage](newest)

    worker = _restoring_worker(tmp_path)
    with caplog.at_level(logging.INFO, logger="raytuner.train"):
        state = worker.restore()
    assert state.step == 1
    restored = worker.weights.state()
    assert restored.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(restored[key], value), key
    assert worker.sched.last_epoch == 1
    assert all(s["step"] == 1 for s in worker.opt.state_dict()["state"].values())
    skipped = [r.getMessage() for r in caplog.records if "skipping unreadable" in r.getMessage()]
    if damage.startswith("missing state"):
        assert not skipped  # incomplete: not a candidate
    else:
        assert len(skipped) == 1 and str(newest) in skipped[0], skipped
        assert damaged is None or f"{damaged}: " in skipped[0], skipped
    assert any("rank 0 resumed at step 1 " in r.getMessage() for r in caplog.records)


def test_a_worker_refuses_a_run_folder_whose_every_checkpoint_is_damaged(tmp_path):
    folder = tmp_path / "checkpoint_2026-01-01_00-00-01.000000"
    folder.mkdir()
    _checkpoint(folder)
    (folder / layout.WEIGHTS).write_bytes(b"")
    with pytest.raises(RuntimeError, match="no readable checkpoint in .*start a new run"):
        _restoring_worker(tmp_path).restore()
