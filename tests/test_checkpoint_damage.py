"""A damaged file anywhere in a checkpoint is a CheckpointError, which resume answers by
falling back to the previous checkpoint (tests/test_train_exact.py covers that fallback for a
damaged weights file); before, a truncated optimizer state or a missing export crashed the
restore instead, and every restart of the worker group crashed the same way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from raytuner import runs
from raytuner.config import LoraConfig
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.train import checkpoints
from raytuner.train.weights import Weights


def _damage_truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


DAMAGE = {
    "truncated optimizer state": lambda d: _damage_truncate(d / runs.OPTIMIZER),
    "empty optimizer state": lambda d: (d / runs.OPTIMIZER).write_bytes(b""),
    "empty weights file": lambda d: (d / runs.WEIGHTS).write_bytes(b""),
    "missing export": lambda d: [p.unlink() for p in (d / runs.EXPORT).rglob("*") if p.is_file()],
    "empty exported file": lambda d: next(
        p for p in (d / runs.EXPORT).rglob("*.safetensors")
    ).write_bytes(b""),
    "missing state (incomplete)": lambda d: (d / runs.STATE).unlink(),
}


def _checkpoint(directory: Path):
    family = FAMILIES["sd15"]
    weights = Weights(
        family.denoiser(Source("tiny")),
        mode="lora",
        lora=LoraConfig(rank=2, alpha=2.0),
        targets=family.lora_targets,
        ema_decay=0.0,
    )
    opt = torch.optim.AdamW(weights.params, lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for p in weights.params:
        p.grad = torch.ones_like(p)
    opt.step()
    export = lambda folder: weights.export(folder, family, {})  # noqa: E731
    state = checkpoints.TrainState(step=1)
    checkpoints.save_checkpoint(str(directory), weights, opt, sched, state, {}, export)
    return weights, opt, sched


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_checkpoint_file_is_a_checkpoint_error(damage, tmp_path):
    weights, opt, sched = _checkpoint(tmp_path)
    assert (
        checkpoints.load_checkpoint(str(tmp_path), weights, opt, sched).step == 1
    )  # intact: loads
    DAMAGE[damage](tmp_path)
    with pytest.raises(checkpoints.CheckpointError):
        checkpoints.load_checkpoint(str(tmp_path), weights, opt, sched)
    assert os.path.isdir(tmp_path)
