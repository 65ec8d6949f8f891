"""Checks on a training run from outside: what Ray Train has committed, and whether the LoRA
is what a user can use (the diffusers SDXL pipeline loads it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from raytuner.families import FAMILIES


def committed(run_dir: str) -> int:
    """The step of the latest checkpoint Ray Train has registered (what a restart resumes
    from), from its snapshot file; 0 before the first."""
    try:
        snapshot = json.loads(Path(run_dir, "checkpoint_manager_snapshot.json").read_text())
        return snapshot["latest_checkpoint_result"]["metrics"]["step"]
    except (OSError, ValueError, KeyError, TypeError):  # not yet written, or being replaced
        return 0


def lora_changes_the_pipeline(lora_dir: str) -> bool:
    """Load ``lora_dir`` into the tiny SDXL pipeline: finite images that differ from the base's."""
    pipe = FAMILIES["sdxl"].pipeline("tiny", "")

    def image():
        generator = torch.Generator().manual_seed(0)
        return pipe(
            "a red circle",
            num_inference_steps=2,
            height=64,
            width=64,
            output_type="np",
            generator=generator,
        ).images

    before = image()
    pipe.load_lora_weights(lora_dir)
    after = image()
    return bool(np.isfinite(after).all() and not np.allclose(before, after))
