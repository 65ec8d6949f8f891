"""The validation actor's work, in process: a checkpoint's LoRA rendered into a grid PNG, its
record and a TensorBoard image, even when Ray Train deleted the checkpoint before the render
ran; a render that fails is recorded and the next one still runs (in a run, training never
sees the failure)."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import torch
from PIL import Image

from raytuner.checkpoint.layout import EXPORT
from raytuner.config import LoraConfig
from raytuner.families import FAMILIES
from raytuner.families.parts import Source
from raytuner.render.validation import RenderSpec, Validator
from raytuner.train.model import adapt

TINY = Source("tiny")


def _checkpoint(folder: Path) -> Path:
    """A checkpoint folder holding the export of a LoRA whose up-projections are non-zero."""
    family = FAMILIES["sd15"]
    torch.manual_seed(0)
    weights = adapt(
        family.denoiser(TINY),
        mode="lora",
        lora=LoraConfig(rank=4),
        targets=family.adapters.targets,
        ema_decay=0,
    )
    with torch.no_grad():
        for p in weights.params:
            p.add_(torch.randn_like(p) * 0.5)
    weights.export_lora(str(folder / EXPORT), family, {"raytuner.family": "sd15"})
    return folder


def test_renders_a_grid_per_checkpoint_and_survives_a_failed_render(ray_local, tmp_path):
    run = tmp_path / "run"
    spec = RenderSpec(
        family="sd15",
        pretrained="tiny",
        revision="",
        dtype="auto",
        prompts=["a red circle", "a blue square"],
        seeds=[0, 1, 2],
        steps=2,
        size=(64, 64),
        run_dir=str(run),
        tensorboard=True,
    )
    checkpoint = _checkpoint(tmp_path / "ckpt")  # before the render thread imports diffusers
    validator = Validator(asdict(spec))
    local = pafs.LocalFileSystem()
    validator.enqueue(3, str(tmp_path / "missing"), local)
    validator.enqueue(6, str(checkpoint), local)
    # Ray Train deletes checkpoints beyond checkpoint.keep, maybe before their render runs:
    # the render uses the copy taken when it was queued
    validator.fetch.submit(lambda: None).result()  # one fetch thread: the copies are done
    shutil.rmtree(checkpoint)
    failed, done = validator.drain()

    assert failed["step"] == 3 and "FileNotFoundError" in failed["error"]
    assert not (run / "validation" / "step_000003.png").exists()
    assert done["step"] == 6 and "error" not in done
    grid = np.asarray(Image.open(run / "validation" / "step_000006.png"))
    assert grid.shape == (128, 192, 3)  # 2 prompts x 3 seeds at 64 px
    assert not np.array_equal(grid[:64, :64], grid[:64, 64:128])  # seeds differ
    record = json.loads((run / "validation" / "step_000006.json").read_text())
    assert record["prompts"] == spec.prompts and record["seeds"] == [0, 1, 2]
    assert record["finished_at"] >= record["started_at"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Images("validation")] == [6]
